"""The blob primitives, each against both stores: a POSIX directory and a real S3 server
(SeaweedFS, started once per session by the ``s3_server`` fixture; no mocks).

Each promise is checked by its effect: exact bytes for ranges at the start, middle and end
and of one byte (a range off by one fails here); a second creator refused, and of racing
processes exactly one wins (an unconditional put fails here); a stale ETag refused (a
``replace_if`` that ignores it fails here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import replace

import pytest

from fsdp_ext.checkpoint.blob import (
    BlobAccessError,
    BlobChangedError,
    BlobConditionError,
    BlobExistsError,
    BlobNotFoundError,
    etag_of,
)
from fsdp_ext.checkpoint.blob_posix import PosixBlobStore
from fsdp_ext.checkpoint.location import blob_store_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = bytes(range(256)) * 4  # 1024 bytes: a shifted range reads other bytes


@pytest.fixture(params=["posix", "s3"])
def store(request, tmp_path):
    if request.param == "posix":
        return blob_store_for(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_env")
    return blob_store_for(f"s3://{server.bucket}/test-{uuid.uuid4().hex[:12]}")


# ------------------------------------------------------------------ the primitives


def test_put_get_head_round_trip(store):
    assert store.head("a/b/obj") is None
    etag = store.put("a/b/obj", DATA)
    assert etag == etag_of(DATA)  # the MD5 in quotes, as S3 gives it, on both stores
    assert store.get("a/b/obj") == DATA
    assert store.head("a/b/obj") == (len(DATA), etag)
    # a put replaces the whole object
    etag2 = store.put("a/b/obj", b"short")
    assert etag2 != etag and store.get("a/b/obj") == b"short"
    assert store.head("a/b/obj") == (5, etag2)
    # an empty object is an object
    store.put("empty", b"")
    assert store.get("empty") == b"" and store.head("empty") == (0, etag_of(b""))
    assert store.get("empty", 0, 1) == b""


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (0, 1),  # the first byte
        (0, 10),  # the start
        (500, 517),  # the middle
        (511, 512),  # one byte in the middle
        (1013, 1024),  # the end
        (1023, 1024),  # the last byte
        (None, 5),
        (1000, None),
        (7, 7),  # an empty range
        (1020, 2000),  # past the end: cut there
        (1024, 1030),  # starting at the end: nothing
    ],
)
def test_ranged_get_gives_exactly_those_bytes(store, start, end):
    store.put("ranged", DATA)
    got = store.get("ranged", start, end)
    assert got == DATA[start:end], (start, end, got[:8], DATA[start:end][:8])


def test_get_of_a_missing_object_and_bad_ranges(store):
    with pytest.raises(BlobNotFoundError, match="missing"):
        store.get("missing")
    with pytest.raises(BlobNotFoundError):
        store.get("missing", 3, 3)
    store.put("x", b"abc")
    with pytest.raises(ValueError, match="end is exclusive"):
        store.get("x", 2, 1)
    with pytest.raises(ValueError, match="start must be >= 0"):
        store.get("x", -1, 2)


def test_put_if_absent_refuses_a_second_writer(store):
    etag = store.put_if_absent("owner/gen-1", b"first")
    assert etag == etag_of(b"first")
    with pytest.raises(BlobExistsError, match="already exists") as refused:
        store.put_if_absent("owner/gen-1", b"second")
    assert isinstance(refused.value, BlobConditionError)
    assert store.location in str(refused.value)
    assert store.get("owner/gen-1") == b"first"
    assert store.head("owner/gen-1").etag == etag


def test_replace_if_needs_the_current_etag(store):
    first = store.put("beat", b"beat 1")
    second = store.replace_if("beat", b"beat 2", first)
    assert second == etag_of(b"beat 2") and store.get("beat") == b"beat 2"
    with pytest.raises(BlobChangedError) as stale:
        store.replace_if("beat", b"beat 3 from a stale writer", first)
    assert isinstance(stale.value, BlobConditionError)
    assert store.get("beat") == b"beat 2"
    # the ETag head gives is the one to use
    third = store.replace_if("beat", b"beat 3", store.head("beat").etag)
    assert store.get("beat") == b"beat 3" and store.head("beat").etag == third
    # a deleted object has no current ETag
    store.delete("beat")
    with pytest.raises(BlobChangedError):
        store.replace_if("beat", b"beat 4", third)
    assert store.head("beat") is None


PART = 5 << 20  # S3's smallest part size (SeaweedFS too refuses smaller ones: EntityTooSmall)


def _chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield memoryview(data)[i : i + size]


@pytest.mark.parametrize("length", [0, PART - 1, 2 * PART + 7])
def test_a_streamed_put_is_one_whole_object(store, length):
    """A stream of uneven chunks lands byte for byte, under the ETag head gives; on S3, past
    one part it is a multipart upload, whose ETag ("md5-of-md5s-N") is no MD5 of the bytes
    and still works in replace_if."""
    if hasattr(store, "part_bytes"):
        store.part_bytes = PART
    data = os.urandom(length)
    etag = store.put("big/file", _chunks(data, (1 << 20) + 13))
    assert store.get("big/file") == data
    assert store.head("big/file") == (length, etag)
    assert store.get("big/file", PART - 3, PART + 3) == data[PART - 3 : PART + 3]
    if hasattr(store, "part_bytes") and length > PART:
        assert etag.endswith('-3"') and etag != etag_of(data)  # 3 parts: multipart it was
    with pytest.raises(BlobChangedError):
        store.replace_if("big/file", b"x", etag_of(data) + "stale")
    store.replace_if("big/file", b"small now", etag)
    assert store.get("big/file") == b"small now"


def test_a_failed_stream_leaves_nothing_visible_or_pending(store, request):
    """A stream that fails after two parts: the old object stays whole, and on S3 the
    multipart upload is aborted (no upload listed under the prefix)."""
    if hasattr(store, "part_bytes"):
        store.part_bytes = PART
    store.put("f", b"old")

    def failing():
        yield bytes(2 * PART + 1)
        raise RuntimeError("the stream broke")

    with pytest.raises(RuntimeError, match="the stream broke"):
        store.put("f", failing())
    assert store.get("f") == b"old" and store.list("") == ["f"]
    if hasattr(store, "part_bytes"):
        client = request.getfixturevalue("s3_env").client()
        uploads = client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
        assert uploads.get("Uploads", []) == []
    else:
        assert [n for n in os.listdir(store.root) if n != "f"] == []  # no temp file left


def test_s3_a_killed_writers_upload_is_swept(s3_env):
    """An upload its writer never finished or aborted (killed) is found by abort_uploads,
    by prefix and predicate, and aborted; what it names stays invisible throughout."""
    store = blob_store_for(f"s3://{s3_env.bucket}/sweep-{uuid.uuid4().hex[:12]}")
    client = s3_env.client()
    for key in ("step-1/v-1-a/__0_0.distcp", "step-1/v-1-b/__0_0.distcp"):
        upload = client.create_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}/{key}")
        client.upload_part(
            Bucket=store.bucket,
            Key=f"{store.prefix}/{key}",
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=b"x" * PART,
        )
    assert store.list("") == []
    assert store.abort_uploads("step-", lambda key: "/v-1-a/" in key) == 1
    left = client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
    assert [u["Key"].split("/")[2] for u in left.get("Uploads", [])] == ["v-1-b"]
    assert store.abort_uploads("step-") == 1
    left = client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
    assert left.get("Uploads", []) == []


class _OpaqueEtags(PosixBlobStore):
    """The POSIX store with ETags that are no MD5 of the bytes, as SSE-KMS or another S3
    server gives them: what the protocol above must live with."""

    def _out(self, etag: str) -> str:
        return f'"kms-{etag.strip(chr(34))}"'

    def put(self, key, data):
        return self._out(super().put(key, data))

    def put_if_absent(self, key, data):
        return self._out(super().put_if_absent(key, data))

    def replace_if(self, key, data, etag):
        return self._out(super().replace_if(key, data, '"' + etag.strip('"')[4:] + '"'))

    def head(self, key):
        info = super().head(key)
        return None if info is None else info._replace(etag=self._out(info.etag))


def test_commits_and_owner_leases_take_etags_as_opaque(tmp_path):
    """The catalog's commits and the owner lease only compare ETags: with ETags that are no
    MD5 of the bytes, commits follow one another and a lease is claimed, beaten, released."""
    from fsdp_ext.checkpoint.catalog import commit, read_catalog
    from fsdp_ext.job.blob_ownership import claim_blob

    store = _OpaqueEtags(str(tmp_path / "opaque"))
    for step in (1, 2, 3):
        prefix = f"step-{step}/v-0-0123abcd"
        commit(
            store, lambda c, s=step, p=prefix: replace(c, steps={**c.steps, s: p}), generation=None
        )
    catalog, etag = read_catalog(store)
    assert sorted(catalog.steps) == [1, 2, 3] and etag.startswith('"kms-')
    claim_blob(store, lease_s=5.0).release()
    again = claim_blob(store, lease_s=5.0)  # the released lease is seen as given up
    assert again.owner.generation == 2
    again.release()


def test_list_by_prefix(store):
    keys = ["a/1", "a/2", "a/b/3", "ab/4", "b", "step-1/x", "step-10/y"]
    for key in reversed(keys):
        store.put(key, key.encode())
    assert store.list() == keys
    assert store.list("") == keys
    assert store.list("a/") == ["a/1", "a/2", "a/b/3"]
    assert store.list("a") == ["a/1", "a/2", "a/b/3", "ab/4"]  # a string prefix, as on S3
    assert store.list("a/b") == ["a/b/3"]
    assert store.list("step-1") == ["step-1/x", "step-10/y"]
    assert store.list("step-1/") == ["step-1/x"]
    assert store.list("nothing") == [] and store.list("nothing/") == []


def test_delete(store):
    store.put("d/one", b"1")
    store.put("d/two", b"2")
    store.delete("d/one")
    assert store.head("d/one") is None
    with pytest.raises(BlobNotFoundError):
        store.get("d/one")
    assert store.list("d/") == ["d/two"]
    store.delete("d/one")  # a missing object is no error (S3 cannot tell either)
    store.delete("never/was")
    store.delete("d/two")
    assert store.list("d") == []
    store.put("d/again", b"3")  # its emptied directory went, and comes back
    assert store.get("d/again") == b"3"


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", "a/./b", "a/../b", ".blob-lock-x"])
def test_bad_keys_are_refused_alike(store, key):
    with pytest.raises(ValueError, match="key"):
        store.put(key, b"x")


# ------------------------------------------------------------------ racing processes

_RACER = textwrap.dedent(
    """
    import importlib, json, os, sys, types
    # the store's own module alone, without the packages' __init__ and the location
    # resolver (both import torch): a racer is ready in a fraction of a second
    repo, store_json, key, me, etag = sys.argv[1:6]
    for name in ("fsdp_ext", "fsdp_ext.checkpoint"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(repo, *name.split("."))]
        sys.modules[name] = package
    from fsdp_ext.checkpoint.blob import BlobConditionError
    spec = json.loads(store_json)
    module, cls = spec["class"].rsplit(".", 1)
    store = getattr(importlib.import_module(module), cls)(*spec["args"], location=spec["location"])
    store.head("warm-up")  # the client made and the bucket checked before the start
    print("ready", flush=True)
    sys.stdin.readline()  # blocks until the parent starts every racer at once
    try:
        if etag == "-":
            store.put_if_absent(key, me.encode())
        else:
            store.replace_if(key, me.encode(), etag)
        print("won")
    except BlobConditionError:
        print("lost")
    """
)
WRITERS = 3


def _store_spec(store) -> str:
    """How a racer builds the same store as ``store`` without the location resolver."""
    args = [store.root] if isinstance(store, PosixBlobStore) else [store.bucket, store.prefix]
    cls = f"{type(store).__module__}.{type(store).__name__}"
    return json.dumps({"class": cls, "args": args, "location": store.location})


def _race(store, key: str, etag: str = "-") -> list[str]:
    """``WRITERS`` processes, each ready (imported, connected), then started at once: each
    blocks on a line of its stdin, and the parent writes all the lines back to back."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, REPO, _store_spec(store), key, f"writer {i}", etag],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(WRITERS)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            results.append(out.strip())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return results


def test_racing_creators_exactly_one_wins(store):
    results = _race(store, "race/owner")
    assert sorted(results) == ["lost"] * (WRITERS - 1) + ["won"], results
    winner = results.index("won")
    assert store.get("race/owner") == f"writer {winner}".encode()


def test_racing_conditional_replacers_exactly_one_wins(store):
    etag = store.put("race/beat", b"beat 0")
    results = _race(store, "race/beat", etag=etag)
    assert sorted(results) == ["lost"] * (WRITERS - 1) + ["won"], results
    assert store.get("race/beat") == f"writer {results.index('won')}".encode()


# ------------------------------------------------------------------ locations


def test_blob_store_for_resolves_each_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for location, root in [
        (str(tmp_path / "p"), str(tmp_path / "p")),
        ("rel/run", str(tmp_path / "rel/run")),
        (f"file://{tmp_path}/q", str(tmp_path / "q")),
        (tmp_path / "pathlike", str(tmp_path / "pathlike")),
    ]:
        store = blob_store_for(location)
        assert isinstance(store, PosixBlobStore) and store.root == root, location
    s3 = blob_store_for("s3://my-bucket/runs/a/")
    assert (s3.bucket, s3.prefix) == ("my-bucket", "runs/a")
    assert blob_store_for("s3://my-bucket").prefix == ""
    for bad, why in [
        ("", "non-empty"),
        ("gs://b/x", "unknown scheme 'gs'"),
        ("file://host/x", "three slashes"),
        ("s3://B/x", "not a valid S3 bucket name"),
        ("s3:///x", "not a valid S3 bucket name"),
        ("s3://my-bucket/a//b", "prefix"),
    ]:
        with pytest.raises(ValueError, match=why):
            blob_store_for(bad)


def test_a_posix_key_cannot_be_both_object_and_prefix(tmp_path):
    store = blob_store_for(str(tmp_path))
    store.put("a/b", b"x")
    with pytest.raises(Exception, match="both an object and a prefix"):
        store.put("a", b"y")
    with pytest.raises(Exception, match="both an object and a prefix"):
        store.put("a/b/c", b"y")


def test_a_dead_holders_lock_is_broken_and_temp_files_stay_hidden(tmp_path):
    store = blob_store_for(str(tmp_path))
    store.put("k", b"1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    from fsdp_ext.checkpoint.blob_posix import _holder_record

    record = json.loads(_holder_record())
    record.update(pid=int(dead.stdout), start="1")
    (tmp_path / ".blob-lock-k").write_text(json.dumps(record))
    (tmp_path / ".blob-tmp-leftover").write_bytes(b"killed writer")
    started = time.monotonic()
    store.replace_if("k", b"2", etag_of(b"1"))
    assert time.monotonic() - started < 5 and store.get("k") == b"2"
    assert store.list() == ["k"]


def test_a_live_lock_from_elsewhere_is_waited_for_then_named(tmp_path):
    store = PosixBlobStore(str(tmp_path), lock_wait_s=0.3)
    store.put("k", b"1")
    holder = {"host": "another-host", "boot_id": "x", "pid": 1, "start": "1"}
    (tmp_path / ".blob-lock-k").write_text(json.dumps(holder))
    with pytest.raises(Exception, match=r"another-host.*remove the lock file"):
        store.put("k", b"2")
    assert store.get("k") == b"1"


# ------------------------------------------------------------------ S3: a store that cannot be used


def test_s3_missing_bucket_is_one_clear_error(s3_env):
    store = blob_store_for("s3://no-such-bucket-here/run")
    with pytest.raises(BlobAccessError) as error:
        store.head("x")
    text = str(error.value)
    assert "s3://no-such-bucket-here/run" in text
    assert "bucket 'no-such-bucket-here' does not exist" in text and s3_env.endpoint in text


def test_s3_wrong_credentials_are_one_clear_error(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = blob_store_for(f"s3://{s3_env.bucket}/run")
    with pytest.raises(BlobAccessError) as error:
        store.put("x", b"1")
    text = str(error.value)
    assert f"s3://{s3_env.bucket}/run" in text and "refused the credentials" in text
    assert "AWS_ACCESS_KEY_ID" in text


def test_s3_unreachable_endpoint_is_one_clear_error(s3_env, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = blob_store_for(f"s3://{s3_env.bucket}/run")
    with pytest.raises(BlobAccessError) as error:
        store.list()
    text = str(error.value)
    assert f"s3://{s3_env.bucket}/run" in text and "cannot reach the S3 endpoint" in text
    assert f"127.0.0.1:{port}" in text and "AWS_ENDPOINT_URL" in text


def test_s3_store_pickles_without_its_client(s3_env):
    import pickle

    store = blob_store_for(f"s3://{s3_env.bucket}/pickled-{uuid.uuid4().hex[:6]}")
    store.put("k", b"v")
    again = pickle.loads(pickle.dumps(store))
    assert again.get("k") == b"v"


def test_only_location_py_constructs_a_store():
    """One function resolves locations: no other library module builds a store by name."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted((Path(REPO) / "fsdp_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name in ("PosixBlobStore", "S3BlobStore"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found and all(f.startswith("fsdp_ext/checkpoint/location.py:") for f in found), found
