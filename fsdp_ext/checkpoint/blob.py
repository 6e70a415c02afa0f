"""Blobs: the storage interface that a POSIX directory and an S3 bucket both fit.

The commit protocol, leases, ownership, prune and resume are to be written once on these
seven primitives, so that they need nothing an object store lacks (no rename, no link, no
directory, no fsync, no mtime):

==================================  ========================================================
``put(key, data)``                  replace the whole object atomically; a reader sees the
                                    old bytes or the new, never a mix. Returns the new ETag.
                                    ``data`` is bytes, or a **stream**: an iterable of
                                    bytes-like chunks, consumed once, never held whole (S3
                                    sends it as a multipart upload above the part size; a
                                    failed or abandoned one is aborted, never visible).
``put_if_absent(key, data)``        create only if no object is there (``If-None-Match: *``):
                                    of racing writers exactly one wins, the others get
                                    :class:`BlobExistsError`. Returns the ETag.
``replace_if(key, data, etag)``     replace only if the object's ETag is still ``etag``
                                    (``If-Match``); else :class:`BlobChangedError` (also when
                                    the object is gone). Returns the new ETag.
``get(key, start=None, end=None)``  bytes ``[start, end)``: ``end`` is exclusive, as in a
                                    Python slice (``get(k, 0, 4)`` is the first 4 bytes; S3's
                                    ``Range: bytes=0-3``). A range past the end is cut at the
                                    end (``b""`` when it starts there). A missing object
                                    raises :class:`BlobNotFoundError`.
``head(key)``                       ``BlobInfo(size, etag)``, or None when there is none.
``list(prefix)``                    the keys that start with ``prefix`` (a string prefix, as
                                    on S3: ``"step-1"`` lists ``step-10/x`` too), sorted.
``delete(key)``                     remove the object; a missing one is no error (S3 cannot
                                    tell either).
==================================  ========================================================

**Keys** are ``/``-separated strings relative to the store's root: no leading or trailing
``/``, no empty, ``.`` or ``..`` part, and no part starting with ``.blob-`` (the POSIX
store's own temporary and lock files). The same key is valid on both stores.

**ETags** are opaque strings, compared only for equality: nothing here or above takes one for
a checksum (the manifest's CRC-32 is that). The POSIX store gives the MD5 of the object's
bytes in quotes, as S3 does for a single-part upload; S3 gives ``"<md5 of the parts'
md5s>-N"`` for a multipart upload, and other servers (or SSE-KMS) other strings. A stale
ETag therefore fails whenever the bytes changed; bytes written
back exactly as they were (A, B, A) make an old ETag good again, on S3 as here, so a
protocol that needs every write told apart writes something new each time (a counter, a
generation, an owner id).

**Errors** derive from :class:`BlobError`: :class:`BlobNotFoundError` (also a
``FileNotFoundError``), :class:`BlobConditionError` and its two cases, and
:class:`BlobAccessError` for a store that cannot be used at all (a missing bucket, refused
credentials, an unreachable endpoint): one message naming the location, the cause and the fix.

:func:`fsdp_ext.checkpoint.location.blob_store_for` is the one function that turns a
location into a store (it sits in a module of its own, above both stores, so that no
module imports one that imports it back).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = [
    "INTERNAL_PREFIX",
    "BlobAccessError",
    "BlobChangedError",
    "BlobConditionError",
    "BlobError",
    "BlobExistsError",
    "BlobInfo",
    "BlobNotFoundError",
    "BlobStore",
    "Data",
    "check_key",
    "etag_of",
    "is_stream",
]

# a key part starting with this is the POSIX store's own (temporary files, locks)
INTERNAL_PREFIX = ".blob-"


Bytes = bytes | bytearray | memoryview
Data = Bytes | Iterable[Bytes]  # what ``put`` takes: bytes, or a stream of chunks


def is_stream(data: object) -> bool:
    """Whether ``data`` is a stream of chunks for ``put`` rather than bytes."""
    return not isinstance(data, (bytes, bytearray, memoryview, str)) and isinstance(data, Iterable)


class BlobError(Exception):
    """Something a blob store refused or could not do; the message names the location."""


class BlobNotFoundError(BlobError, FileNotFoundError):
    """No object under that key."""


class BlobConditionError(BlobError):
    """A conditional write's precondition did not hold (S3's 412 ``PreconditionFailed``)."""


class BlobExistsError(BlobConditionError, FileExistsError):
    """``put_if_absent``: an object is already there (another writer won)."""


class BlobChangedError(BlobConditionError):
    """``replace_if``: the object's ETag is no longer the one given, or the object is gone."""


class BlobAccessError(BlobError, OSError):
    """The store cannot be used at all: a missing bucket, refused credentials, an endpoint
    that does not answer. The message names the location, the cause and the fix."""


class BlobInfo(NamedTuple):
    """What ``head`` tells: the object's size in bytes and its ETag."""

    size: int
    etag: str


def etag_of(data: bytes | bytearray | memoryview) -> str:
    """The ETag of ``data`` as S3 gives it for a single-part upload: its MD5, in quotes."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


def check_key(key: object, name: str = "key") -> str:
    """``key`` if it is a valid key (see the module docstring), else one ValueError saying why."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{name} must be a non-empty str, got {key!r}")
    parts = key.split("/")
    bad = [p for p in parts if p in ("", ".", "..") or p.startswith(INTERNAL_PREFIX)]
    if bad or "\0" in key:
        raise ValueError(
            f"{name} {key!r}: keys are '/'-separated parts relative to the store's root, "
            f"with no leading or trailing '/', no empty, '.' or '..' part and no part "
            f"starting with {INTERNAL_PREFIX!r}"
        )
    return key


def check_prefix(prefix: object) -> str:
    """A ``list`` prefix: "" (everything) or the start of a key."""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {prefix!r}")
    if prefix and (prefix.startswith("/") or "\0" in prefix):
        raise ValueError(f"prefix {prefix!r} must be relative to the store's root (no leading /)")
    return prefix


def check_range(start: object, end: object) -> tuple[int, int | None]:
    """``get``'s ``start`` and ``end`` as ints (``end`` None: to the end), or a ValueError."""
    for name, value in (("start", start), ("end", end)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 (no negative offsets), got {value!r}")
    first = 0 if start is None else start
    if end is not None and end < first:
        raise ValueError(f"end ({end}) must be >= start ({first}); end is exclusive")
    return first, end


def check_data(data: object) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, bytearray or memoryview, got {type(data).__name__}")
    return memoryview(data).cast("B")


class BlobStore(ABC):
    """A flat namespace of objects under one root (see the module docstring)."""

    location: str  # what the user named, e.g. "s3://bucket/run" or "/data/run"
    # the least one of a writer's parallel streams should carry (0: no least): on S3 a part,
    # since a smaller file only adds requests for the server, not bandwidth
    min_stream_bytes: int = 0

    @abstractmethod
    def put(self, key: str, data: Data) -> str: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> str: ...

    @abstractmethod
    def replace_if(self, key: str, data: bytes | bytearray | memoryview, etag: str) -> str: ...

    @abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...

    @abstractmethod
    def head(self, key: str) -> BlobInfo | None: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def abort_uploads(self, prefix: str = "", which: Callable[[str], bool] | None = None) -> int:
        """Housekeeping, not a primitive: abort the unfinished streamed puts under ``prefix``
        (those whose key ``which`` accepts) that a killed writer left, and return how many.
        Nothing to do here: only S3 keeps them (a POSIX writer's temporary file is never
        listed)."""
        return 0

    def where(self, key: str) -> str:
        """``key``'s full location, for messages."""
        return f"{self.location.rstrip('/')}/{key}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"
