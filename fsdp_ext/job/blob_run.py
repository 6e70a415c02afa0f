"""A run's checkpoints on an object store (``s3://``): save, prune and resume through the
catalog (``fsdp_ext/checkpoint/catalog.py``), for :class:`~fsdp_ext.job.Checkpointer`.

The same promises as on POSIX, on the blob primitives alone: a save publishes with one
conditional replace of the catalog, fenced by this job's owner generation; a prune
unpublishes first and deletes after; a resume loads the newest step that verifies and falls
back to older ones, one warning each; each rank loads under a read lease
(``fsdp_ext/checkpoint/blob_lease.py``), so a prune of that step by another job leaves it
(a warning naming the reader, as on POSIX).

A store that cannot be used (:class:`BlobAccessError`: the server died, refused the
credentials...) is no fault of a checkpoint: it is raised as it is, one line naming the
location and the cause, on every rank; DCP's ``CheckpointException`` around it is taken off
(:func:`store_error`), and a resume never skips a step for it (it would start over from step
0 while the checkpoints are intact).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint.blob import BlobAccessError
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.blob_writer import BlobStorageWriter
from fsdp_ext.checkpoint.catalog import BlobFence, read_catalog, read_lease, remove_step
from fsdp_ext.checkpoint.fence import DirectoryFencedError
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.lock import CheckpointPrunedError
from fsdp_ext.checkpoint.manifest import (
    CheckpointBusyError,
    CheckpointIntegrityError,
    UnsafeCheckpointError,
)
from fsdp_ext.checkpoint.planner import SpreadSavePlanner
from fsdp_ext.job.resume import load_present

__all__ = ["load_newest", "prune_steps", "published_steps", "save_step", "store_error"]


def store_error(exc: BaseException) -> BlobAccessError | None:
    """The :class:`BlobAccessError` a failure carries: itself, or a rank's failure inside
    DCP's ``CheckpointException`` (every rank gets the same one); None when there is none."""
    causes = exc.failures.values() if isinstance(exc, CheckpointException) else [exc]
    for cause in causes:
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, BlobAccessError):
            return cause
    return None


def published_steps(location: str) -> list[int]:
    """The steps the catalog of ``location`` publishes, oldest first."""
    return sorted(read_catalog(blob_store_for(location))[0].steps)


def save_step(
    location: str,
    step: int,
    state: dict[str, Any],
    fence: BlobFence | None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Save ``state`` as ``step`` (collective); what a failed save wrote is deleted (when the
    store answers: else the next save's commit sweeps it)."""
    writer = BlobStorageWriter(location, step, fence=fence)
    try:
        dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner(), process_group=group)
    except BaseException as exc:
        if store_error(exc) is None:
            writer.abandon()
        raise


def prune_steps(location: str, keep: int, fence: BlobFence | None) -> list[int]:
    """Unpublish and delete all but the newest ``keep`` steps; returns the steps removed.
    One being read stays, with a warning naming its reader (as on POSIX): a later prune
    removes it."""
    steps = published_steps(location)
    generation = None if fence is None else fence.generation
    store, removed = blob_store_for(location), []
    for step in steps[:-keep] if keep < len(steps) else []:
        try:
            if remove_step(store, step, generation=generation):
                removed.append(step)
        except DirectoryFencedError:
            raise  # the location was taken over: not a reader's doing
        except CheckpointBusyError as exc:
            warnings.warn(f"prune: {exc}", stacklevel=2)
    return removed


def load_newest(
    location: str, state: dict[str, Any], *, optional: Collection[str] = ()
) -> int | None:
    """Load the newest step that verifies into ``state`` (collective: rank 0's catalog is
    every rank's); return it, or None when none does. A step that fails its checks on any
    rank is skipped with a warning naming the cause."""
    steps: list[int] | str | None = None
    if _leader():
        try:
            steps = published_steps(location)
        except BlobAccessError as exc:  # every rank raises it, none waits for rank 0
            steps = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    if isinstance(steps, str):
        raise BlobAccessError(steps)
    store = blob_store_for(location)
    for step in reversed(steps or []):
        try:
            with read_lease(store, step):  # each rank's: a prune leaves the step whole
                load_present(state, optional, BlobStorageReader(location, step))
            return step
        except (
            CheckpointIntegrityError,
            UnsafeCheckpointError,
            CheckpointException,
            CheckpointPrunedError,
        ) as exc:
            unusable = store_error(exc)
            if unusable is not None:  # the store failed, not the checkpoint
                raise unusable from None
            warnings.warn(
                f"resume: step {step} of {location} does not load, trying an older one: "
                f"{_first_line(exc)}",
                stacklevel=2,
            )
    return None


def _leader() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
