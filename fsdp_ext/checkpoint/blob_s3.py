"""The blob primitives on an S3 bucket (AWS, or any server that speaks S3: SeaweedFS, MinIO,
R2, Ceph), through boto3.

Each primitive is one S3 request, and S3 itself keeps the promise: ``PutObject`` replaces a
whole object atomically; ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *`` and
``replace_if`` is ``PutObject`` with ``If-Match: ETAG`` (a 412 ``PreconditionFailed``
refuses them; AWS added both in 2024); ``get`` sends ``Range: bytes=FIRST-LAST`` (S3's
range is inclusive, ours ends before ``end``); ``list`` pages through ``ListObjectsV2``.

The endpoint, the credentials and the retries come the usual way, never from our own
config: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and ``~/.aws/config``, ``AWS_MAX_ATTEMPTS`` and
``AWS_RETRY_MODE``.

The first request of a store checks the bucket (``HeadBucket``), so that a missing bucket,
refused credentials or an endpoint that does not answer each give one
:class:`~fsdp_ext.checkpoint.blob.BlobAccessError` naming the location, the cause and the
fix, instead of a 404 that would read as "no such object". The boto3 client is made on first
use in each process (a store pickles without it) and is shared by threads.

**A server that dies** (killed, its host gone) fails each request within a bounded time, as
one ``BlobAccessError`` naming the object, the endpoint and the cause ("stopped answering":
the store had answered before). Bounds, with botocore's default retries (``standard`` mode,
3 attempts, at most 0.1 s and then 0.2 s of backoff between them): a refused connection (the process
is gone, its host is up) fails in well under a second; an endpoint that drops packets (the
host is gone) fails after 3 x :data:`CONNECT_TIMEOUT_S`; a server that accepts and then
never answers, after 3 x botocore's 60 s read timeout. A body cut mid-transfer (a GET whose
server died while sending) is fetched again, :data:`BODY_ATTEMPTS` times in all.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fsdp_ext.checkpoint.blob import (
    BlobAccessError,
    BlobChangedError,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStore,
    Data,
    check_data,
    check_key,
    check_prefix,
    check_range,
    is_stream,
)

__all__ = ["S3BlobStore"]

T = TypeVar("T")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_CREDENTIALS_REFUSED = {
    "403",
    "AccessDenied",
    "ExpiredToken",
    "Forbidden",
    "InvalidAccessKeyId",
    "InvalidToken",
    "SignatureDoesNotMatch",
}
_CONFLICT_RETRIES = 5  # S3 answers 409 ConditionalRequestConflict to racing conditional puts
# seconds to open a connection (botocore's default: 60; its "standard" defaults mode: 3.1):
# an endpoint whose host is gone fails after 3 attempts of this, not 3 minutes
CONNECT_TIMEOUT_S = 5.0
# a streamed put above this many bytes is a multipart upload of parts this size (S3: at least
# 5 MiB but the last, at most 10,000 parts; they double every 1000 here, so 8 MiB parts hold
# 8 TB); FSDP_EXT_S3_PART_BYTES or part_bytes= sets it. 8 MiB is boto3's own multipart chunk.
# A part is sent from the stream's own memory (_Part); 64 MiB parts, behind a 200 Mbit/s
# link, were sent again in part (docs/checkpoint.md, "S3's part size")
DEFAULT_PART_BYTES = 8 << 20
PART_BYTES_ENV = "FSDP_EXT_S3_PART_BYTES"
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000
BODY_ATTEMPTS = 3  # a GET whose body was cut mid-transfer is sent again, up to this in all
_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, to credentials this "
    "server accepts"
)


_LOADER: list[Any] = []  # botocore's loader of API models, shared by this process's clients
# clients by (pid, the environment that configures them): making one took 0.3-0.5 s, and a
# checkpoint's writer, reader and owner each open the location; a forked child makes its own
_CLIENTS: dict[tuple, Any] = {}
_CHECKED: set[tuple] = set()  # (client key, bucket) whose HeadBucket passed
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
)


def _client_key() -> tuple:
    return (os.getpid(), *(os.environ.get(name) for name in _CLIENT_ENV))


def _botocore_session() -> Any:
    """A fresh botocore session (it reads the environment anew: endpoint, credentials,
    profile) that shares one loader of API models with the others: loading them took
    0.3-0.7 s per client."""
    import botocore.session

    session = botocore.session.Session()
    if not _LOADER:
        _LOADER.append(session.get_component("data_loader"))
    session.register_component("data_loader", _LOADER[0])
    return session


def _s3_config(session: Any) -> dict[str, Any] | None:
    """Payloads unsigned unless the profile says otherwise (``payload_signing_enabled`` in
    its ``s3`` section): over plain HTTP botocore signs a SHA-256 of every body, a pass over
    every byte at 253 MB/s here (a 63 MB save's client CPU went from 0.48 to 0.30 s
    without it); over HTTPS it skips that itself. The body stays guarded by the CRC32
    checksum header botocore sends (signed) and, on load, by the manifest's CRC-32."""
    try:
        profile = session.get_scoped_config().get("s3") or {}
    except Exception:  # a missing profile: the client's creation says so, once
        profile = {}
    return None if "payload_signing_enabled" in profile else {"payload_signing_enabled": False}


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or str(status or "")


def _cause(exc: BaseException) -> str:
    """``exc``'s text on one line, with the system's reason where one lies beneath (botocore
    says "Could not connect to the endpoint URL"; the socket said "Connection refused")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror and e.strerror not in text:
            return f"{text}: {e.strerror}"
        kwargs = getattr(e, "kwargs", None)
        todo += [e.__cause__, e.__context__, *(getattr(e, "args", ()) or ())]
        if isinstance(kwargs, dict):
            todo.append(kwargs.get("error"))
        todo = [t for t in todo if isinstance(t, BaseException)]
    return text


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None) or {}
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


class _Part(io.RawIOBase):
    """One part of a streamed put as a seekable file over views of the stream's chunks: the
    tensors' own memory is sent as it is, never copied into a part buffer. botocore reads it
    twice (its CRC32 checksum, then the socket) and seeks back for a retry. Copying parts
    held ``thread_count`` x the part size per rank above the state (1.27x the state on S3 in
    the lab, docs/checkpoint.md); the views hold nothing the staged state does not."""

    def __init__(self, views: list[memoryview]):
        super().__init__()
        self._views = views
        self.size = sum(len(v) for v in views)
        self._pos = 0
        self._at = (0, 0)  # (view, offset in it) of _pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(0, base + offset), self.size)
        index, rest = 0, self._pos
        while index < len(self._views) and rest >= len(self._views[index]):
            rest -= len(self._views[index])
            index += 1
        self._at = (index, rest)
        return self._pos

    def read(self, size: int | None = -1) -> bytes | memoryview:
        """Up to ``size`` bytes: a view where they lie in one chunk, else joined."""
        if size is None or size < 0:
            size = self.size - self._pos
        pieces, index, offset = [], *self._at
        while size > 0 and index < len(self._views):
            view = self._views[index]
            piece = view[offset : offset + size]
            pieces.append(piece)
            size -= len(piece)
            self._pos += len(piece)
            offset += len(piece)
            if offset == len(view):
                index, offset = index + 1, 0
        self._at = (index, offset)
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


class _Chunks:
    """A stream of chunks taken in parts of a given size, as views (nothing copied)."""

    def __init__(self, chunks: Any):
        self._chunks = iter(chunks)
        self._rest: memoryview | None = None
        self._kept: _Part | None = None

    def keep(self, part: _Part) -> None:
        """Give back a part taken: the next :meth:`take` returns it as it is."""
        self._kept = part

    def take(self, size: int) -> _Part:
        """The next ``size`` bytes (fewer at the end), as views of the chunks: a chunk that
        crosses the boundary is split, its rest kept (a view) for the next call. The chunks
        must not change until their part is sent: they are the staged tensors' memory."""
        if self._kept is not None:
            out, self._kept = self._kept, None
            return out
        views, filled = [], 0
        while filled < size:
            if self._rest is None:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._rest = memoryview(chunk).cast("B")
                if not len(self._rest):
                    self._rest = None
                    continue
            room = min(size - filled, len(self._rest))
            views.append(self._rest[:room])
            filled += room
            self._rest = self._rest[room:] if len(self._rest) > room else None
        return _Part(views)


def _read_body(reply: dict) -> bytes:
    with reply["Body"] as body:
        return body.read()


class S3BlobStore(BlobStore):
    """Blobs as objects ``PREFIX/KEY`` of ``bucket`` (see the module docstring)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        location: str | None = None,
        part_bytes: int | None = None,
    ):
        if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(
                f"location {location or bucket!r}: the bucket name {bucket!r} is not a valid "
                "S3 bucket name (3 to 63 lowercase letters, digits, '-' and '.'); write "
                "s3://BUCKET/PREFIX"
            )
        if prefix:
            check_key(prefix, "the location's prefix")
        self.bucket, self.prefix = bucket, prefix
        if part_bytes is None:
            part_bytes = int(os.environ.get(PART_BYTES_ENV, DEFAULT_PART_BYTES))
        if not isinstance(part_bytes, int) or part_bytes < MIN_PART_BYTES:
            raise ValueError(
                f"part_bytes ({PART_BYTES_ENV}) must be an int >= {MIN_PART_BYTES} (S3's "
                f"smallest part, 5 MiB), got {part_bytes!r}"
            )
        self.part_bytes = self.min_stream_bytes = part_bytes
        self.location = location or f"s3://{bucket}/{prefix}".rstrip("/")
        self._client: Any = None
        self._checked = False
        self._guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_client=None, _checked=False, _guard=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard = threading.Lock()

    # -- the client, the bucket check and the errors -------------------------------------------

    def _s3(self) -> Any:
        """The boto3 client, made once per process; the bucket is checked on first use."""
        with self._guard:
            key = _client_key()
            if self._client is None and key in _CLIENTS:
                self._client = _CLIENTS[key]
                self._checked = (key, self.bucket) in _CHECKED
            if self._client is None:
                try:
                    import boto3
                except ImportError as exc:
                    raise BlobAccessError(
                        f"{self.location}: S3 locations need boto3; pip install boto3 "
                        "(or fsdp-ext[s3])"
                    ) from exc
                from botocore.config import Config

                session = _botocore_session()
                config = Config(connect_timeout=CONNECT_TIMEOUT_S, s3=_s3_config(session))
                self._client = boto3.session.Session(botocore_session=session).client(
                    "s3", config=config
                )
                _CLIENTS[key] = self._client
            client = self._client
            if not self._checked:
                self._call(lambda: client.head_bucket(Bucket=self.bucket), None, checking=True)
                self._checked = True
                _CHECKED.add((key, self.bucket))
        return client

    @property
    def endpoint(self) -> str:
        return self._client.meta.endpoint_url if self._client is not None else "?"

    def _object(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, request: Callable[[], T], key: str | None, checking: bool = False) -> T:
        """``request()``, with the errors that mean "this store cannot be used" turned into
        one :class:`BlobAccessError`; others (404, 412...) are left to the caller."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from urllib3.exceptions import HTTPError  # a body cut mid-transfer, raw

        where = self.where(key) if key else self.location
        reached, started = self._checked and not checking, time.monotonic()
        try:
            return request()
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise BlobAccessError(f"{where}: no S3 credentials found ({exc}); "
                                  f"{_CREDENTIALS_FIX}") from exc  # fmt: skip
        except ClientError as exc:
            code = _code(exc)
            if code == "NoSuchBucket" or (checking and code in ("404", "NotFound")):
                raise BlobAccessError(
                    f"{where}: the bucket {self.bucket!r} does not exist at {self.endpoint}; "
                    f"create it (aws s3 mb s3://{self.bucket}) or fix the location"
                ) from exc
            if code in _CREDENTIALS_REFUSED:
                raise BlobAccessError(
                    f"{where}: {self.endpoint} refused the credentials ({code}: "
                    f"{exc.response.get('Error', {}).get('Message', 'access denied')}); "
                    f"{_CREDENTIALS_FIX}, with access to the bucket {self.bucket!r}"
                ) from exc
            if code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
                raise BlobAccessError(
                    f"{where}: the bucket {self.bucket!r} is in another region ({code}); set "
                    "AWS_REGION (or the profile's region) to the bucket's"
                ) from exc
            raise
        except (BotoCoreError, HTTPError) as exc:  # no connection, timeouts, a bad endpoint URL
            if reached:  # it answered this process before: the server died or hangs
                raise BlobAccessError(
                    f"{where}: the S3 endpoint {self.endpoint} stopped answering "
                    f"({_cause(exc)}; gave up after {time.monotonic() - started:.1f} s of "
                    "retries); what is published there is unchanged: retry once the server is "
                    "back"
                ) from exc
            raise BlobAccessError(
                f"{where}: cannot reach the S3 endpoint {self.endpoint} ({_cause(exc)}); check "
                "AWS_ENDPOINT_URL (or the profile's endpoint_url) and that the server runs"
            ) from exc

    # -- the primitives -----------------------------------------------------------------------

    def _put(self, key: str, data: Any, **condition: str) -> str:
        if isinstance(data, _Part):  # a stream's only part
            body = data
        else:
            view = check_data(data)
            body = data if isinstance(data, (bytes, bytearray)) else view.tobytes()  # no copy
        client, name = self._s3(), self._object(key)
        for attempt in range(_CONFLICT_RETRIES):
            try:
                reply = self._call(
                    lambda: client.put_object(Bucket=self.bucket, Key=name, Body=body, **condition),
                    key,
                )
                return reply["ETag"]
            except Exception as exc:
                code = _code(exc)
                if code == "ConditionalRequestConflict" and attempt + 1 < _CONFLICT_RETRIES:
                    continue
                if code in ("PreconditionFailed", "412") and "IfNoneMatch" in condition:
                    raise BlobExistsError(
                        f"{self.where(key)}: already exists (put_if_absent: another writer "
                        "created it)"
                    ) from None
                if code in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                    raise BlobChangedError(
                        f"{self.where(key)}: replace_if expected ETag {condition['IfMatch']}, "
                        "but the object changed or is gone (another writer)"
                    ) from None
                raise
        raise AssertionError("unreachable")

    def put(self, key: str, data: Data) -> str:
        if not is_stream(data):
            return self._put(key, data)
        chunks = _Chunks(data)
        first = chunks.take(self.part_bytes)
        if first.size < self.part_bytes:  # it all fits in one part: one PutObject
            return self._put(key, first)
        chunks.keep(first)
        return self._put_multipart(key, chunks)

    def _put_multipart(self, key: str, chunks: _Chunks) -> str:
        """``chunks`` as one multipart upload, a part at a time, sent from the chunks' own
        memory; aborted on any failure (the object is never seen half-written)."""
        client, name = self._s3(), self._object(key)
        upload = self._call(
            lambda: client.create_multipart_upload(Bucket=self.bucket, Key=name), key
        )["UploadId"]
        parts: list[dict[str, Any]] = []
        try:
            while True:
                # S3's parts may differ in size: they double every 1000, so that 10,000
                # parts hold 1000 x (2^10 - 1) x the part size
                part = chunks.take(self.part_bytes << (len(parts) // 1000))
                if not part.size:
                    break
                number = len(parts) + 1
                if number > MAX_PARTS:
                    raise ValueError(
                        f"{self.where(key)}: the stream needs more than {MAX_PARTS} parts; "
                        f"raise the part size ({self.part_bytes} bytes, {PART_BYTES_ENV})"
                    )
                reply = self._call(
                    lambda body=part, number=number: client.upload_part(
                        Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=number, Body=body
                    ),
                    key,
                )
                parts.append({"PartNumber": number, "ETag": reply["ETag"]})
            reply = self._call(
                lambda: client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload,
                    MultipartUpload={"Parts": parts},
                ),
                key,
            )
            return reply["ETag"]
        except BaseException:
            self._abort(name, upload)
            raise

    def _abort(self, name: str, upload: str) -> None:
        with contextlib.suppress(Exception):  # swept later by abort_uploads if this fails
            self._s3().abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)

    def abort_uploads(self, prefix: str = "", which: Callable[[str], bool] | None = None) -> int:
        """Abort every unfinished multipart upload under ``prefix`` (ListMultipartUploads)
        whose key ``which`` accepts: what a killed writer left. Not a blob primitive: S3's
        own housekeeping, which the commit's sweep of dead versions calls. Returns how many
        it aborted."""
        prefix = check_prefix(prefix)
        client = self._s3()
        base = f"{self.prefix}/" if self.prefix else ""
        found: list[tuple[str, str]] = []

        def collect() -> None:
            pages = client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                found.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads", ()))

        self._call(collect, None)
        found = [(n, u) for n, u in found if which is None or which(n[len(base) :])]
        for name, upload in found:
            self._abort(name, upload)
        return len(found)

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> str:
        return self._put(key, data, IfNoneMatch="*")

    def replace_if(self, key: str, data: bytes | bytearray | memoryview, etag: str) -> str:
        if not isinstance(etag, str) or not etag:
            raise ValueError(f"etag must be a non-empty str (from put or head), got {etag!r}")
        return self._put(key, data, IfMatch=etag)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        first, end = check_range(start, end)
        client, name = self._s3(), self._object(key)
        if end is not None and end == first:  # an empty range: S3 has no way to ask for one
            if self.head(key) is None:
                raise BlobNotFoundError(f"{self.where(key)}: no such object")
            return b""
        extra = {}
        if first or end is not None:
            extra["Range"] = f"bytes={first}-{'' if end is None else end - 1}"
        for attempt in range(BODY_ATTEMPTS):
            try:
                reply = self._call(
                    lambda: client.get_object(Bucket=self.bucket, Key=name, **extra), key
                )
            except Exception as exc:
                code = _code(exc)
                if code in ("NoSuchKey", "404"):
                    raise BlobNotFoundError(f"{self.where(key)}: no such object") from None
                if code == "InvalidRange" or _status(exc) == 416:  # starts at or past the end
                    return b""
                raise
            try:
                return self._call(functools.partial(_read_body, reply), key)
            except BlobAccessError:  # cut mid-transfer: ask again (a dead server refuses)
                if attempt + 1 == BODY_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def head(self, key: str) -> BlobInfo | None:
        client, name = self._s3(), self._object(key)
        try:
            reply = self._call(lambda: client.head_object(Bucket=self.bucket, Key=name), key)
        except Exception as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return BlobInfo(int(reply["ContentLength"]), reply["ETag"])

    def list(self, prefix: str = "") -> list[str]:
        prefix = check_prefix(prefix)
        client = self._s3()
        base = f"{self.prefix}/" if self.prefix else ""
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base + prefix
        )
        keys: list[str] = []

        def collect() -> None:
            for page in pages:
                keys.extend(item["Key"][len(base) :] for item in page.get("Contents", ()))

        self._call(collect, None)
        return sorted(keys)

    def delete(self, key: str) -> None:
        client, name = self._s3(), self._object(key)
        self._call(lambda: client.delete_object(Bucket=self.bucket, Key=name), key)
