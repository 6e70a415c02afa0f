"""The fence a save obeys: which owner generation of a root it writes for.

A root's owners are recorded as ``ROOT/.owner/gen-NNNNNNNN`` (``fsdp_ext.job.ownership``
claims them). The highest generation owns the root. Each generation stages and discards in
its private work directory, ``.owner/gen-N.work``, which a takeover renames away: from then
on every publish or removal of the older generation fails in the storage itself. The writer
and ``versions.py`` need only this much of ownership, so it lives here, below them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fsdp_ext.checkpoint.lock import LockOwner
from fsdp_ext.checkpoint.manifest import CheckpointBusyError
from fsdp_ext.checkpoint.storage import CheckpointStorage

__all__ = [
    "OWNER_DIR",
    "RECORD",
    "DirectoryFencedError",
    "Fence",
    "generations",
    "holder",
    "record_name",
]

OWNER_DIR = ".owner"
RECORD = re.compile(r"gen-(\d{8})")


class DirectoryFencedError(CheckpointBusyError):
    """This job lost its output directory to another job (it was paused, or its heartbeat
    failed, for longer than its lease): it must write nothing more there."""


def record_name(generation: int) -> str:
    return f"gen-{generation:08d}"


def generations(fs: CheckpointStorage, root: str | os.PathLike) -> list[int]:
    """The owner generations recorded under ``root``, in order (the last one owns it)."""
    try:
        names = fs.listdir(Path(root) / OWNER_DIR)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := RECORD.fullmatch(n)))


def holder(fs: CheckpointStorage, root: Path, generation: int) -> LockOwner | None:
    try:
        return LockOwner.decode(fs.readlink(root / OWNER_DIR / record_name(generation)))
    except (FileNotFoundError, OSError):
        return None


@dataclass(frozen=True)
class Fence:
    """What a save must hold to write under ``root``: owner generation ``generation``.

    ``work_dir`` is that generation's private directory: stage there, publish out of it,
    discard into it (a takeover removes it, and every such operation then fails)."""

    root: Path
    generation: int
    fs: CheckpointStorage

    @property
    def work_dir(self) -> Path:
        return self.root / OWNER_DIR / f"{record_name(self.generation)}.work"

    def lost(self) -> str | None:
        """Why this generation no longer owns ``root`` (None: it still does)."""
        found = generations(self.fs, self.root)
        newer = [g for g in found if g > self.generation]
        if newer:
            owner = holder(self.fs, self.root, newer[-1])
            who = owner.describe() if owner is not None else "another job"
            return (
                f"{self.root}: taken over by {who} (owner generation {newer[-1]}; this job's "
                f"is {self.generation}); this job writes nothing more there. It was paused, "
                "or could not renew its lease, for longer than its lease"
            )
        if self.generation not in found:
            return (
                f"{self.root}: this job's owner record (generation {self.generation}) is gone; "
                "it writes nothing more there"
            )
        return None

    def check(self) -> None:
        """Raise :class:`DirectoryFencedError` if this generation lost ``root``."""
        why = self.lost()
        if why is not None:
            raise DirectoryFencedError(why)
