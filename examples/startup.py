"""Where a worker's start goes (one line per start, so a restart's cost can be split),
and what a restarted worker need not do again (read the corpus file by file).

A restarted worker pays for a new interpreter, the imports, the process group, the model
and the checkpoint load before its first step; ``benchmarks/recovery.py`` adds torchrun's
own share (detection, rendezvous) from its log. Times are wall-clock seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

from examples.data import ByteCorpus, load_corpus

__all__ = ["StartupClock", "cached_corpus", "process_start_time"]


def process_start_time() -> float:
    """This process's start, in seconds since the epoch: field 22 of /proc/self/stat is
    the start in clock ticks after boot, against CLOCK_BOOTTIME now (/proc/stat's btime
    is rounded to the second)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class StartupClock:
    """Marks of one worker's start (``mark(phase)`` at the end of each phase)."""

    def __init__(self) -> None:
        try:
            self.start = process_start_time()
        except (OSError, ValueError):  # no /proc: count from here
            self.start = time.time()
        self.marks: list[tuple[str, float]] = []
        self.reported = False

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))

    def line(self) -> str:
        """``startup | interpreter+imports 6.10 s | process group 0.91 s | ... | at T``
        (T: the process start, seconds since the epoch)."""
        parts, last = [], self.start
        for phase, at in self.marks:
            parts.append(f"{phase} {at - last:.2f} s")
            last = at
        return f"startup | {' | '.join(parts)} | process start {self.start:.3f}"


def cached_corpus(cache_dir: Path | None = None) -> ByteCorpus:
    """``load_corpus()``, read once per machine: walking and reading the standard library
    costs a restarted worker 1-2 s (the walk alone 1.1 s on a quiet machine), the cached
    concatenation 0.01 s. The cache is keyed by the library's path and the interpreter's
    full version string (its build), which fix the library's files; a cache that fails to
    load is rebuilt."""
    root = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{root}\0{sys.version}".encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "fsdp_ext"
    )
    path = cache_dir / f"corpus-{key}.pt"
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        return ByteCorpus(saved["train"], saved["val"], int(saved["num_files"]))
    except (OSError, RuntimeError, KeyError, ValueError, EOFError):
        pass
    corpus = load_corpus()
    with contextlib.suppress(OSError):  # a read-only home still trains
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"train": corpus.train, "val": corpus.val, "num_files": corpus.num_files}, tmp)
        os.replace(tmp, path)  # whole or absent, whoever reads it
    return corpus
