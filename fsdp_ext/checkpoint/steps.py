"""How a run's checkpoints are named under its root: ``step-<N>``, ordered by N.

At least 7 digits, more when N needs them, so the number and not the name orders them. The
writer, export, resume, prune and snapshots all name steps through these two functions.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.storage import CheckpointStorage

__all__ = ["checkpoint_steps", "step_name"]

_STEP = re.compile(r"step-(\d+)")


def step_name(step: int) -> str:
    """``step-0000100``; past 9,999,999 the name grows (``step-10000000``)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:07d}"


def checkpoint_steps(
    root: str | os.PathLike, fs: CheckpointStorage | None = None
) -> list[tuple[int, Path]]:
    """Every ``step-N`` under ``root``, ordered by the number N (not by name)."""
    root = Path(root)
    try:
        names = (posix_storage(fs)).listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), root / n) for n in names if (m := _STEP.fullmatch(n))]
    return sorted(found)
