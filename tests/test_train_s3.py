"""The main job with ``--out s3://...`` on the SeaweedFS fixture: two jobs on one location,
one trains; the owner killed, ``--resume`` continues by itself, bit for bit equal to a run
that was never interrupted (slow: each job is a real ``examples/train.py --nproc-per-node
2``); a bad ``--out`` is one line and exit 2 before training; the snapshot name of an ``s3://``
location is the same from any working directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.catalog import read_catalog
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.job.snapshot import job_name, snapshot_dir
from tests.test_train_job_life import TINY, TRAIN, same

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--steps", "400", "--ckpt-every", "1", "--keep", "2", "--lease", "4"]


def _job(out: str, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*TRAIN, *TINY.split(), "--out", out, *FLAGS, *args],
        env={**os.environ, **env, "PYTHONPATH": REPO},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launcher, torchrun and the workers: one group to kill
    )


def _contents(location: str, step: int) -> dict:
    """Every value step ``step`` holds, through our verified reader."""
    return _load_state_dict_from_keys(storage_reader=BlobStorageReader(location, step))


def _steps(location: str) -> list[int]:
    return sorted(read_catalog(blob_store_for(location))[0].steps)


@pytest.mark.slow  # four whole jobs: 229 s at load 9 on 2 cores; cheap siblings: the
# Checkpointer and owner tests of test_checkpoint_s3.py, and the bad --out test below
def test_two_jobs_one_trains_the_owner_killed_resumes_bit_for_bit(s3_env):
    env = s3_env.env()
    base = f"s3://{s3_env.bucket}/train-{uuid.uuid4().hex[:8]}"
    out, alone = f"{base}/run", f"{base}/alone"
    root = f"{out}/checkpoints"
    os.environ.update(env)  # this process reads the catalog too
    first = _job(out, env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not _steps(root):
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.2)
        assert _steps(root), "the first job published no checkpoint in time"
        # a second job on the same location: refused before its first step, owner named
        second = _job(out, env, "--seed", "1", "--resume")
        sout, serr = second.communicate(timeout=240)
        assert first.poll() is None, "the first job ended before the second was judged"
        assert second.returncode != 0 and "step " not in sout, serr[-3000:]
        (line,) = [x for x in serr.splitlines() if "error" in x]
        assert f"argument --out: {root}: owned by a live job" in line, serr
        assert "on host" in line and "pid" in line
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the owner dies, unannounced
        first.communicate()
    killed_at = _steps(root)[-1]
    assert killed_at < 400
    # --resume continues by itself: the dead owner's claim is taken over (3 steps here)
    resumed = _job(out, env, "--resume", "--stop-after", "3")
    rout, rerr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, rerr[-3000:]
    summary = json.loads(rout.strip().splitlines()[-1])
    end = killed_at + 3
    assert summary["steps"] == end
    # bit for bit what a run that was never interrupted saves at that step
    uninterrupted = _job(alone, env, "--stop-after", str(end), "--ckpt-every", str(end))
    aout, aerr = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, aerr[-3000:]
    assert _steps(root) == [end - 1, end] and _steps(f"{alone}/checkpoints") == [end]
    assert same(_contents(root, end), _contents(f"{alone}/checkpoints", end))
    assert json.loads(aout.strip().splitlines()[-1])["final_loss"] == summary["final_loss"]


def test_a_bad_s3_out_is_one_line_and_exit_2_before_training(s3_env, capsys, monkeypatch):
    from examples.config import parse_args

    for name, value in s3_env.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_env.bucket
    cases = {
        "does not exist": ({}, "s3://no-such-bucket-here/run"),
        "refused the credentials": ({"AWS_SECRET_ACCESS_KEY": "wrong"}, f"s3://{bucket}/run"),
        "cannot reach the S3 endpoint": (
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"},
            f"s3://{bucket}/run",
        ),
    }
    for cause, (env, out) in cases.items():
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            with pytest.raises(SystemExit) as exit_:
                parse_args([*TINY.split(), "--steps", "2", "--out", out], world_size=1)
        assert exit_.value.code == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
        assert f"argument --out: {out}/checkpoints: " in line and cause in line, line


@pytest.mark.slow  # two 2-rank jobs, 20-30 s; default sibling: the clean-snapshots test below
def test_snapshots_with_an_s3_out_on_two_ranks(s3_env):
    """train.py --out s3://... --snapshot-every 1 on 2 ranks: snapshots in the nodes' RAM
    beside the checkpoints in the bucket. The job killed -9 once a snapshot newer than the
    bucket's newest step exists, a second job on the same --out resumes from the in-memory
    snapshot (not the older step in the bucket), ends at its step and leaves nothing in
    /dev/shm."""
    out = f"s3://{s3_env.bucket}/snap-{uuid.uuid4().hex[:12]}"
    flags = ["--ckpt-every", "4", "--keep", "2", "--snapshot-every", "1", "--lease", "4"]
    env = {**s3_env.env(), "PYTHONPATH": REPO}
    snaps = snapshot_dir(job_name(f"{out}/checkpoints"))
    first = _job(out, env, *flags)  # --steps 400 (FLAGS), then --ckpt-every 4 wins
    try:
        deadline = time.monotonic() + 240
        # saves run in the background (the default), so the bucket's newest step and the
        # RAM's newest snapshot move on their own: killed once the bucket has a step and a
        # snapshot 2 or more steps newer is in RAM
        while first.poll() is None:
            assert time.monotonic() < deadline, "no snapshot newer than the bucket in time"
            names = [p.name[5:] for p in snaps.glob("step-*")]
            in_ram = max((int(n) for n in names if n.isdigit()), default=0)
            stored = _steps(f"{out}/checkpoints")
            if stored and in_ram >= stored[-1] + 2:
                break
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    stored = _steps(f"{out}/checkpoints")
    assert first.returncode != 0 and stored and stored[-1] < in_ram, (stored, in_ram)
    end = (in_ram // 4 + 2) * 4  # two more saves: the bucket ends with both
    done = subprocess.run(
        [*TRAIN, *TINY.split(), "--out", out, *FLAGS, *flags, "--steps", str(end)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    resumed = [ln for ln in text.splitlines() if ln.startswith("resumed from")]
    assert len(resumed) == 1 and "in-memory snapshot" in resumed[0], text[-3000:]
    assert int(resumed[0].split(" at step ")[1].split()[0]) >= in_ram, (resumed, in_ram)
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == end
    assert _steps(f"{out}/checkpoints") == [end - 4, end]
    assert not snaps.exists()


def test_clean_snapshots_judges_an_s3_owner(s3_env, tmp_path):
    """``python -m fsdp_ext.job clean-snapshots`` on a node: the snapshots of a job whose
    ``s3://`` location is owned by a live job stay; once it released it, they go."""
    from fsdp_ext.job.blob_ownership import claim_blob
    from fsdp_ext.job.snapshot import clean_snapshots

    location = f"s3://{s3_env.bucket}/clean-{uuid.uuid4().hex[:12]}"
    snaps = snapshot_dir(job_name(location), tmp_path)
    snaps.mkdir(parents=True)
    (snaps / "job.json").write_text(json.dumps({"checkpoint_root": location}))
    owner = claim_blob(blob_store_for(location), lease_s=4.0)
    try:
        assert [why for _p, why in clean_snapshots(tmp_path)] == [
            f"kept: the job owning {location} may be alive"
        ]
        assert snaps.exists()
    finally:
        owner.release()
    assert [why for _p, why in clean_snapshots(tmp_path)] == [
        f"removed (its job released {location})"
    ]
    assert not snaps.exists()


def test_an_s3_jobs_snapshot_name_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    """Every node of a job names its /dev/shm snapshots after ``--out``: an ``s3://``
    location names the same job from any working directory (made absolute, it would be
    ``CWD/s3:/bucket/run``, a name per cwd: a restarted rank would miss its snapshots); a
    relative path is made absolute, so it names the directory it means."""
    location = "s3://bucket/run/checkpoints"
    names, posix = set(), set()
    for cwd in ("a", "b"):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        names.add(job_name(location))
        posix.add(job_name("run/checkpoints"))
        assert job_name("run/checkpoints") == job_name(tmp_path / cwd / "run/checkpoints")
    assert len(names) == 1 and len(posix) == 2
    assert names != {job_name("s3://bucket/run/other")}
