"""The native CPU codec's build cache and its off switch, exercised as they fail for real.

The library is compiled with ``-march=native`` into a per-user cache that may be shared (a
home directory on NFS, a container image layer). A library built on one CPU, or with other
flags, or by another compiler version, must never be loaded for another: the cache key
holds all three. Here a second "machine"
is a process in its own mount namespace whose ``/proc/cpuinfo`` names other CPU features;
it shares the cache directory with this one. ``FSDP_EXT_NATIVE_CPU=0`` must keep the
compiler from ever running and the library from ever loading.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPILER_LOG = """#!/bin/sh
# a C compiler that records each build, then hands over to the real one; its --version is
# the file beside it (an upgrade in place rewrites it)
if [ "$1" = "--version" ]; then cat "{version}"; exit 0; fi
echo "$@" >> "{log}"
exec {cc} "$@"
"""


def _compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A wrapper around the system's cc that logs every invocation."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    log = tmp_path / "cc.log"
    version = tmp_path / "cc.version"
    version.write_text("cc (test) 1.0\n")
    script = tmp_path / "cc"
    script.write_text(COMPILER_LOG.format(log=log, cc=cc, version=version))
    script.chmod(0o755)
    return script, log


def _python(code: str, env: dict, *, cpuinfo: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter; with ``cpuinfo``, on a "machine" whose
    /proc/cpuinfo is that file (its own mount namespace)."""
    argv = [sys.executable, "-c", code]
    if cpuinfo is not None:
        script = f'mount --bind "{cpuinfo}" /proc/cpuinfo && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# cpu_native is standard library only: loaded alone, a fresh interpreter starts in a tenth of
# a second, where importing it as fsdp_ext.kernels.cpu_native imports torch first (3-4 s)
CPU_NATIVE_FILE = str(REPO / "fsdp_ext" / "kernels" / "cpu_native.py")
CPU_NATIVE = (
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('cpu_native', {CPU_NATIVE_FILE!r})\n"
    "n = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(n)\n"
)
BUILD = CPU_NATIVE + "print(n.build_library(n.find_compiler(), n.default_cache_dir()))\n"


def _env(tmp_path: Path, compiler: Path, **extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("FSDP_EXT_NATIVE_CPU", None)
    env.update(CC=str(compiler), **extra)
    return env


def _other_cpu(tmp_path: Path) -> Path:
    """This machine's /proc/cpuinfo, with one feature flag fewer: another CPU model."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    out = []
    for line in lines:
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            line = "flags\t\t: " + " ".join(f for f in flags if f != flags[-1])
        out.append(line)
    path = tmp_path / "cpuinfo"
    path.write_text("\n".join(out) + "\n")
    return path


needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not Path("/proc/cpuinfo").exists(),
    reason="a second machine needs root, unshare and /proc/cpuinfo",
)


@needs_namespaces
def test_a_shared_cache_builds_again_for_another_cpu_and_reuses_for_the_same(tmp_path):
    compiler, log = _compiler(tmp_path)
    env = _env(tmp_path, compiler)
    here = _python(BUILD, env)
    assert Path(here).is_file() and len(log.read_text().splitlines()) == 1
    assert _python(BUILD, env) == here  # same CPU, same flags: built once
    assert len(log.read_text().splitlines()) == 1
    there = _python(BUILD, env, cpuinfo=_other_cpu(tmp_path))
    assert there != here, "a library built for one CPU was reused for another"
    assert Path(there).is_file() and len(log.read_text().splitlines()) == 2
    # the same other CPU again: its own library, reused
    assert _python(BUILD, env, cpuinfo=_other_cpu(tmp_path)) == there
    assert len(log.read_text().splitlines()) == 2


def test_other_compiler_flags_or_version_get_their_own_library(tmp_path):
    """A release that changes the flags (say, drops -ffp-contract=off), or a compiler
    upgraded in place (same path, new version), must not load the library the old flags or
    compiler built into the same cache."""
    compiler, log = _compiler(tmp_path)
    env = _env(tmp_path, compiler)
    plain = _python(BUILD, env)
    other_flags = BUILD.replace(
        "print(", "n.FLAGS = tuple(f for f in n.FLAGS if f != '-fno-trapping-math')\nprint("
    )
    changed = _python(other_flags, env)
    assert changed != plain
    runs = log.read_text().splitlines()
    assert len(runs) == 2
    assert "-fno-trapping-math" in runs[0] and "-fno-trapping-math" not in runs[1]
    (tmp_path / "cc.version").write_text("cc (test) 2.0\n")  # the package upgraded
    upgraded = _python(BUILD, env)
    assert upgraded not in (plain, changed), "another compiler version's library was reused"
    assert len(log.read_text().splitlines()) == 3


SENDER = CPU_NATIVE + "print(n.native_sender())\n"


def test_the_off_switch_never_runs_the_compiler_nor_loads_the_library(tmp_path):
    compiler, log = _compiler(tmp_path)
    off = _python(SENDER, _env(tmp_path, compiler, FSDP_EXT_NATIVE_CPU="0"))
    assert off == "None"
    assert not log.exists(), "the compiler ran although FSDP_EXT_NATIVE_CPU=0"
    assert not list((tmp_path / "cache").rglob("*.so*"))
    # and on: the same program builds and uses it (so the check above can fail)
    on = _python(SENDER, _env(tmp_path, compiler))
    assert on.startswith("<_FuncPtr object") and log.exists()


def test_the_off_switch_is_read_at_each_call(monkeypatch):
    """A process that loaded the library still honours the switch set later (a test or a
    debugging session turning it off mid-run)."""
    from fsdp_ext.kernels.cpu_native import ENV, native_sender

    monkeypatch.setenv(ENV, "0")
    assert native_sender() is None
