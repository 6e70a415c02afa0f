"""Peak memory of a checkpoint load above its destination state, measured from outside.

For each shape (files x MB), one checkpoint is saved with ``SpreadFileSystemWriter`` (one
file per layer), then loaded by a fresh process per reader: the stock ``FileSystemReader``
with ``DefaultLoadPlanner``, and ``VerifiedFileSystemReader`` with ``SafeLoadPlanner``.
The loading process allocates and touches its destination state and waits; this process
reads its ``VmRSS`` from ``/proc``, resets its peak (``clear_refs`` 5), lets it load, and
reads its ``VmHWM``: the peak above the destination is ``VmHWM - VmRSS before``. The
reader's bound is its read-ahead budget plus one read chunk. The last line is one JSON
object with every figure, stock's beside ours.

    python benchmarks/checkpoint_memory.py --shapes 12x100,4x248,3x320
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MB = 1 << 20
TIMEOUT_S = 600

# The loading process: allocate the destination, report ready, load on "go", report done,
# check the values on "check", exit.
LOADER = textwrap.dedent(
    """
    import sys, warnings, torch, torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    from fsdp_ext.checkpoint import VerifiedFileSystemReader, SafeLoadPlanner
    path, files, numel, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    state = {f"layers.{i}.w": torch.zeros(numel) for i in range(files)}
    for t in state.values():
        t.fill_(-1.0)  # touch every page: the destination is resident before the load
    def say(word):
        print(word, flush=True)
    def wait(word):
        line = sys.stdin.readline().strip()
        assert line == word, f"expected {word!r}, got {line!r}"
    say("ready")
    wait("go")
    if which == "stock":
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    else:
        dcp.load(state, storage_reader=VerifiedFileSystemReader(path),
                 planner=SafeLoadPlanner(), no_dist=True)
    say("done")
    wait("check")
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(state.values()))
    say("equal" if ok else "DIFFERENT")
    """
)

SAVER = textwrap.dedent(
    """
    import sys, warnings, torch, torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    from fsdp_ext.checkpoint import SpreadFileSystemWriter, SpreadSavePlanner
    path, files, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    state = {f"layers.{i}.w": torch.full((numel,), float(i)) for i in range(files)}
    dcp.save(state, storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0),
             planner=SpreadSavePlanner(), no_dist=True)
    """
)


BOUND = (
    "from fsdp_ext.checkpoint import reader as r; "
    "print((r.READ_AHEAD_BUDGET + getattr(r, 'READ_CHUNK_BYTES', 0)) / (1 << 20))"
)


def proc_status(pid: int) -> dict[str, int]:
    """The ``kB`` fields of /proc/PID/status, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _expect(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline().strip()
    if line != word:
        proc.kill()
        err = proc.stderr.read()[-3000:]
        raise RuntimeError(f"loader said {line!r}, expected {word!r}; its stderr:\n{err}")


def measure_load(path: Path, files: int, numel: int, which: str, env: dict) -> dict:
    """Peak RSS above the destination of one load by a fresh process, read from outside."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(path), str(files), str(numel), which],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=env["PYTHONPATH"],  # python -c puts the working directory first on sys.path
    )
    try:
        _expect(proc, "ready")
        before = proc_status(proc.pid)["VmRSS"]
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _expect(proc, "done")
        seconds = time.perf_counter() - start
        peak = proc_status(proc.pid)["VmHWM"]
        proc.stdin.write("check\n")
        proc.stdin.flush()
        _expect(proc, "equal")
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return {"above_destination_mb": round((peak - before) / MB, 1), "load_s": round(seconds, 2)}


def run_shape(files: int, file_mb: int, root: Path, env: dict) -> dict:
    numel = file_mb * MB // 4
    path = root / f"{files}x{file_mb}" / "ckpt"  # its own directory: removed whole below
    subprocess.run(
        [sys.executable, "-c", SAVER, str(path), str(files), str(numel)],
        check=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=env["PYTHONPATH"],  # python -c puts the working directory first on sys.path
    )
    bound = float(
        subprocess.run(
            [sys.executable, "-c", BOUND],
            check=True,
            timeout=TIMEOUT_S,
            env=env,
            cwd=env["PYTHONPATH"],  # python -c puts the working directory first on sys.path
            capture_output=True,
            text=True,
        ).stdout
    )
    stock = measure_load(path, files, numel, "stock", env)
    ours = measure_load(path, files, numel, "ours", env)
    shutil.rmtree(path.parent)
    return {
        "shape": f"{files}x{file_mb}MB",
        "stock_above_destination_mb": stock["above_destination_mb"],
        "ours_above_destination_mb": ours["above_destination_mb"],
        "bound_mb": bound,
        "ours_within_bound": ours["above_destination_mb"] <= bound,
        "ours_vs_stock": round(ours["above_destination_mb"] / stock["above_destination_mb"], 2),
        "stock_load_s": stock["load_s"],
        "ours_load_s": ours["load_s"],
    }


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes: expected FILESxMB[,FILESxMB...] like 12x100, got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="12x100,4x248,3x320")
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument(
        "--tree",
        default=str(Path(__file__).resolve().parents[1]),
        help="the source tree the saving and loading processes import (another checkout "
        "measures its reader; default: this one)",
    )
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    env = {**os.environ, "PYTHONPATH": args.tree}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt_memory_") as tmp:
        rows = [run_shape(files, mb, Path(tmp), env) for files, mb in shapes]
    for row in rows:
        print(
            f"{row['shape']:>10}: above destination: stock {row['stock_above_destination_mb']}"
            f" MB, ours {row['ours_above_destination_mb']} MB (bound {row['bound_mb']} MB)"
        )
    summary = {"benchmark": "checkpoint_memory", "loadavg": os.getloadavg()[0], "rows": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
