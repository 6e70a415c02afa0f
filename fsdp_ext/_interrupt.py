"""Ctrl-C while fsdp_ext (and torch under it) imports: one line and exit status 130.

Importing torch takes seconds; a Ctrl-C then used to print a traceback through torch's
import machinery. ``fsdp_ext/__init__.py`` imports this module first, which installs the
handler (only over Python's default one, in the main thread). Once the package is imported
(its ``__all__`` is set, last), a Ctrl-C is the program's again: the handler puts Python's
default back and raises KeyboardInterrupt as it would have.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["INTERRUPTED"]

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def _imported() -> bool:
    package = sys.modules.get("fsdp_ext")
    return package is not None and hasattr(package, "__all__")


def _interrupted(signum, frame) -> None:
    if _imported():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without us
    os.write(2, b"interrupted while importing torch (fsdp_ext); nothing was started\n")
    raise SystemExit(INTERRUPTED)  # unwinds the import without a traceback


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # else: the program's
        signal.signal(signal.SIGINT, _interrupted)


_install()
