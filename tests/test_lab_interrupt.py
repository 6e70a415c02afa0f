"""Ctrl-C while torch imports: train.py ends in one line with exit status 130, not a
traceback through the import machinery.

The interrupt is sent the way a terminal sends it (SIGINT to the process) once the process
is inside torch's import: its shared library is mapped (/proc/PID/maps).

The program does this itself (a ``try``/``except KeyboardInterrupt`` around its first
import): importing the library installs no signal handler
(``tests/test_import_side_effects.py``). ``python -m fsdp_ext.lab`` cannot: its own package
imports torch before any line of the lab runs, so a Ctrl-C in those seconds is Python's
plain KeyboardInterrupt; once running, the lab's command line handles Ctrl-C itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 120


def _inside_torch_import(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _as_a_shell_starts_it() -> None:
    """Ctrl-C as a shell leaves it to a foreground job (default, unblocked), whatever this
    test process inherited: in a full run something had left SIGINT ignored here, and an
    ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_while_torch_imports_is_one_line_and_status_130(tmp_path):
    argv = [sys.executable, str(REPO / "examples" / "train.py"), "--steps", "1"]
    proc = subprocess.Popen(
        [*argv, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=_as_a_shell_starts_it,
    )
    deadline = time.monotonic() + WAIT_S
    while not _inside_torch_import(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    assert "interrupted" in line
