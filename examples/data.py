"""Byte-level text from CPython's own standard library: on every machine, no download."""

from __future__ import annotations

import functools
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class ByteCorpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8
    num_files: int


def stdlib_sources(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=2)
def load_corpus(val_every: int = 20) -> ByteCorpus:
    """Split by file, by a stable hash of the path, so the split never depends on file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    files = stdlib_sources(root)
    for path in files:
        rel = path.relative_to(root).as_posix()
        target = val if zlib.crc32(rel.encode()) % val_every == 0 else train
        target.append(path.read_bytes())
    return ByteCorpus(train=_as_bytes(train), val=_as_bytes(val), num_files=len(files))


def _as_bytes(chunks: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte histogram in nats: the loss of the best context-free model."""
    p = torch.bincount(data.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def get_batch(
    data: torch.Tensor, *, seed: int, step: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for one step; a pure function of (seed, step) so resume is exact."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]
