"""Real DCP saves and loads on gloo ranks: resharding round trips, async, crash safety.

Checkpoints saved at world 4 load at 2 and 1, and the other way round, for FSDP-sharded,
HSDP (replicate x shard) and fully replicated states; big replicated tensors are split
across ranks on save. Every load is compared with the full tensors built from the seed in
the test process, through our reader and through the stock FileSystemReader.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_ext.checkpoint import (
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.checkpoint import reader as reader_module
from fsdp_ext.checkpoint.unpickler import load_metadata
from fsdp_ext.testing import RankError, run_distributed

SHAPES = {
    "embed.weight": (96, 16),  # big: more than a fair share, so it gets split
    "layers.0.attn.weight": (10, 8),  # rows not divisible by the world size
    "layers.0.mlp.weight": (24, 8),
    "layers.1.attn.weight": (10, 8),
    "layers.1.mlp.weight": (24, 8),
    "layers.1.norm.weight": (8,),
    "norm.weight": (16,),
    "output.weight": (40, 16),
}
EXTRA = {"step": 7, "sched": {"lr": 0.25, "milestones": [3, 5]}}
LAYOUTS = ("fsdp", "hsdp", "replicated")


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _mesh(layout: str, world: int):
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,)), [Shard(0)]
    replicate = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("rep", "shard"))
    return mesh, [Replicate(), Shard(0)]


def build_state(layout: str, world: int, tensors: dict[str, torch.Tensor]) -> dict:
    """The state dict a rank holds under ``layout`` (DTensors, or plain replicated tensors)."""
    if layout == "replicated":
        state = {k: v.clone() for k, v in tensors.items()}
    else:
        mesh, placements = _mesh(layout, world)
        state = {k: distribute_tensor(v, mesh, placements) for k, v in tensors.items()}
    return {"model": state, **{k: json.loads(json.dumps(v)) for k, v in EXTRA.items()}}


def empty_like(state: dict) -> dict:
    out = {"model": {}, "step": 0, "sched": {"lr": 0.0, "milestones": [0, 0]}}
    for k, v in state["model"].items():
        if isinstance(v, DTensor):
            out["model"][k] = DTensor.from_local(
                torch.zeros_like(v.to_local()),
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        else:
            out["model"][k] = torch.zeros_like(v)
    return out


def mismatches(loaded: dict, expected: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for k, v in loaded["model"].items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if not torch.equal(full, expected[k]):
            bad.append(k)
    bad += [k for k in EXTRA if loaded[k] != EXTRA[k]]
    return bad


def save_all(root: str, world: int, layouts=LAYOUTS) -> dict:
    """Save every layout at this world size; return bytes per rank from each manifest."""
    tensors = full_state()
    for layout in layouts:
        path = os.path.join(root, f"{layout}-w{world}")
        dcp.save(
            build_state(layout, world, tensors),
            storage_writer=SpreadFileSystemWriter(path, thread_count=2, min_file_bytes=0),
            planner=SpreadSavePlanner(),
        )
    return {}


def load_all(root: str, world: int, sources: list[str]) -> dict:
    """Load each checkpoint with our reader (and, in one process, with the stock reader too).

    The target layout is FSDP at world > 1 and plain tensors at world 1, so every load
    reshards: the chunks on disk never line up with what a rank asks for.
    """
    tensors = full_state()
    layout = "fsdp" if world > 1 else "replicated"
    bad = {}
    for name in sources:
        path = os.path.join(root, name)
        target = empty_like(build_state(layout, world, tensors))
        dcp.load(target, storage_reader=VerifiedFileSystemReader(path), planner=SafeLoadPlanner())
        bad[(name, world, "ours")] = mismatches(target, tensors)
        if world == 1:
            target = empty_like(build_state(layout, world, tensors))
            dcp.load(target, storage_reader=dcp.FileSystemReader(path))
            bad[(name, world, "stock")] = mismatches(target, tensors)
    return bad


def phase(root: str, load_from: list[str], save: bool, async_dir: str | None) -> dict:
    world = dist.get_world_size()
    out = {"bad": load_all(root, world, load_from)}
    if save:
        layouts = LAYOUTS if world > 1 else ("replicated",)
        save_all(root, world, layouts)
    if async_dir is not None:
        tensors = full_state(seed=1)
        state = build_state("hsdp", world, tensors)
        writer = SpreadFileSystemWriter(async_dir)
        future = dcp.async_save(state, storage_writer=writer, planner=SpreadSavePlanner())
        # staging copied the state: changing it now must not change the checkpoint
        for v in state["model"].values():
            v.to_local().zero_()
        future.result()
        dist.barrier()
        target = empty_like(build_state("fsdp", world, tensors))
        dcp.load(
            target, storage_reader=VerifiedFileSystemReader(async_dir), planner=SafeLoadPlanner()
        )
        out["async_bad"] = mismatches(target, tensors)
    return out


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    w4 = [f"{layout}-w4" for layout in LAYOUTS]
    w2 = [f"{layout}-w2" for layout in LAYOUTS]
    save_all(root, 1, ("replicated",))  # world 1 is this process: no process group
    results = {"2 save": run_distributed(phase, 2, root, [], True, None)[0]}
    async_dir = os.path.join(root, "async-w4")
    results[4] = run_distributed(phase, 4, root, [*w2, "replicated-w1"], True, async_dir)[0]
    results[2] = run_distributed(phase, 2, root, w4, False, None)[0]
    results[1] = {"bad": load_all(root, 1, w4)}
    return Path(root), results


def test_every_load_equals_the_saved_tensors(round_trips):
    _, results = round_trips
    checked = {k: v for r in results.values() for k, v in r["bad"].items()}
    # 4 -> 2, 4 -> 1 (ours and stock), 2 -> 4, 1 -> 4
    assert len(checked) == 3 + 3 * 2 + 3 + 1
    assert {k: v for k, v in checked.items() if v} == {}


def test_async_save_with_staging(round_trips):
    _, results = round_trips
    assert results[4]["async_bad"] == []


def tensor_bytes_per_rank(path: Path) -> dict[int, int]:
    """Tensor payload each rank wrote, from the metadata (file names say the rank)."""
    meta = load_metadata((path / ".metadata").read_bytes(), str(path))
    out: dict[int, int] = {}
    for index, info in meta.storage_data.items():
        md = meta.state_dict_metadata[index.fqn]
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset))
        rank = int(info.relative_path.split("_")[2])
        out[rank] = out.get(rank, 0) + chunk.sizes.numel() * md.properties.dtype.itemsize
    return out


def test_replicated_bytes_are_spread_and_big_tensors_split(round_trips):
    root, _ = round_trips
    total = sum(v.numel() * 4 for v in full_state().values())
    for name in ("replicated-w4", "hsdp-w4", "fsdp-w4", "async-w4"):
        report = verify_checkpoint(root / name)
        assert report.ok, report.problems
        loads = tensor_bytes_per_rank(root / name)
        assert sum(loads.values()) == total  # every byte once
        assert max(loads.values()) / (total / 4) <= 1.05, (name, loads)
    meta = load_metadata((root / "replicated-w4" / ".metadata").read_bytes(), "m")
    embed = meta.state_dict_metadata["model.embed.weight"]
    assert len(embed.chunks) > 1  # more than a fair share: split over ranks
    # a layer's replicated items are kept together: one layer per layer file
    files = verify_checkpoint(root / "replicated-w4").files
    assert all(len(r.layers) <= 1 for r in files.values())


# -- crash safety --------------------------------------------------------------------------


class _DieMidSave(SpreadSavePlanner):
    """Rank 1 SIGKILLs itself when it starts on its first item: its first file is open."""

    def __init__(self):
        super().__init__()
        self._resolved = 0

    def resolve_data(self, write_item):
        self._resolved += 1
        if dist.get_rank() == 1 and self._resolved == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def _save_then_crash(path: str) -> None:
    world = dist.get_world_size()
    dcp.save(
        build_state("replicated", world, full_state(seed=0)),
        storage_writer=SpreadFileSystemWriter(path),
        planner=SpreadSavePlanner(),
    )
    dist.barrier()
    dcp.save(
        build_state("replicated", world, full_state(seed=5)),
        storage_writer=SpreadFileSystemWriter(path),
        planner=_DieMidSave(),
    )


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(RankError) as err:
        run_distributed(_save_then_crash, 4, str(path), timeout=120)
    assert err.value.rank == 1 and err.value.exc_type == "ProcessDied"
    # the previous checkpoint is intact, verifies and loads the old values
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    target = empty_like(build_state("replicated", 1, full_state()))
    dcp.load(target, storage_reader=VerifiedFileSystemReader(path), planner=SafeLoadPlanner())
    assert mismatches(target, full_state(seed=0)) == []
    # the new one is only an unfinished version directory, which verify reports as such
    partial = [p for p in tmp_path.glob(".ckpt.v-*") if not (p / ".manifest.json").exists()]
    assert len(partial) == 1 and not (partial[0] / ".metadata").exists()
    problems = verify_checkpoint(partial[0]).problems
    assert any("unfinished save" in p for p in problems)
    assert any("rank 1 did not finish writing __1_" in p for p in problems), problems
    assert not any("rank 0 did not finish" in p for p in problems), problems
    assert any(".metadata: missing" in p for p in problems)
    # pointed at the target, verify says it is sound (the old one), and notes the other
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [".manifest.json", ".metadata", *report.files]
    )
    assert any(f"{partial[0]}: an unfinished save" in n for n in report.notes), report.notes
    # the next save removes the dead save's directory, and only that
    dcp.save(
        build_state("replicated", 1, full_state(seed=6)),
        storage_writer=SpreadFileSystemWriter(path),
        planner=SpreadSavePlanner(),
    )
    after = verify_checkpoint(path)
    assert after.ok and after.notes == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", *filter(None, [after.version])]
    )


# -- who checks what on a load ---------------------------------------------------------------


class _CountingCrc32:
    """Stands in for the reader's ``crc32``: counts the bytes each CRC-32 covers, and computes
    it with zlib's own (the files' CRCs came from zlib-ng's: an independent check)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []  # appended from the read-ahead threads too

    def __call__(self, data, value: int = 0) -> int:
        self.sizes.append(memoryview(data).nbytes)
        return zlib.crc32(data, value)


def _load_and_report_checks(path: str, layout: str) -> tuple[list[str], str | None, int]:
    """Load ``path`` into ``layout`` at this world size; return the files this rank checked,
    the load's error, if any (as the rank saw it), and the data bytes this rank hashed."""
    world = dist.get_world_size()
    tensors = full_state()
    target = empty_like(build_state(layout, world, tensors))
    reader = VerifiedFileSystemReader(path)
    counting = _CountingCrc32()
    reader_module.crc32 = counting  # this rank's process only
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    except BaseException as exc:  # CheckpointException is a BaseException
        return sorted(reader.checks_here), str(exc), sum(counting.sizes)
    assert mismatches(target, tensors) == []
    return sorted(reader.checks_here), None, sum(counting.sizes)


@pytest.mark.parametrize("layout", ["fsdp", "replicated"])
def test_each_file_is_checked_once_by_a_rank_that_reads_it(round_trips, layout):
    """Checksums are divided, not repeated by every reader; in a load into the layout it was
    saved from, a rank checks its own files when the balance allows (FSDP: all of them).
    The bytes each rank really hashed are those of the files it was assigned, so the four
    ranks together hash the checkpoint's data exactly once (not up to four times)."""
    root, _ = round_trips
    path = root / f"{layout}-w4"
    files = verify_checkpoint(path).files
    results = run_distributed(_load_and_report_checks, 4, str(path), layout)
    checked = [set(names) for names, _, _ in results]
    assert all(error is None for _, error, _ in results)
    assert sum(len(c) for c in checked) == len(set().union(*checked))  # each file once
    for names, _, hashed in results:
        assert hashed == sum(files[n].size for n in names)
    assert sum(hashed for _, _, hashed in results) == sum(r.size for r in files.values())
    if layout == "fsdp":
        assert set().union(*checked) == set(files)
        assert all(files[name].rank == rank for rank, c in enumerate(checked) for name in c)
    else:  # everyone reads everything: the checking is spread over the ranks
        assert set().union(*checked) == set(files) and all(checked)


def test_a_flipped_byte_fails_the_load_on_every_rank(round_trips, tmp_path):
    """One rank checks the damaged file; DCP gathers its error, so every rank's load fails
    naming the file, including the ranks that only read slices of it."""
    root, _ = round_trips
    path = tmp_path / "replicated"
    shutil.copytree(root / "replicated-w4", path)  # a copy is a checkpoint of its own
    report = verify_checkpoint(path)
    name = max(report.files, key=lambda n: report.files[n].size)
    damaged = path / name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    results = run_distributed(_load_and_report_checks, 4, str(path), "replicated")
    assert sum(name in checked for checked, _, _ in results) == 1
    for _, error, _ in results:
        assert error is not None and f"{damaged}: crc32" in error, error
