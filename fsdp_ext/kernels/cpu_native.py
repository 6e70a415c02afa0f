"""The codec's CPU sender compiled from C on the machine that runs it.

``quantize_ef_native.c`` makes the reference's fp32 operations in the reference's order, one
group at a time, so it is bit-exact with it; the C compiler only has to keep IEEE semantics
(no FMA contraction, no fast-math) while it vectorises for this CPU. That takes 0.2 s with
the system's ``cc``; the library goes into a per-user cache keyed by the source, the flags
and the CPU, so each machine builds it once. Without a C compiler, or with
``FSDP_EXT_NATIVE_CPU=0``, :func:`native_sender` is None and the plain-torch fast path runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).with_name("quantize_ef_native.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # no FMA: every product rounds, as in the reference
    "-fno-math-errno",  # floorf never sets errno: lets it vectorise, same results
    "-fno-trapping-math",  # no FP-exception side effects assumed: same results
    "-shared",
    "-fPIC",
)
ENV = "FSDP_EXT_NATIVE_CPU"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler_id(compiler: str) -> str:
    """The compiler's path and its ``--version``: an upgrade in place (same path, new code
    generator) builds anew rather than loading what the old one made."""
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        version = done.stdout + done.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unknown ({type(exc).__name__})"
    return f"{compiler}\n{version}"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "fsdp_ext" / "native"


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(compiler: str, cache_dir: Path) -> Path:
    """The shared library for this source, flags, compiler (and its version) and CPU, built
    once (atomically: ranks that race each build to a temporary name and rename it into
    place)."""
    parts = (" ".join(FLAGS), _compiler_id(compiler), _cpu_id())
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir / f"quantize_ef_native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def native_sender() -> Callable | None:
    """``quantize_rows`` from the compiled library, or None: ``FSDP_EXT_NATIVE_CPU=0`` (read
    at each call), no C compiler, or a failed build (then once a warning naming the cause)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> Callable | None:
    compiler = find_compiler()
    if compiler is None:
        return None
    try:
        library = ctypes.CDLL(str(build_library(compiler, default_cache_dir())))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        warnings.warn(
            f"the native CPU codec did not build ({detail}); using the plain-torch path "
            f"(set {ENV}=0 to skip the attempt)",
            stacklevel=2,
        )
        return None
    fn = library.quantize_rows
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.restype = None
    fn.argtypes = [ptr, i32, i64, i64, i64, ptr, i64, ptr, i64, ptr, i32, ptr, i64, i32]
    fn.argtypes += [f32, f32, ptr, ptr, ptr]
    return fn
