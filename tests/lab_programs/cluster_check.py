"""One lab job that checks the cluster from inside: rendezvous, node size, wire bytes, storage.

    cluster_check.py SHARED_DIR STEPS SHARD

Rank 0 prints one JSON line. The byte figures are the kernel's interface counters, read by
each node's local rank 0 from /sys/class/net inside its namespace, around a phase of
hierarchical LoCo reduce-scatters (and around a phase of tiny ones, whose bytes are the
per-step overhead), next to the CommStats of every rank.
"""

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_ext import LoCoConfig, LoCoReduceScatter
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.node_size import resolve_node_size

shared, steps, shard = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
link = os.environ["GLOO_SOCKET_IFNAME"]


def counters() -> dict[str, int]:
    def read(device: str, kind: str) -> int:
        return int(Path(f"/sys/class/net/{device}/statistics/{kind}_bytes").read_text())

    return {"link_tx": read(link, "tx"), "link_rx": read(link, "rx"), "loopback": read("lo", "tx")}


def gather(obj):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


where = {
    "rank": rank,
    "local_rank": local_rank,
    "group_rank": int(os.environ["GROUP_RANK"]),
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
    "netns": os.readlink("/proc/self/ns/net"),
}
config = LoCoConfig()
node_size = resolve_node_size("auto")  # the launcher's LOCAL_WORLD_SIZE


def phase(shard_elems: int) -> dict:
    """``steps`` hierarchical LoCo reduce-scatters; this node's counters around them."""
    torch.manual_seed(rank)
    comm = LoCoReduceScatter(config, node_size=node_size)
    x = torch.randn(world * shard_elems)
    out = torch.empty(shard_elems)
    call = dict(output_tensor=out, input_tensor=x, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    comm(**call)  # builds the node groups, outside the measured window
    comm.stats = CommStats()
    dist.barrier()
    before = counters() if local_rank == 0 else None
    dist.barrier()
    for _ in range(steps):
        comm(**call)
    dist.barrier()
    after = counters() if local_rank == 0 else None
    dist.barrier()
    delta = None if before is None else {k: after[k] - before[k] for k in before}
    return {"counters": delta, "stats": asdict(comm.stats), "finite": bool(out.isfinite().all())}


tiny = phase(128)
big = phase(shard)

# the shared directory: every rank writes a file, every rank reads every file
payload = bytes([rank]) * (65536 + rank)
path = shared / f"rank{rank}.bin"
with open(path, "wb") as f:
    f.write(payload)
    f.flush()
    os.fsync(f.fileno())
dist.barrier()
seen = {r: (shared / f"rank{r}.bin").read_bytes() == bytes([r]) * (65536 + r) for r in range(world)}
fstype = [
    line.split(" - ")[1].split()[0]
    for line in Path("/proc/self/mountinfo").read_text().splitlines()
    if line.split()[4] == str(shared)
]
mine = {
    "where": where,
    "node_size": node_size,
    "tiny": tiny,
    "big": big,
    "shared_read_ok": all(seen.values()),
    "shared_fstype": fstype[-1] if fstype else None,
}
everyone = gather(mine)
if rank == 0:
    print(json.dumps({"ranks": everyone}), flush=True)
dist.destroy_process_group()
