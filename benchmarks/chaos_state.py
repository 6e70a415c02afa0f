"""Is the chaos run's end the fault-free run's end, bit for bit? And are its checkpoints whole?

Equal losses prove little: a loss is one number rounded to four digits in the log, and an
optimizer moment one ulp off changes no printed loss for many steps. So the final
checkpoints of both runs are loaded here, in the benchmark's own process (DCP without a
process group: one process reads every shard), and every tensor of the model and of the
optimizer is compared by its bytes (``-0.0`` differs from ``0.0``, a NaN equals only the same
NaN), after the losses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_ext import VerifiedFileSystemReader, verify_checkpoint

__all__ = [
    "RunEnd",
    "checkpoint_audit",
    "compare_runs",
    "load_checkpoint",
    "part_of",
    "same_bits",
]

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class RunEnd:
    """What a run ended with: its losses by step (the last time each step ran) and its final
    checkpoint's tensors by key."""

    losses: dict[int, float]
    state: dict[str, object] = field(default_factory=dict)


def load_checkpoint(path: Path) -> dict[str, object]:
    """Every item of the DCP checkpoint at ``path``, whole (tensors on the CPU), by key;
    read with the verifying reader, so a corrupt file raises instead of loading."""
    metadata = VerifiedFileSystemReader(str(path)).read_metadata()
    state: dict[str, object] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            state[key] = None  # a pickled value: dcp.load puts it in
    dcp.load(state, storage_reader=VerifiedFileSystemReader(str(path)))
    return state


def part_of(key: str) -> str:
    """'optimizer', 'model' or 'other' (schedule, RNG streams, codec), from a checkpoint key
    (the Checkpointer's flat optimizer keys: ``state.<fqn>.exp_avg``, ``param_groups...``)."""
    parts = key.split(".")
    if "state" in parts or "param_groups" in parts:
        return "optimizer"
    if parts[0] in ("scheduler", "rng", "comm", "extra"):
        return "other"
    return "model"


def same_bits(a: object, b: object) -> bool:
    """Whether two values are the same bit for bit (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        raw_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        raw_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(raw_a, raw_b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def compare_runs(ours: RunEnd, reference: RunEnd) -> dict:
    """``final_state_equal``: the losses at every step agree AND every model and optimizer
    item of the final checkpoints is the same bit for bit; ``differing``: which items (by
    part) do not, so a mismatch names its place."""
    steps = sorted(set(ours.losses) & set(reference.losses))
    losses_equal = bool(steps) and all(ours.losses[s] == reference.losses[s] for s in steps)
    differing: dict[str, list[str]] = {}
    keys = set(ours.state) | set(reference.state)
    for key in sorted(keys):
        part = part_of(key)
        if part == "other":
            continue
        if key not in ours.state or key not in reference.state:
            differing.setdefault(part, []).append(f"{key} (missing in one)")
        elif not same_bits(ours.state[key], reference.state[key]):
            differing.setdefault(part, []).append(key)
    compared = {part_of(k) for k in keys} - {"other"}
    state_equal = {"model", "optimizer"} <= compared and not differing
    return {
        "final_state_equal": losses_equal and state_equal,
        "losses_equal": losses_equal,
        "model_equal": "model" in compared and "model" not in differing,
        "optimizer_equal": "optimizer" in compared and "optimizer" not in differing,
        "differing": {part: keys[:5] for part, keys in differing.items()},
    }


def checkpoint_audit(root: Path, steps: int, ckpt_every: int) -> dict:
    """Every checkpoint the run should have published (each multiple of ``ckpt_every`` up to
    ``steps``; the run keeps them all) is there and verifies (sizes and checksums)."""
    expected = set(range(ckpt_every, steps + 1, ckpt_every))
    found = {}
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = STEP_DIR.match(path.name)
        if m and (path / ".metadata").exists():
            found[int(m.group(1))] = path
    corrupt = []
    for step, path in sorted(found.items()):
        report = verify_checkpoint(str(path))
        if not report.ok:
            corrupt.append(f"step {step}: {report.problems[0]}")
    lost = sorted(expected - set(found))
    return {
        "published": len(found),
        "lost": lost,
        "corrupt": corrupt,
        "checkpoints_lost_or_corrupt": len(lost) + len(corrupt),
    }
