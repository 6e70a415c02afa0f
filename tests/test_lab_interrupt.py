"""Ctrl-C while torch imports: the lab's command line and train.py end in one line with
exit status 130, not a traceback through the import machinery.

The interrupt is sent the way a terminal sends it (SIGINT to the process) once the process
is inside torch's import: its shared library is mapped (/proc/PID/maps).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "fsdp_ext.lab", "check"],
        [sys.executable, str(REPO / "examples" / "train.py"), "--steps", "1"],
    ],
    ids=["lab", "train.py"],
)
def test_ctrl_c_while_torch_imports_is_one_line_and_status_130(argv, tmp_path):
    proc = subprocess.Popen(
        [*argv, *(["--out", str(tmp_path)] if "train.py" in argv[1] else [])],
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
