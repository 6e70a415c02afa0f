"""Checkpoints on a real S3 server (SeaweedFS, the ``s3_server`` fixture; no mocks): the commit
protocol of ``catalog.py`` through DCP, kills at every request, bit flips, owners and fences.

Each promise is checked by its effect: loaded values equal the saved ones (a ranged read off
by one fails here); a save killed before any request leaves the old or the new checkpoint,
never a mix (the commit written before the data fails here); a stale writer's commit is
refused (an unconditional catalog write fails here); a live owner is not taken over (a
lease judged without the heartbeat's ETag fails here).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_ext.checkpoint import verify_checkpoint
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.blob_s3 import PART_BYTES_ENV
from fsdp_ext.checkpoint.blob_writer import BlobStorageWriter
from fsdp_ext.checkpoint.catalog import (
    CATALOG_KEY,
    BlobFence,
    commit,
    new_version_prefix,
    read_catalog,
    read_lease,
    remove_step,
    sweep,
)
from fsdp_ext.checkpoint.fence import DirectoryFencedError
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.lock import CheckpointPrunedError, LockOwner
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    CheckpointBusyError,
    CheckpointIntegrityError,
    UnsafeCheckpointError,
)
from fsdp_ext.checkpoint.planner import SpreadSavePlanner
from fsdp_ext.job import published_steps
from fsdp_ext.job.blob_ownership import beat_key, claim_blob, record_key
from fsdp_ext.job.blob_run import prune_steps
from fsdp_ext.job.ownership import DirectoryOwnedError
from fsdp_ext.testing import run_distributed
from tests.ckpt_programs import s3_kill_sweep
from tests.test_checkpoint_dcp import build_state, empty_like, full_state, mismatches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_SWEEP = os.path.join(REPO, "tests", "ckpt_programs", "s3_kill_sweep.py")


@pytest.fixture
def location(s3_env) -> str:
    return f"s3://{s3_env.bucket}/t-{uuid.uuid4().hex[:12]}"


def _save(location: str, step: int, state: dict, **kwargs) -> None:
    writer = BlobStorageWriter(location, step, min_file_bytes=0, **kwargs)
    dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner())


# ------------------------------------------------------------------ round trips through DCP


def _two_ranks(env: dict, location: str) -> dict:
    """World 2: save FSDP-sharded (step 1) and replicated (step 3); load step 1 back, and
    step 2 (saved by one process) resharded to FSDP: rank 1 reads it with ranged gets. Then
    a Checkpointer's saves (one in the background), prune and resume on both ranks."""
    os.environ.update(env)  # the forkserver's environment predates the fixture's
    tensors = full_state()
    _save(location, 1, build_state("fsdp", 2, tensors))
    _save(location, 3, build_state("replicated", 2, tensors))
    out = {}
    for step in (1, 2):
        target = empty_like(build_state("fsdp", 2, tensors))
        dcp.load(target, storage_reader=BlobStorageReader(location, step))
        out[step] = mismatches(target, tensors)
    # a Checkpointer on 2 ranks: rank 0 claims and commits, a background save, a resume
    from fsdp_ext.job import Checkpointer

    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ckpt = Checkpointer(f"{location}/run", model=model, keep=1)
    ckpt.save(1)
    with torch.no_grad():
        model.weight.fill_(2.0)
    ckpt.save(2, blocking=False)
    ckpt.close()
    fresh = torch.nn.Linear(4, 4)
    again = Checkpointer(f"{location}/run", model=fresh)
    out["resumed"] = (again.resume(), fresh.weight.sum().item())
    again.close()
    return out


def test_round_trip_on_two_ranks_resharded_and_spread(s3_env, location):
    tensors = full_state()
    _save(location, 2, build_state("replicated", 1, tensors))  # one process: world 1
    results = run_distributed(_two_ranks, 2, s3_env.env(), location, timeout=240)
    assert results == [{1: [], 2: [], "resumed": (2, 32.0)}] * 2
    assert published_steps(f"{location}/run") == [2]  # keep=1 pruned step 1
    # step 1 (saved by 2 ranks) loads in one process, into plain tensors
    target = empty_like(build_state("replicated", 1, tensors))
    dcp.load(target, storage_reader=BlobStorageReader(location, 1))
    assert mismatches(target, tensors) == []
    report = verify_checkpoint(location)
    assert report.ok, report.problems
    # spread writes: the replicated save's tensor bytes per rank (the objects it put)
    meta = BlobStorageReader(location, 3).read_metadata()
    per_rank: dict[int, int] = {}
    for index, info in meta.storage_data.items():
        md = meta.state_dict_metadata[index.fqn]
        if isinstance(md, TensorStorageMetadata):
            chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset))
            rank = int(info.relative_path.split("_")[2])
            per_rank[rank] = per_rank.get(rank, 0) + chunk.sizes.numel() * 4
    assert sum(per_rank.values()) == sum(v.numel() * 4 for v in tensors.values())
    assert max(per_rank.values()) / (sum(per_rank.values()) / 2) <= 1.10, per_rank


# ------------------------------------------------------------------ kill at every request


def _kill_sweep(location: str, env: dict, specs: list[str], in_process: bool) -> dict:
    """The sweep of tests/ckpt_programs/s3_kill_sweep.py: in a child process, or here (its
    kills happen in children it forks either way; here saves the child's imports)."""
    if in_process:
        return s3_kill_sweep.sweep(location, specs)
    proc = subprocess.run(
        [sys.executable, KILL_SWEEP, location, *specs],
        env={**os.environ, **env, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_sweep(found: dict) -> None:
    for op, res in found.items():
        at = res["catalog_at"]
        for k, outcome in res["results"].items():
            # before the commit request: the old checkpoint; from the request after: the new
            assert outcome == ("old" if int(k) <= at else "new"), (op, k, res)


def test_killed_at_the_commit_boundary_leaves_old_or_new_and_nothing_leaks(s3_env, location):
    specs = ["save=pivot", "overwrite=pivot", "prune=pivot"]
    found = _kill_sweep(location, s3_env.env(), specs, in_process=True)
    assert set(found) == {"save", "overwrite", "prune"}
    _check_sweep(found)
    # the commit is the last write of a save: data, .metadata and manifest come before it
    save = found["save"]["requests"]
    assert save[-1].startswith("replace_if catalog.json")
    assert save[-2].endswith(MANIFEST_NAME) and save[-3].endswith(METADATA_NAME)


@pytest.mark.slow
def test_killed_at_every_request_leaves_old_or_new_and_nothing_leaks(s3_env, location):
    specs = ["save=all", "overwrite=all", "prune=all"]
    found = _kill_sweep(location, s3_env.env(), specs, in_process=False)
    assert all(len(r["results"]) == len(r["requests"]) for r in found.values())
    _check_sweep(found)


# ------------------------------------------------------------------ bit flips


def _flip_and_check(store, key: str, bits: list[int]) -> list[str]:
    """Flip each bit of ``key`` in turn: verify must name the object, and a load must be
    refused; the original goes back after each. Returns the bits that passed unnoticed."""
    original = store.get(key)
    missed = []
    try:
        for bit in bits:
            data = bytearray(original)
            data[bit // 8] ^= 1 << (bit % 8)
            store.put(key, bytes(data))
            report = verify_checkpoint(store.location)
            named = any(key in p for p in report.problems)
            try:
                reader = BlobStorageReader(store.location)
                reader.read_metadata()
                loaded = True
            except (CheckpointIntegrityError, UnsafeCheckpointError):
                loaded = False
            if not named or loaded:
                missed.append(bit)
    finally:
        store.put(key, original)
    return missed


def _bits(key_size: int, every: str) -> list[int]:
    """ "bit": every bit; "byte": one bit of every byte (its position rotating); else 6."""
    n = key_size * 8
    if every == "bit":
        return list(range(n))
    if every == "byte":
        return [8 * i + i % 8 for i in range(key_size)]
    return sorted({0, 7, n // 3, n // 2 + 5, n - 9, n - 1})


@pytest.fixture
def no_pickle(monkeypatch):
    """Any plain unpickling (pickle.load / loads, torch.load without weights_only) fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle ran")

    real_load = torch.load

    def torch_load(*args, **kwargs):
        if not kwargs.get("weights_only", False):
            raise AssertionError("torch.load without weights_only")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", torch_load)


def _flip_cases(location: str, every: dict[str, str]) -> dict[str, list[int]]:
    _save(location, 1, build_state("replicated", 1, full_state()))
    store = blob_store_for(location)
    prefix = read_catalog(store)[0].steps[1]
    missed = {}
    names = {"catalog": CATALOG_KEY, "manifest": f"{prefix}/{MANIFEST_NAME}"}
    names["metadata"] = f"{prefix}/{METADATA_NAME}"
    for what, key in names.items():
        missed[key] = _flip_and_check(store, key, _bits(store.head(key).size, every.get(what, "")))
    return missed


def test_bit_flips_of_bookkeeping_objects_are_named_and_no_pickle_runs(location, no_pickle):
    missed = _flip_cases(location, every={})
    assert missed == {key: [] for key in missed}
    assert verify_checkpoint(location).ok


@pytest.mark.slow
def test_every_bit_flip_of_bookkeeping_objects_is_named(location, no_pickle):
    """Every bit of the catalog; one bit of every byte of the manifest and .metadata."""
    missed = _flip_cases(location, every={"catalog": "bit", "manifest": "byte", "metadata": "byte"})
    assert missed == {key: [] for key in missed}


def test_a_flipped_data_byte_fails_the_load_naming_the_file(location, capsys):
    from fsdp_ext.checkpoint.__main__ import main as cli

    _save(location, 1, build_state("replicated", 1, full_state()))
    assert cli(["verify", location]) == 0
    assert f"{location} -> step-1/v-0-" in capsys.readouterr().out
    store = blob_store_for(location)
    prefix = read_catalog(store)[0].steps[1]
    name = next(k for k in store.list(prefix + "/") if k.endswith(".distcp"))
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 0x10
    store.put(name, bytes(data))
    report = verify_checkpoint(location)
    assert any(name in p and "crc32" in p for p in report.problems), report.problems
    assert cli(["inspect", location]) == 1
    assert f"{location}/{name}: crc32 " in capsys.readouterr().out
    target = empty_like(build_state("replicated", 1, full_state()))
    with pytest.raises(BaseException, match=r"crc32|altered"):
        dcp.load(target, storage_reader=BlobStorageReader(location, 1))


def test_a_multipart_data_file_is_checked_by_its_crc_not_its_etag(location, monkeypatch):
    """A rank's file above the part size goes up as a multipart upload (an ETag "...-N",
    no MD5 of the bytes); its manifest CRC-32 is over the streamed bytes, verify and load
    pass, the catalog commits over it, and a flipped byte (re-uploaded multipart, so a new
    "-N" ETag) is caught by the CRC, not by any ETag."""
    monkeypatch.setenv("FSDP_EXT_S3_PART_BYTES", str(5 << 20))
    torch.manual_seed(0)
    state = {"big": torch.randn(11 << 18), "small": torch.arange(10.0)}  # 11.5 MB: 3 parts
    _save(location, 1, state)
    _save(location, 2, state)  # a second commit: the catalog's ETag comes from head
    store = blob_store_for(location)
    prefix = read_catalog(store)[0].steps[2]
    names = [k for k in store.list(prefix + "/") if k.endswith(".distcp")]
    name = max(names, key=lambda k: store.head(k).size)
    info = store.head(name)
    assert info.size > 2 * (5 << 20) and info.etag.endswith('-3"'), info
    assert verify_checkpoint(location).ok
    target = {"big": torch.zeros_like(state["big"]), "small": torch.zeros(10)}
    dcp.load(target, storage_reader=BlobStorageReader(location, 2))
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["small"], state["small"])
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 0x10
    store.put(name, iter([bytes(data)]))
    assert store.head(name).etag.endswith('-3"')
    report = verify_checkpoint(location)
    assert any(name in p and "crc32" in p for p in report.problems), report.problems
    with pytest.raises(BaseException, match=r"crc32|altered"):
        dcp.load(target, storage_reader=BlobStorageReader(location, 2))


# ------------------------------------------------------------------ owners, leases, fences


def _hold_in_child(location: str, lease: float) -> int:
    """Fork a child that claims ``location`` and keeps its lease alive until killed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            owner = claim_blob(blob_store_for(location), lease_s=lease)
            os.write(write, str(owner.owner.generation).encode())
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        assert pipe.read(1) == "1"
    return pid


def test_a_live_owner_is_not_taken_over_and_a_released_one_is(s3_env, location):
    lease = 2.0
    holder = _hold_in_child(location, lease)
    try:
        t0 = time.monotonic()
        # watched for longer than a lease: its heartbeat (a new ETag each beat) proves it alive
        with pytest.raises(DirectoryOwnedError, match=f"pid {holder}"):
            claim_blob(blob_store_for(location), lease_s=lease)
        assert time.monotonic() - t0 < 3 * lease
        time.sleep(lease)  # still alive a lease later: still refused
        with pytest.raises(DirectoryOwnedError):
            claim_blob(blob_store_for(location), lease_s=lease)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    # its process is gone (this machine): taken over at once, generation 2
    mine = claim_blob(blob_store_for(location), lease_s=lease)
    assert mine.owner.generation == 2
    mine.release()
    again = claim_blob(blob_store_for(location), lease_s=lease)  # released: at once
    assert again.owner.generation == 3
    again.release()


def test_an_owner_on_another_host_expires_by_the_claimants_clock(location):
    store = blob_store_for(location)
    lease = 1.0
    other = replace(
        LockOwner.here("owner-elsewhere", lease_s=lease, generation=1),
        host="another-host",
        boot_id="another-boot",
    )
    store.put_if_absent(record_key(1), other.encode().encode())
    store.put(beat_key(1), b"owner-elsewhere 7")
    commit(store, lambda c: replace(c, generation=1, owner=other.describe()), generation=1)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="lease expired"):
        mine = claim_blob(store, lease_s=lease)
    waited = time.monotonic() - t0
    assert mine.owner.generation == 2 and lease <= waited < 4 * lease
    assert store.head(record_key(1)) is None  # the dead generation's records went
    mine.release()


def test_a_stale_writer_is_fenced_even_when_the_takeover_races_its_commit(location):
    store = blob_store_for(location)
    state = build_state("replicated", 1, full_state())
    first = claim_blob(store, lease_s=1.0)
    _save(location, 1, state, fence=first.fence)
    first.stop_renewing()  # paused: no more heartbeats
    # the takeover lands between the stale writer's read of the catalog and its replace
    taken = []

    def stale_change(catalog):
        if not taken:
            taken.append(claim_blob(blob_store_for(location), lease_s=1.0))
        return replace(catalog, steps={**catalog.steps, 5: catalog.steps[1]})

    with pytest.raises(DirectoryFencedError, match="taken over"):
        commit(store, stale_change, generation=1)
    catalog, _ = read_catalog(store)
    assert catalog.generation == 2 and set(catalog.steps) == {1}
    # the new owner's save in flight survives a sweep by the stale job (it names it gen 2)
    in_flight = f"{new_version_prefix(7, 2, 'ab' * 8)}/__0_other.distcp"
    store.put(in_flight, b"new owner's bytes")
    assert sweep(store, catalog, generation=1) == [] and store.head(in_flight) is not None
    assert sweep(store, catalog, generation=2) == [in_flight]
    # a whole save of the stale job publishes nothing
    with pytest.raises(BaseException, match="taken over"):
        _save(location, 2, state, fence=BlobFence(store, 1))
    assert set(read_catalog(store)[0].steps) == {1}
    taken[0].release()


# ------------------------------------------------------------------ the Checkpointer


def test_checkpointer_on_s3_keeps_prunes_and_falls_back_to_the_newest_intact(location):
    from fsdp_ext.job import Checkpointer

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = {}
    ckpt = Checkpointer(location, model=model, optimizer=opt, keep=2)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        ckpt.save(step, blocking=step != 2)  # step 2 written in the background
    ckpt.close()
    assert published_steps(location) == [2, 3]
    store = blob_store_for(location)
    catalog = read_catalog(store)[0]
    live = set(catalog.steps.values())
    assert {k.rsplit("/", 1)[0] for k in store.list("step-")} == live  # nothing left over
    # the newest is corrupted: a resume warns and loads step 2
    name = next(k for k in store.list(catalog.steps[3] + "/") if k.endswith(".distcp"))
    data = bytearray(store.get(name))
    data[-20] ^= 1
    store.put(name, bytes(data))
    fresh = torch.nn.Linear(4, 3)
    again = Checkpointer(location, model=fresh, optimizer=torch.optim.SGD(fresh.parameters()))
    with pytest.warns(UserWarning, match="step 3 .* does not load"):
        assert again.resume() == 2
    assert torch.equal(fresh.weight, weights[2])
    again.close()


# ------------------------------------------------------------------ read leases


def _read_in_child(location: str, step: int) -> int:
    """A child process that holds a read lease on ``step`` (lease 60 s: a beat every 15 s)
    until killed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            with read_lease(blob_store_for(location), step, lease_s=60.0):
                os.write(write, b"held")
                time.sleep(120)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"held"
    os.close(read)
    return pid


def test_a_prune_refuses_a_step_a_live_reader_holds_naming_it_until_the_reader_dies(location):
    """As on POSIX: a live reader in another process keeps its step published and whole;
    removing it raises ``CheckpointBusyError`` naming the reader (pid, host) and the step's
    location, at once (a reader on this machine is judged by its pid, not by waiting for its
    next beat), and a Checkpointer's prune removes the others with one warning saying so. A
    reader in the pruning process itself is live too. Once the reader is killed, its lease
    is dead (its pid is gone) and the next prune removes the step; a reader on another host
    that stops beating expires after one lease by the pruner's own clock; a step pruned
    first cannot be leased."""
    state = {"w": torch.arange(6.0)}
    for step in (1, 2, 3, 4):
        _save(location, step, state)
    store = blob_store_for(location)
    where = store.where(read_catalog(store)[0].steps[1])
    pid = _read_in_child(location, 1)
    try:
        reader = rf"being read by save read-\w+ by pid {pid} on host {socket.gethostname()}"
        started = time.monotonic()
        with pytest.raises(CheckpointBusyError, match=rf"^{where} \(step 1\): {reader}"):
            remove_step(store, 1, generation=None)
        assert time.monotonic() - started < 5.0  # judged by its pid, not its next beat
        assert read_catalog(store)[0].steps.keys() == {1, 2, 3, 4}
        with pytest.warns(UserWarning, match=rf"prune: {where} \(step 1\): {reader}"):
            assert prune_steps(location, 2, None) == [2]
        assert read_catalog(store)[0].steps.keys() == {1, 3, 4}
        target = {"w": torch.zeros(6)}
        dcp.load(target, storage_reader=BlobStorageReader(location, 1))  # still whole
        assert torch.equal(target["w"], state["w"])
        mine = pytest.raises(CheckpointBusyError, match=f"pid {os.getpid()} ")
        with read_lease(store, 4), mine:  # this process's own reader, in this thread
            remove_step(store, 4, generation=None)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert store.list("readers/")  # the dead reader's lease is still there...
    assert remove_step(store, 1, generation=None)  # ...and judged dead at once
    assert store.list("readers/") == [] and sorted(read_catalog(store)[0].steps) == [3, 4]
    assert not remove_step(store, 1, generation=None)  # not published: nothing to do
    # a reader on another machine that stopped beating: expired after lease + one beat
    prefix = read_catalog(store)[0].steps[3]
    far = replace(LockOwner.here("read-far", lease_s=1.0), host="elsewhere", boot_id="b")
    store.put(f"readers/{prefix}/read-far", f"{far.encode()}\n0".encode())
    started = time.monotonic()
    assert remove_step(store, 3, generation=None)
    assert 1.0 <= time.monotonic() - started < 5.0
    assert store.list("readers/") == [] and store.list(prefix + "/") == []
    with pytest.raises(CheckpointPrunedError), read_lease(store, 3):
        pass
    # the race made deterministic: the prune lands between the reader's look at the catalog
    # and its lease; the reader looks again after its lease, and gives the step up
    racer = blob_store_for(location)

    class PruneFirst(type(racer)):
        def put_if_absent(self, key, data):
            if key.startswith("readers/"):
                assert remove_step(store, 4, generation=None)
            return super().put_if_absent(key, data)

    racer.__class__ = PruneFirst
    with pytest.raises(CheckpointPrunedError, match="pruned before"), read_lease(racer, 4):
        pass
    assert store.list("readers/") == []


def test_payloads_go_unsigned_with_a_signed_crc32_unless_the_profile_signs_them(
    s3_env, location, tmp_path, monkeypatch
):
    """Over plain HTTP botocore would hash every body with SHA-256 (0.18 s of a 63 MB save's
    0.48 s of client CPU here): our client sends ``UNSIGNED-PAYLOAD`` with the CRC32
    checksum header among the signed ones; a profile that sets ``payload_signing_enabled``
    has its way."""

    def sent(store) -> dict:
        seen = {}

        def keep(request, **_):
            seen.update({k.lower(): v for k, v in request.headers.items()})

        store._s3().meta.events.register("before-send.s3.PutObject", keep)
        store.put("x", b"payload")
        assert store.get("x") == b"payload"
        return seen

    headers = sent(blob_store_for(location))
    assert headers["x-amz-content-sha256"] == b"UNSIGNED-PAYLOAD"
    assert b"x-amz-checksum-crc32" in headers["authorization"]  # among the signed headers
    config = tmp_path / "config"
    config.write_text("[default]\ns3 =\n    payload_signing_enabled = true\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    headers = sent(blob_store_for(location))
    assert headers["x-amz-content-sha256"] == hashlib.sha256(b"payload").hexdigest().encode()


def test_a_rank_splits_its_share_into_parallel_files_only_where_each_fills_a_part(
    location, tmp_path, monkeypatch
):
    """16 MiB with ``thread_count=4``: one file on S3 with 64 MiB parts (four 4 MiB puts cost
    the shared server more than they gain), two with 5 MiB parts (two items: each its own
    stream), and two on a POSIX store, which has no least stream; every save loads equal."""
    state = {"w": torch.arange(2 << 20, dtype=torch.float32), "v": torch.ones(2 << 20)}

    def files(where: str) -> int:
        writer = BlobStorageWriter(where, 1, thread_count=4)
        dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner(), no_dist=True)
        target = {k: torch.zeros_like(t) for k, t in state.items()}
        dcp.load(target, storage_reader=BlobStorageReader(where, 1), no_dist=True)
        assert all(torch.equal(target[k], state[k]) for k in state)
        return len([k for k in blob_store_for(where).list("step-1/") if k.endswith(".distcp")])

    monkeypatch.setenv(PART_BYTES_ENV, str(64 << 20))
    assert files(f"{location}/big-parts") == 1
    monkeypatch.setenv(PART_BYTES_ENV, str(5 << 20))
    assert files(f"{location}/small-parts") == 2
    assert files(str(tmp_path / "posix")) == 2
