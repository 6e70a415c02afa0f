"""Running the host's tools (ip, tc, ssh-keygen), with errors that carry their stderr."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LabCommandError", "niced", "run_tool", "start_daemon"]


class LabCommandError(RuntimeError):
    """A host tool the lab relies on failed; the message holds the command and its stderr."""


def run_tool(
    argv: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30
) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, input=input, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabCommandError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise LabCommandError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def niced(nice: int) -> list[str]:
    """The argv prefix that runs a command at ``nice`` (none at 0)."""
    return ["nice", "-n", str(nice)] if nice else []


def start_daemon(argv: Sequence[str], log: Path, *, cwd: Path | None = None) -> subprocess.Popen:
    """Start a lab service (etcd, sshfs, weed) in a session of its own, so that teardown can
    end its whole process group, with its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
