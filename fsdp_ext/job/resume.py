"""Which checkpoint a resume loads: the newest, by step number, that verifies.

Checkpoints of a training run live under one root as ``step-<N>`` (at least 7 digits; more
when N needs them, so the number, not the name, orders them). A candidate that fails
verification is skipped with a warning naming it and why, recorded in ``skipped.json`` so
that pruning neither counts nor deletes it, and kept for inspection. Each candidate is
examined and loaded under a shared read lease (``lock.read_lease``), so a prune of another
job never removes it midway; one pruned before its lease is passed over silently.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Collection
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.lock import CheckpointPrunedError, read_lease
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, UnsafeCheckpointError
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.steps import checkpoint_steps
from fsdp_ext.checkpoint.storage import LINK, MISSING, CheckpointStorage
from fsdp_ext.checkpoint.verify import verify_checkpoint

__all__ = [
    "SKIPPED_RECORD",
    "latest_intact",
    "load_intact",
    "set_aside",
    "skipped_checkpoints",
]

SKIPPED_RECORD = "skipped.json"  # {name: why} of checkpoints a resume found corrupt
# what a corrupt or vanished checkpoint raises inside dcp.load: try the next one
_UNREADABLE = (CheckpointIntegrityError, UnsafeCheckpointError, CheckpointPrunedError, OSError)


def _storage(fs: CheckpointStorage | None) -> CheckpointStorage:
    return posix_storage(fs)


def skipped_checkpoints(
    root: str | os.PathLike, fs: CheckpointStorage | None = None
) -> dict[str, str]:
    """Checkpoints a resume skipped as corrupt, by name, with why."""
    try:
        raw = json.loads(_storage(fs).read_bytes(Path(root) / SKIPPED_RECORD))
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _record_skip(fs: CheckpointStorage, path: Path, why: str) -> None:
    warnings.warn(
        f"resume: skipping {path}: {why}; it is kept for inspection "
        f"(python -m fsdp_ext.checkpoint verify {path})",
        stacklevel=3,
    )
    skipped = skipped_checkpoints(path.parent, fs)
    if skipped.get(path.name) == why:
        return
    skipped[path.name] = why
    _write_skipped(fs, path.parent, skipped)


def _write_skipped(fs: CheckpointStorage, root: Path, skipped: dict[str, str]) -> None:
    tmp = root / f".{SKIPPED_RECORD}.{os.getpid()}.tmp"
    fs.write_file(tmp, (json.dumps(skipped, indent=1, sort_keys=True) + "\n").encode(), False)
    fs.rename(tmp, root / SKIPPED_RECORD)


def set_aside(path: Path, fs: CheckpointStorage | None = None) -> Path | None:
    """Before a save reuses the name of a checkpoint found corrupt, move it out of the way
    (``step-N.corrupt-<time>``: no longer a candidate, never pruned) instead of letting
    the save replace it. Returns where it went (None: nothing to move)."""
    fs = _storage(fs)
    skipped = skipped_checkpoints(path.parent, fs)
    kind = fs.kind(path)
    if path.name not in skipped or kind == MISSING:
        return None
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    if kind == LINK:  # a link to its version directory: move the directory, then drop it
        fs.rename(path.parent / fs.readlink(path), aside)
        fs.unlink(path)
    else:
        fs.rename(path, aside)
    skipped[aside.name] = skipped.pop(path.name)
    _write_skipped(fs, path.parent, skipped)
    warnings.warn(f"{path}: corrupt, moved to {aside} before saving this step again", stacklevel=2)
    return aside


def latest_intact(
    root: str | os.PathLike,
    *,
    exclude: frozenset[str] = frozenset(),
    fs: CheckpointStorage | None = None,
) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest checkpoint under ``root`` that verifies, or None.

    Corrupt ones are skipped with a warning and recorded (never deleted); ones pruned while
    being looked at are passed over. ``exclude``: names not to consider.
    """
    choice, lease = _choose(_storage(fs), Path(root), exclude)
    lease.close()
    return choice


def _choose(
    fs: CheckpointStorage, root: Path, exclude: frozenset[str]
) -> tuple[tuple[int, Path] | None, ExitStack]:
    """The newest intact checkpoint, with its read lease still held (close the stack)."""
    for step, path in reversed(checkpoint_steps(root, fs)):
        if path.name in exclude:
            continue
        lease = ExitStack()
        try:
            lease.enter_context(read_lease(path, fs))
        except CheckpointPrunedError:
            continue
        report = verify_checkpoint(path, fs=fs)
        if report.ok:
            return (step, path), lease
        lease.close()
        _record_skip(fs, path, report.problems[0])
    return None, ExitStack()


def _cause(exc: BaseException) -> BaseException | None:
    """The exception a rank raised inside ``dcp.load`` if it says the checkpoint is bad."""
    causes = [exc]
    if isinstance(exc, CheckpointException):
        causes = [e for e, _tb in exc.failures.values()]
    for cause in causes:
        while cause is not None:
            if isinstance(cause, _UNREADABLE):
                return cause
            cause = cause.__cause__
    return None


def load_present(state: dict[str, Any], optional: Collection[str], reader: Any) -> None:
    """``dcp.load`` through our planner, leaving out the ``optional`` keys that the
    checkpoint (its ``.metadata``, read by ``reader``) does not hold."""
    saved = reader.read_metadata().state_dict_metadata
    dcp.load(
        {k: v for k, v in state.items() if k not in optional or _has(saved, k)},
        storage_reader=reader,
        planner=SafeLoadPlanner(),
    )


def _has(saved: Collection[str], key: str) -> bool:
    return any(k == key or k.startswith(f"{key}.") for k in saved)


def _broadcast(value: Any) -> Any:
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def load_intact(
    root: str | os.PathLike,
    state: dict[str, Any],
    *,
    optional: Collection[str] = (),
    fs: CheckpointStorage | None = None,
) -> int | None:
    """Load the newest intact checkpoint under ``root`` into ``state`` (a DCP state dict);
    return its step, or None when there is none. Collective when a process group is up:
    rank 0 chooses, every rank loads; a checkpoint that fails to load on any rank (corrupt,
    pruned) is skipped with a warning and the next older one is tried. Keys of ``state``
    named in ``optional`` with nothing saved under them are left as they are. ``fs``: where
    the checkpoints are stored (default: the local filesystem)."""
    fs = _storage(fs)
    root = Path(root)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    tried: set[str] = set()
    while True:
        choice, lease = None, ExitStack()
        if leader:
            choice, lease = _choose(fs, root, frozenset(tried))
        choice = _broadcast(None if choice is None else (choice[0], str(choice[1])))
        if choice is None:
            return None
        step, path = choice
        try:
            load_present(state, optional, VerifiedFileSystemReader(path, fs=fs))
            return step
        except BaseException as exc:
            cause = _cause(exc)
            if cause is None:
                raise
            tried.add(Path(path).name)
            if isinstance(cause, CheckpointPrunedError) or fs.kind(Path(path)) == MISSING:
                warnings.warn(f"resume: {path} was pruned while being read: {cause}", stacklevel=2)
            elif leader:
                _record_skip(fs, Path(path), f"it failed to load: {cause}")
        finally:
            lease.close()
