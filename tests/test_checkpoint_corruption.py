"""``verify_checkpoint`` on 1,000 random corruptions of each kind of file a save leaves.

Seeded loops (one byte flipped or set, a truncation, an inserted byte), per file kind:
``.metadata`` (as damaged on disk, and with the manifest rewritten to match, so the
restricted unpickler and the structure check see every damaged pickle), ``.manifest.json``,
a data file, and the plan and done records of an unfinished save. Verify must never raise
(nor fall back to its catch-all line), and every report it rejects must name a file.
The verified reader's ``read_metadata`` must raise only the library's two errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_ext.checkpoint import (
    CheckpointIntegrityError,
    LocalStorage,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.checkpoint.manifest import SELF_CHECKSUM, seal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

N = 1000


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(8, 4, generator=gen),
        "embed": torch.randn(6, 4, generator=gen),
        "step": seed,
        "opt": {"lr": 0.1, "betas": [0.9, 0.99]},
    }


class StopBeforePublish(LocalStorage):
    """Fails the save when ``finish`` starts writing ``.metadata``: every rank's files and
    done records are written, the plan is still there, nothing is published."""

    def before(self, op, path):
        if op == "write" and str(path).endswith("/.metadata"):
            raise OSError(5, "stopped for the test", str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corrupt")
    path = root / "ckpt"
    dcp.save(state(0), storage_writer=SpreadFileSystemWriter(path), planner=SpreadSavePlanner())
    with pytest.raises(BaseException, match="stopped for the test"):
        dcp.save(
            state(1),
            storage_writer=SpreadFileSystemWriter(path, fs=StopBeforePublish()),
            planner=SpreadSavePlanner(),
        )
    return path


def corrupt(data: bytes, rng: random.Random) -> bytes:
    """One random damage; never a no-op."""
    out = bytearray(data)
    kind = rng.randrange(4)
    at = rng.randrange(len(out))
    if kind == 0:
        out[at] ^= rng.randrange(1, 256)
    elif kind == 1:
        value = rng.randrange(256)
        out[at] = value if value != out[at] else value ^ 0x01
    elif kind == 2:
        del out[at:]
    else:
        out.insert(at, rng.randrange(256))
    return bytes(out)


def files_of(path: Path) -> dict[str, Path]:
    version = path.parent / os.readlink(path) if path.is_symlink() else path
    unfinished = next(p for p in path.parent.glob(".ckpt.v-*") if p != version)
    data = sorted(p for p in version.iterdir() if p.suffix == ".distcp")
    return {
        "metadata": version / ".metadata",
        "metadata, manifest rewritten to match": version / ".metadata",
        "manifest": version / ".manifest.json",
        "data": max(data, key=lambda p: p.stat().st_size),
        "plan record": unfinished / ".plan.json",
        "done record": unfinished / ".done-rank0.json",
    }


def rewrite_manifest_for(metadata: Path, data: bytes) -> None:
    manifest_path = metadata.parent / ".manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["metadata"].update(size=len(data), checksum=f"{zlib.crc32(data):08x}")
    manifest_path.write_text(seal(manifest, SELF_CHECKSUM))


@pytest.mark.parametrize(
    "kind",
    [
        "metadata",
        "metadata, manifest rewritten to match",
        "manifest",
        "data",
        "plan record",
        "done record",
    ],
)
def test_verify_never_raises_and_names_a_file(saved, kind):
    target = files_of(saved)[kind]
    pristine = target.read_bytes()
    manifest = target.parent / ".manifest.json"
    pristine_manifest = manifest.read_bytes() if manifest.exists() else None
    # a damaged plan shows when the unfinished version itself is verified
    checked = target.parent if kind in ("plan record", "done record") else saved
    rng = random.Random(f"{kind}-20")
    rejected = 0
    try:
        for i in range(N):
            damaged = corrupt(pristine, rng)
            target.write_bytes(damaged)
            if kind == "metadata, manifest rewritten to match":
                rewrite_manifest_for(target, damaged)
            report = verify_checkpoint(checked)
            problems = report.problems
            assert not any("could not be verified" in p for p in problems), (i, problems)
            if kind.startswith("metadata") or kind == "manifest":
                # the loader meets the same bytes: only the library's own two errors
                with contextlib.suppress(CheckpointIntegrityError, UnsafeCheckpointError):
                    VerifiedFileSystemReader(saved).read_metadata()
            if not report.ok:
                rejected += 1
                assert any(f"{saved.parent}/" in p for p in problems), (i, problems)
    finally:
        target.write_bytes(pristine)
        if pristine_manifest is not None:
            manifest.write_bytes(pristine_manifest)
    # damage to what a checksum covers is always caught; the records of an unfinished save
    # make it unfinished whatever they say
    if kind in ("metadata", "manifest", "data", "plan record", "done record"):
        assert rejected == N
    assert rejected > N // 2
