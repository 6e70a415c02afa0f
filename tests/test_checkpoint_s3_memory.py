"""Memory of a streamed S3 save, measured from outside: a process saves one large tensor to
the SeaweedFS fixture (tests/ckpt_programs/s3_save_memory.py) while this one reads its
``VmRSS`` before the save and its ``VmHWM`` after it from /proc (the method of
benchmarks/checkpoint_memory.py). The upload sends its parts from the tensor's own memory:
a writer that serializes an item whole before sending it fails here (its peak above the
state is the tensor's size), and so does one that copies each part into a buffer (a part
per stream above the state)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.checkpoint_memory import proc_status
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.blob_s3 import DEFAULT_PART_BYTES, PART_BYTES_ENV
from fsdp_ext.checkpoint.location import blob_store_for
from tests.ckpt_programs.s3_save_memory import tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(REPO, "tests", "ckpt_programs", "s3_save_memory.py")
MB = 1 << 20


def _expect(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline().strip()
    if not line.startswith(word):
        proc.kill()
        raise AssertionError(
            f"saver said {line!r}, expected {word!r}:\n{proc.stderr.read()[-3000:]}"
        )
    return line


def measure_save(location: str, nbytes: int, part_bytes: int, tree: str = REPO) -> dict:
    """Peak memory above the state of one save of ``nbytes`` by a fresh process (the
    source tree ``tree``), and its upload rate."""
    env = {**os.environ, "PYTHONPATH": tree, PART_BYTES_ENV: str(part_bytes)}
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, location, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _expect(proc, "ready")
        before = proc_status(proc.pid)["VmRSS"]
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seconds = float(_expect(proc, "done").split()[1])
        peak = proc_status(proc.pid)["VmHWM"]
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return {
        "state_mb": round(nbytes / MB, 1),
        "part_mb": round(part_bytes / MB, 1),
        "rss_before_mb": round(before / MB, 1),
        "vmhwm_mb": round(peak / MB, 1),
        "above_state_mb": round((peak - before) / MB, 1),
        "save_s": seconds,
        "mb_per_s": round(nbytes / MB / seconds, 1),
    }


def _check(location: str, nbytes: int, part_bytes: int) -> None:
    """The save is one multipart object of the expected parts, and loads equal."""
    store = blob_store_for(location)
    (name,) = [k for k in store.list("step-1/") if k.endswith(".distcp")]
    info = store.head(name)  # the tensor plus its archive's records, in whole parts
    assert nbytes < info.size < nbytes + 4096
    assert info.etag.strip('"').endswith(f"-{-(-info.size // part_bytes)}")
    out = {"w": torch.zeros(nbytes, dtype=torch.uint8)}
    dcp.load(out, storage_reader=BlobStorageReader(location, 1), no_dist=True)
    assert torch.equal(out["w"], tensor(nbytes))


def _holds_under_half_a_part(s3_env, nbytes: int, part: int) -> None:
    location = f"s3://{s3_env.bucket}/memory-{uuid.uuid4().hex[:8]}"
    row = measure_save(location, nbytes, part)
    print(row)
    assert row["above_state_mb"] < part / MB / 2, row
    _check(location, nbytes, part)


def test_a_streamed_save_sends_its_parts_from_the_tensors_memory(s3_env):
    """64 MiB in the default 8 MiB parts: the saver's peak above its state stays under half
    a part (botocore's 1 MiB reads for the checksum and its buffers; measured 1.2 MiB with
    5 MiB parts, where copying each part into a buffer measured 5.2 MiB and serializing the
    item whole, 84)."""
    _holds_under_half_a_part(s3_env, 64 * MB, DEFAULT_PART_BYTES)


@pytest.mark.slow  # 2 GiB through the server: 50-150 s at load 6-11 (the save 31-68 s of it)
def test_a_two_gib_save_sends_its_parts_from_the_tensors_memory(s3_env):
    """2 GiB in 64 MiB parts: under half a part above the state (copying each part measured
    64.2 MiB; serializing the item whole, 2242)."""
    _holds_under_half_a_part(s3_env, 2048 * MB, 64 * MB)
