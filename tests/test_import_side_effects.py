"""Importing the library changes nothing in the process.

A fresh interpreter takes a snapshot of what a library must leave alone, imports ``fsdp_ext``
(every room, the kernels included), and takes it again: Python's signal handlers, the
kernel's record of the process's signal dispositions (ignored, caught, blocked: a handler set
from C counts too), the import system (``sys.meta_path``, ``sys.path_hooks``) and the
exception hooks. Signal handling belongs to the programs (``examples/train.py``, the lab's
command line), and a source checkout imports its kernels without an import hook.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SNAPSHOT = r"""
import json, signal, sys, threading

# glibc catches two signals of its own (32 and 33, below SIGRTMIN) once a second thread
# starts; Python cannot see or set them, and any thread (torch's pools) starts that.
VISIBLE = sum(1 << (s - 1) for s in signal.valid_signals())

def snapshot():
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {
        "handlers": {
            str(s): repr(signal.getsignal(s))
            for s in sorted(signal.valid_signals())
            if s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "dispositions": {
            k: int(status[k], 16) & VISIBLE for k in ("SigIgn", "SigCgt", "SigBlk")
        },
        "meta_path": [repr(f) for f in sys.meta_path],
        "path_hooks": [repr(f) for f in sys.path_hooks],
        "hooks": [repr(sys.excepthook), repr(threading.excepthook), repr(sys.unraisablehook)],
    }

before = snapshot()
import fsdp_ext, fsdp_ext.kernels.backend
after = snapshot()
print(json.dumps({"before": before, "after": after, "file": fsdp_ext.__file__}))
"""


def _fresh_signal_state() -> None:
    """Every signal at its default and none blocked, as a fresh login shell starts a program:
    ignored signals and the blocked mask survive exec, and this test process may have
    inherited, or a library import in it may have made, either."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(s, signal.SIG_DFL)


def test_importing_fsdp_ext_changes_no_signal_handler_import_hook_or_disposition(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SNAPSHOT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: PYTHONPATH alone finds the package
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=_fresh_signal_state,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["file"] == str(REPO / "fsdp_ext" / "__init__.py")
    before, after = got["before"], got["after"]
    # Ctrl-C is Python's own before and after: KeyboardInterrupt, the program's to handle
    sigint = str(signal.SIGINT)
    assert before["handlers"][sigint] == after["handlers"][sigint]
    assert after["handlers"][sigint] == repr(signal.default_int_handler)
    changed = {}
    for key, old in before.items():
        new = after[key]
        if isinstance(old, dict):
            changed.update({f"{key}[{k}]": (old[k], new[k]) for k in old if old[k] != new[k]})
        elif old != new:
            changed[key] = (old, new)
    assert changed == {}


LAZY = r"""
import json, sys
import examples.train, fsdp_ext
eager = sorted(m for m in ("torch.distributed.pipelining", "torch._dynamo") if m in sys.modules)
stage = fsdp_ext.FSDPPipelineStage
print(json.dumps({"eager": eager, "later": "torch._dynamo" in sys.modules,
                  "same": stage is __import__("fsdp_ext.pipeline").pipeline.FSDPPipelineStage}))
"""


def test_a_job_without_a_pipeline_does_not_import_pipelining_or_dynamo(tmp_path):
    """``torch.distributed.pipelining`` imports ``torch._dynamo``: about 1 s of CPU in every
    rank, launcher and tool that imports fsdp_ext (mutant: ``fsdp_ext/__init__.py`` importing
    ``fsdp_ext.pipeline`` eagerly again). The pipeline names still resolve, to the same
    objects, on first use."""
    out = subprocess.run(
        [sys.executable, "-c", LAZY],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"eager": [], "later": True, "same": True}
