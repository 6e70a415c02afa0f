"""Ctrl-C while fsdp_ext (and torch under it) imports: one line and exit status 130.

Importing torch takes seconds; a Ctrl-C then used to print a traceback through torch's
import machinery. ``fsdp_ext/__init__.py`` imports this module first, which installs the
handler (only over Python's default one, in the main thread), and calls ``release()``
last, which gives Ctrl-C back to the program (KeyboardInterrupt) once the import is done.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["release"]

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def _interrupted(_signum, _frame) -> None:
    os.write(2, b"interrupted while importing torch (fsdp_ext); nothing was started\n")
    os._exit(INTERRUPTED)


def _install() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False  # the program chose its own: leave it
    signal.signal(signal.SIGINT, _interrupted)
    return True


def release() -> None:
    """Ctrl-C raises KeyboardInterrupt again (if this module's handler is still the one)."""
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is _interrupted
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)


_install()
