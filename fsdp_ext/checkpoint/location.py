"""Where checkpoints live, named by a string: the one place a location becomes a blob store.

``"/path"`` or a relative path, ``"file:///path"``: a POSIX directory (``blob_posix.py``);
``"s3://bucket[/prefix]"``: an S3 bucket (``blob_s3.py``). Nothing else constructs a store
by name, so a new kind of storage is one file plus one branch here. The directory protocol's
default storage (``LocalStorage``) is resolved here too (:func:`posix_storage`).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from fsdp_ext.checkpoint.blob import BlobStore
from fsdp_ext.checkpoint.blob_posix import PosixBlobStore
from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.storage import CheckpointStorage

__all__ = ["LOCATION_FORMS", "blob_store_for", "is_object_store", "posix_storage"]

LOCATION_FORMS = "'/path' (or a relative path), 'file:///path' or 's3://bucket[/prefix]'"


def posix_storage(fs: CheckpointStorage | None = None) -> CheckpointStorage:
    """``fs``, or the local filesystem: the storage of the directory protocol (a path
    location). The one place outside ``fs.py`` that names ``LocalStorage``, so that no other
    module hard-codes where checkpoints live (``tests/test_architecture.py`` checks)."""
    return fs if fs is not None else LocalStorage()


def is_object_store(location: object) -> bool:
    """Whether ``location`` names an object store (``s3://``), whose checkpoints use the
    blob commit protocol (``catalog.py``); anything else is a POSIX path, whose checkpoints
    keep the directory protocol (``versions.py``)."""
    return isinstance(location, str) and location.lower().startswith("s3://")


def blob_store_for(location: str | os.PathLike) -> BlobStore:
    """The store a location names: a path (absolute or relative) or ``file:///path`` gives
    the POSIX store of that directory; ``s3://bucket[/prefix]`` the S3 store (endpoint and
    credentials from the environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``...). Nothing is contacted here."""
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise ValueError(f"location must be a non-empty str: {LOCATION_FORMS}; got {location!r}")
    if "://" not in location:
        return PosixBlobStore(os.path.abspath(location), location=location)
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(
                f"location {location!r}: a file URL names a local absolute path, "
                "'file:///path' (three slashes)"
            )
        return PosixBlobStore(unquote(parts.path), location=location)
    if scheme == "s3":
        from fsdp_ext.checkpoint.blob_s3 import S3BlobStore  # boto3 only when used

        return S3BlobStore(parts.netloc, parts.path.strip("/"), location=location)
    raise ValueError(f"location {location!r}: unknown scheme {scheme!r}; use {LOCATION_FORMS}")
