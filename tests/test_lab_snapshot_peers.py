"""Where in-memory snapshots live across the lab's nodes, and when a stale one must not load.

Real gloo ranks, each "node" with a RAM directory of its own, as the lab's nodes each have
their own /dev/shm. The state is a small ``Stateful`` whose numbers say which rank and step
they belong to, so a load from the wrong place or the wrong world shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_ext.job.snapshot import Snapshots, read_snapshot
from fsdp_ext.testing import run_distributed

JOB = "peers"


class Numbers:
    """A Stateful with one tensor: (rank, step) in every element after ``set``."""

    def __init__(self) -> None:
        self.value = torch.zeros(4)

    def set(self, rank: int, step: int) -> None:
        self.value = torch.full((4,), 1000.0 * rank + step)

    def state_dict(self) -> dict:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"].clone()


def _snapshots(root: Path, state: Numbers, per_node: int) -> Snapshots:
    node = dist.get_rank() // per_node
    return Snapshots({"n": state}, job=JOB, ranks_per_node=per_node, root=root / f"node{node}")


def _placement_then_lost_node(root: str) -> dict:
    """3 nodes x 1 rank: a snapshot of step 2; which node's RAM holds which rank's file;
    then node 1's RAM is wiped, and every rank restores into a fresh state."""
    root = Path(root)
    rank = dist.get_rank()
    state = Numbers()
    state.set(rank, 2)
    _snapshots(root, state, 1).save(2)
    dist.barrier()
    held = sorted(
        read_snapshot(path.read_bytes())[0]["rank"]
        for path in (root / f"node{rank}" / f"fsdp_ext-snapshots-{JOB}").glob("step-*/*.snap")
    )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "node1")
    dist.barrier()
    fresh = Numbers()
    snaps = _snapshots(root, fresh, 1)
    step = snaps.restore()
    return {"held": held, "step": step, "value": float(fresh.value[0]), "from": snaps.recovered}


def test_a_snapshots_copy_goes_to_the_next_node_on_three_nodes(tmp_path):
    """Node i keeps its own file and node i-1's copy (Gemini's ring: node i's copy goes to
    node i+1); node 1's RAM lost, rank 1 gets step 2 back from node 2, exactly (mutant: the
    peer chosen as the previous node, which is the same on 2 nodes and not on 3)."""
    ranks = run_distributed(_placement_then_lost_node, 3, str(tmp_path), timeout=120)
    assert [r["held"] for r in ranks] == [[0, 2], [0, 1], [1, 2]]
    assert [r["step"] for r in ranks] == [2, 2, 2]
    assert [r["value"] for r in ranks] == [2.0, 1002.0, 2002.0]
    assert all(r["from"] == [1] for r in ranks)


def _save(root: str, per_node: int, step: int) -> None:
    state = Numbers()
    state.set(dist.get_rank(), step)
    _snapshots(Path(root), state, per_node).save(step)
    dist.barrier()


def _restore(root: str, per_node: int) -> dict:
    state = Numbers()
    step = _snapshots(Path(root), state, per_node).restore()
    return {"step": step, "value": float(state.value[0])}


def test_a_snapshot_of_another_world_size_never_loads(tmp_path):
    """4 ranks on 2 nodes snapshot step 4; the job restarts on 2 ranks (a node each) with
    the same RAM: every file is whole, yet none belongs to this world, so nothing loads
    and the disk checkpoint is used (mutant: the world-size check dropped, and the stale
    snapshot counts as complete)."""
    run_distributed(_save, 4, str(tmp_path), 2, 4, timeout=120)
    files = sorted(p.name for p in tmp_path.glob("node*/*/step-*/*.snap"))
    assert len(files) == 8  # every rank's own file and its copy on the other node
    ranks = run_distributed(_restore, 2, str(tmp_path), 1, timeout=120)
    assert ranks == [{"step": None, "value": 0.0}, {"step": None, "value": 0.0}]
