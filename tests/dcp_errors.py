"""The error text of a failed ``dcp.load``, on every torch release we support.

torch 2.11's ``dcp.load`` drops a storage reader's ``.metadata`` error and raises a bare
"metadata is None"; our reader logs the error first (``fsdp_ext._torch``, worded as 2.13's own
message). Tests that assert on the cause read it here: the exception's text, plus on 2.11
what was logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fsdp_ext._torch import DCP_LOAD_DROPS_METADATA_ERRORS

__all__ = ["LoggedMetadataErrors", "error_text", "logged_metadata_errors"]


class LoggedMetadataErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def logged_metadata_errors() -> Iterator[LoggedMetadataErrors]:
    """Collect what the shim logs; ``logging.disable`` at WARNING or below keeps it."""
    handler = LoggedMetadataErrors()
    logger = logging.getLogger("fsdp_ext._torch")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def error_text(exc: BaseException, logged: LoggedMetadataErrors) -> str:
    """``str(exc)``; where torch dropped the reader's error (2.11), with what it logged."""
    text = str(exc)
    if DCP_LOAD_DROPS_METADATA_ERRORS and "metadata is None" in text:
        text = "\n".join([text, *logged.messages])
    logged.messages.clear()
    return text
