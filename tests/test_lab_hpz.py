"""hpZ on a real 2-node lab: backward all-gathers never cross the link (interface counters).

2 nodes x 2 ranks behind a 100 Mbit/s link, qwZ on. With ``reshard_after_forward="node"``
(the node size from torchrun's ``LOCAL_WORLD_SIZE``) each node's link carries, during
backward, only the barriers around the measurement; its loopback carries the node-local
gathers. With a full reshard the same backward sends the int8 weights across the link.

Why it was flaky under load, and the fixes: node 0's other rank ran ahead of local rank 0's
reading into the next step's forward, whose qwZ all-gather sent int8 shards across the
link inside the window (hpz_check.py now fences each reading with a barrier on both
sides); and under c10d, node 1's torchrun agent reads the rendezvous state from node 0's
store once a second, a few KB each time, so the window's bytes grew with its length (the
job uses the static rendezvous, whose agents send nothing while it runs).
"""

from __future__ import annotations

import pytest

from fsdp_ext.lab import Cluster
from tests.lab_helpers import PROGRAMS, require_lab

NODES, RANKS_PER_NODE, STEPS = 2, 2, 3


@pytest.fixture(scope="module")
def ranks():
    require_lab(storage=False)
    # the workers forked from each node's warm server: 10 CPU-s of imports less
    lab = Cluster(NODES, RANKS_PER_NODE, "100mbit", storage=False, rdzv="static", warm_workers=True)
    with lab:
        result = lab.run([str(PROGRAMS / "hpz_check.py"), str(STEPS)], timeout=240)
        assert result.returncode == 0, result.output + "".join(result.rank_stderr)
        yield result.last_json()["ranks"]


def _node(ranks, node):
    return ranks[node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE]


def test_backward_all_gathers_stay_on_the_node(ranks):
    assert {r["local_world_size"] for r in ranks} == {str(RANKS_PER_NODE)}
    for node in range(NODES):
        mine = _node(ranks, node)
        hpz, full = mine[0]["node"]["counters"], mine[0]["full"]["counters"]
        intra = sum(r["node"]["stats"]["intra_node_bytes"] for r in mine)
        crossing = sum(r["full"]["stats"]["bytes_sent"] for r in mine)
        # hpZ: every backward gather was node-local (4 units per step), in full precision
        assert all(r["node"]["stats"]["intra_node_gathers"] == 4 * STEPS for r in mine)
        assert all(r["node"]["stats"]["quantized_gathers"] == 4 * STEPS for r in mine)  # forward
        # What else crosses in that window: the barriers around it (the static
        # rendezvous's agents send nothing while the job runs, and the lab's links carry
        # no IPv6 chatter). One gather leaving the node would add at least one rank's share
        # of it: over 500 KB here.
        one_gather = intra / (RANKS_PER_NODE * 4 * STEPS)
        assert hpz["link_tx"] < one_gather / 4, (hpz, one_gather)
        assert hpz["loopback"] >= intra > 0
        # a full reshard: the same backward gathers int8 weights across the link
        assert all(r["full"]["stats"]["intra_node_gathers"] == 0 for r in mine)
        assert full["link_tx"] > 10 * hpz["link_tx"], (full, hpz)
        assert full["link_tx"] <= 2 * crossing  # what one node's ranks sent, at most
    assert all(r[p]["finite"] for r in ranks for p in ("node", "full"))
