"""A second checkpoint storage backend is one file: this one.

``BucketStorage`` keeps every entry under a logical root as one flat object in a "bucket"
directory, the way an object store would: no real directories, no real symbolic links, no
``renameat2`` (its :meth:`exchange` refuses, so saves take the link layout). Two gloo ranks
save, overwrite, verify, load, prune and resume through it with the package's own
``SpreadFileSystemWriter``, ``VerifiedFileSystemReader`` and ``Checkpointer``. The logical
root is never created on disk: a checkpoint module that went around the storage (an
``open`` or ``os.*`` of a path) would fail there, or leave something there.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from urllib.parse import quote, unquote

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_ext.checkpoint import (
    CheckpointStorage,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.checkpoint.storage import DIRECTORY, FILE, LINK, MISSING
from fsdp_ext.job import Checkpointer
from fsdp_ext.testing import run_distributed

_SUFFIX = {FILE: ".f", DIRECTORY: ".d", LINK: ".l"}


class BucketStorage(CheckpointStorage):
    """Entries under ``root`` as flat objects ``bucket/<quoted path>.<f|d|l>``; records every
    operation in ``ops``. Renaming a directory moves its objects one by one (not atomic:
    enough for this test, whose saves never rename a directory a reader is using)."""

    def __init__(self, root: str | os.PathLike, bucket: str | os.PathLike):
        super().__init__()
        self.root, self.bucket = Path(root), Path(bucket)
        self.ops: list[tuple[str, str]] = []

    def before(self, op, path):
        self.ops.append((op, self._key(path)))

    # -- objects ----------------------------------------------------------------------------

    def _key(self, path) -> str:
        return Path(path).relative_to(self.root).as_posix()  # ValueError outside the root

    def _object(self, path, kind: str) -> Path:
        return self.bucket / (quote(self._key(path), safe="") + _SUFFIX[kind])

    def _kind(self, path) -> str:
        return next((k for k in _SUFFIX if self._object(path, k).exists()), MISSING)

    def _keys(self) -> list[tuple[str, str]]:
        by_suffix = {v: k for k, v in _SUFFIX.items()}
        return [(unquote(p.stem), by_suffix[p.suffix]) for p in self.bucket.iterdir()]

    def _children(self, path) -> list[str]:
        key = self._key(path)
        prefix = "" if key == "." else key + "/"
        names = {k[len(prefix) :] for k, _ in self._keys() if k.startswith(prefix) and k != "."}
        return sorted(n for n in names if "/" not in n)

    def _need(self, path, kind: str) -> None:
        found = self._kind(path)
        if found == MISSING:
            raise FileNotFoundError(errno.ENOENT, "no such entry", str(path))
        if found != kind:
            raise OSError(errno.EINVAL, f"a {found}, not a {kind}", str(path))

    def _free(self, path) -> None:
        if self._kind(path) != MISSING:
            raise FileExistsError(errno.EEXIST, "exists", str(path))
        if Path(path) != self.root:
            self._need(Path(path).parent, DIRECTORY)

    def _create(self, path, kind: str, data: bytes = b"") -> None:
        with open(self._object(path, kind), "xb") as f:
            f.write(data)

    # -- the primitives ---------------------------------------------------------------------

    def open_read(self, path):
        self.before("read", path)
        self._need(path, FILE)
        return open(self._object(path, FILE), "rb", buffering=0)

    def open_write(self, path):
        self.before("write", path)
        if self._kind(path) != FILE:
            self._free(path)
        return open(self._object(path, FILE), "wb")

    def kind(self, path):
        self.before("lstat", path)
        return self._kind(path)

    def listdir(self, path):
        self.before("listdir", path)
        self._need(path, DIRECTORY)
        return self._children(path)

    def makedirs(self, path):
        self.before("makedirs", path)
        for directory in [*reversed(Path(path).relative_to(self.root).parents), Path(path)]:
            if self._kind(self.root / directory) == MISSING:
                self._create(self.root / directory, DIRECTORY)

    def make_dir(self, path):
        self.before("mkdir", path)
        self._free(path)
        self._create(path, DIRECTORY)

    def rename(self, path, new_path):
        self.before("rename", new_path)
        kind, there = self._kind(path), self._kind(new_path)
        if kind == MISSING:
            raise FileNotFoundError(errno.ENOENT, "no such entry", str(path))
        self._need(Path(new_path).parent, DIRECTORY)
        if there == DIRECTORY:
            if kind != DIRECTORY or self._children(new_path):
                raise OSError(errno.ENOTEMPTY, "a directory is in the way", str(new_path))
            self._object(new_path, DIRECTORY).unlink()
        elif there != MISSING:
            if kind == DIRECTORY:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(new_path))
            self._object(new_path, there).unlink()
        if kind == DIRECTORY:
            key, new_key = self._key(path), self._key(new_path)
            for child, child_kind in self._keys():
                if child.startswith(key + "/"):
                    moved = self.root / (new_key + child[len(key) :])
                    os.replace(
                        self._object(self.root / child, child_kind),
                        self._object(moved, child_kind),
                    )
        os.replace(self._object(path, kind), self._object(new_path, kind))

    def exchange(self, a, b):
        self.before("exchange", b)
        raise OSError(errno.ENOTSUP, "a bucket cannot swap two entries", str(a))

    def symlink(self, target, path):
        self.before("symlink", path)
        self._free(path)
        self._create(path, LINK, target.encode())

    def readlink(self, path):
        self.before("readlink", path)
        self._need(path, LINK)
        return self._object(path, LINK).read_text()

    def unlink(self, path):
        self.before("unlink", path)
        kind = self._kind(path)
        if kind in (MISSING, DIRECTORY):
            self._need(path, FILE)
        self._object(path, kind).unlink()

    def rmdir(self, path):
        self.before("rmdir", path)
        self._need(path, DIRECTORY)
        if self._children(path):
            raise OSError(errno.ENOTEMPTY, "directory not empty", str(path))
        self._object(path, DIRECTORY).unlink()

    def remove_tree(self, path, missing_ok=False):
        self.before("remove_tree", path)
        try:
            for name in self._children(path):
                child = Path(path) / name
                if self._kind(child) == DIRECTORY:
                    self.remove_tree(child, missing_ok)
                else:
                    self.unlink(child)
            self.rmdir(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def fsync(self, path):
        self.before("fsync", path)
        fd = os.open(self._object(path, self._kind(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mtime(self, path):
        self.before("lstat", path)
        kind = self._kind(path)
        if kind == MISSING:
            raise FileNotFoundError(errno.ENOENT, "no such entry", str(path))
        return self._object(path, kind).stat().st_mtime

    def renew_lease(self, path, text):
        try:
            if self._kind(path) != LINK or self._object(path, LINK).read_text() != text:
                return False
            os.utime(self._object(path, LINK))
        except OSError:
            return False
        return True


# -- two ranks through the bucket ------------------------------------------------------------

SHAPES = {"embed": (12, 4), "layers.0.w": (6, 4), "layers.1.w": (5, 3), "norm": (4,)}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _state(mesh, tensors: dict[str, torch.Tensor], step: int) -> dict:
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tensors.items()}
    return {"model": model, "step": step}


def _save_load_prune_resume(logical: str, bucket: str) -> dict:
    rank = dist.get_rank()
    fs = BucketStorage(logical, bucket)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    path = Path(logical) / "ckpt"
    for seed in (0, 1):  # the second save overwrites the first
        dcp.save(
            _state(mesh, _tensors(seed), step=seed),
            storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0, fs=fs),
            planner=SpreadSavePlanner(),
        )
    target = _state(mesh, {k: torch.zeros(s) for k, s in SHAPES.items()}, step=-1)
    dcp.load(
        target, storage_reader=VerifiedFileSystemReader(path, fs=fs), planner=SafeLoadPlanner()
    )
    loaded = {k: v.full_tensor() for k, v in target["model"].items() if isinstance(v, DTensor)}
    report = verify_checkpoint(path, fs=fs) if rank == 0 else None

    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(_tensors(7)["embed"][:3])
    ckpt = Checkpointer(Path(logical) / "run", model=model, keep=2, fs=fs)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.bias.fill_(float(step))
        ckpt.save(step)
    ckpt.close()
    fresh = nn.Linear(4, 3)
    with Checkpointer(Path(logical) / "run", model=fresh, fs=fs) as again:
        resumed = again.resume()
    return {
        "loaded": loaded,
        "step": target["step"],
        "report": None if report is None else (report.ok, report.problems, report.version),
        "resumed": resumed,
        "weight": fresh.weight.detach().clone(),
        "bias": fresh.bias.detach().clone(),
        "run": fs.listdir(Path(logical) / "run") if rank == 0 else None,
        "ops": sorted({op for op, _ in fs.ops}),
    }


def test_two_ranks_save_load_prune_and_resume_through_a_one_file_backend(tmp_path):
    logical, bucket = tmp_path / "logical", tmp_path / "bucket"
    bucket.mkdir()
    results = run_distributed(_save_load_prune_resume, 2, str(logical), str(bucket), timeout=180)
    expected = _tensors(1)
    for out in results:
        assert {k: torch.equal(v, expected[k]) for k, v in out["loaded"].items()} == dict.fromkeys(
            SHAPES, True
        )
        assert out["step"] == 1
        assert out["resumed"] == 3
        assert torch.equal(out["weight"], _tensors(7)["embed"][:3])
        assert torch.equal(out["bias"], torch.full((3,), 3.0))
    ok, problems, version = results[0]["report"]
    assert ok, problems
    assert version is not None and version.startswith(".ckpt.v-")  # the link layout
    # the newest two steps kept, the owner record released; no real directory anywhere
    assert [n for n in results[0]["run"] if n.startswith("step-")] == [
        "step-0000002",
        "step-0000003",
    ]
    assert not logical.exists()
    objects = sorted(p.name for p in bucket.iterdir())
    assert "ckpt.l" in objects  # the checkpoint path is a link object: exchange was refused
    assert any(n.endswith("__0_layers.0.distcp.f") for n in objects)
    assert any(n.endswith("__1_layers.0.distcp.f") for n in objects)  # rank 1 wrote there too
    ops = set(results[0]["ops"])
    assert {"exchange", "symlink", "rename", "remove_tree", "write", "read", "fsync"} <= ops
