"""In-memory snapshots (fsdp_ext.job.snapshot) on real gloo ranks.

A snapshot restores exactly what was saved (parameters, Adam's moments and step, the LR
schedule); a torn file (cut short, as a write killed midway leaves it when the rename is
skipped, or a flipped byte) is skipped and the previous whole step loads, or nothing (then
the disk checkpoint); a node whose RAM is gone gets its ranks' shards back from the copy
its peer node holds, sent over the process group. Each "node" of the 4-rank test has a
RAM directory of its own, as the lab's nodes each have their own /dev/shm.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext import Checkpointer
from fsdp_ext.job.snapshot import Snapshots, read_snapshot
from fsdp_ext.testing import run_distributed


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp_ext.shard_by_policy(model, auto_wrap_policy={nn.Linear}, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _values(model, opt, sched) -> dict:
    """Every number a resume must bring back, as this rank holds it."""
    out = {f"p.{n}": p.to_local().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            out[f"opt.{i}.{k}"] = v.to_local().clone() if hasattr(v, "to_local") else v.clone()
    out["lr"] = sched.get_last_lr()[0]
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _snapshots(root: Path, ckpt: Checkpointer, per_node: int) -> Snapshots:
    node = dist.get_rank() // per_node
    return Snapshots(ckpt.state, job="t", ranks_per_node=per_node, root=root / f"node{node}")


def _save_then_restore(root: str, per_node: int, damage: str) -> dict:
    """Snapshots at steps 2 and 4, the state moved on to step 5, then ``damage`` to the
    RAM, then a restore into a fresh model: which step came back, and whether it is the
    saved state exactly."""
    root = Path(root)
    model, opt, sched = _model()
    ckpt = Checkpointer(root / "ckpt", model=model, optimizer=opt, extra={"sched": sched})
    snaps = _snapshots(root, ckpt, per_node)
    saved = {}
    for step in range(1, 6):
        _step(model, opt, sched, step)
        if step % 2 == 0:
            snaps.save(step)
            saved[step] = _values(model, opt, sched)
    dist.barrier()
    if dist.get_rank() == 0:
        own = root / "node0" / "fsdp_ext-snapshots-t"
        if damage == "torn":  # rank 1's step-4 file cut short, everywhere it is held
            for path in root.glob("node*/fsdp_ext-snapshots-t/step-0000004/rank-00001.snap"):
                path.write_bytes(path.read_bytes()[:-100])
        elif damage == "flipped":  # one byte of every step-4 file
            for path in root.glob("node*/fsdp_ext-snapshots-t/step-0000004/*.snap"):
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
        elif damage == "all torn":
            for path in root.glob("node*/fsdp_ext-snapshots-t/step-*/*.snap"):
                path.write_bytes(path.read_bytes()[:50])
        elif damage == "node 1 lost":  # its RAM is gone; node 0 holds its copy
            shutil.rmtree(root / "node1")
        assert own.is_dir()
    dist.barrier()
    ckpt.close()
    model, opt, sched = _model()  # a restarted worker: fresh state, lazily empty optimizer
    ckpt = Checkpointer(root / "ckpt", model=model, optimizer=opt, extra={"sched": sched})
    snaps = _snapshots(root, ckpt, per_node)
    step = snaps.restore()
    ckpt.close()
    mine = snaps.dir / "step-0000004" / f"rank-{dist.get_rank():05d}.snap"
    exact = step is not None and _equal(_values(model, opt, sched), saved[step])
    try:
        own_file_back = read_snapshot(mine.read_bytes())[0]["step"] == 4
    except (OSError, ValueError):
        own_file_back = False
    return {"step": step, "exact": exact, "recovered": snaps.recovered, "back": own_file_back}


def _each(root: str, per_node: int, damages: list[str]) -> dict:
    """One process group, each damage in a RAM of its own (one spawn of the ranks)."""
    return {
        d: _save_then_restore(str(Path(root) / d.replace(" ", "-")), per_node, d) for d in damages
    }


def test_whole_torn_and_missing_snapshots_on_two_ranks(tmp_path):
    """Undamaged: step 4 comes back exactly. Rank 1's step-4 file cut short, or a byte
    flipped in each: both ranks load step 2 (a step is whole on every rank or not at all),
    exactly. Every file torn: nothing loads (the disk checkpoint's turn)."""
    damages = ["none", "torn", "flipped", "all torn"]
    ranks = run_distributed(_each, 2, str(tmp_path), 2, damages)
    steps = {d: [r[d]["step"] for r in ranks] for d in damages}
    assert steps == {"none": [4, 4], "torn": [2, 2], "flipped": [2, 2], "all torn": [None, None]}
    assert all(r[d]["exact"] for r in ranks for d in damages if d != "all torn")


def test_a_lost_nodes_shards_come_back_from_its_peers_copy(tmp_path):
    """4 ranks on 2 "nodes": node 1's RAM is wiped; its ranks get step 4 from node 0's
    copies over the process group, exactly, and keep them in their RAM again."""
    ranks = run_distributed(_save_then_restore, 4, str(tmp_path), 2, "node 1 lost")
    assert [r["step"] for r in ranks] == [4] * 4
    assert all(r["exact"] for r in ranks)
    assert all(r["recovered"] == [2, 3] for r in ranks)
    assert all(r["back"] for r in ranks)


def test_snapshot_flag_needs_disk_checkpoints_in_one_line(capsys):
    """--snapshot-every without --ckpt-every is refused before any worker starts, in one
    line naming the flag and the fix (the disk stays the source of truth)."""
    from examples.config import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--snapshot-every", "2"])
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--snapshot-every" in line and "--ckpt-every" in line
    assert parse_args(["--snapshot-every", "2", "--ckpt-every", "4"]).snapshot_every == 2
