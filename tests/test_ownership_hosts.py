"""One writer per output directory across real hosts: a paused owner fenced, clocks that
disagree, hosts that share a name or a boot id, and heartbeats that must be seen to move.

A second host is a UTS + mount namespace with its own host name, /etc/hosts entry and boot id
(tests/host_helpers.py); a pause is SIGSTOP of every process in it, a power loss SIGKILL.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_ext.checkpoint import LocalStorage, checkpoint_steps
from fsdp_ext.checkpoint.fence import OWNER_DIR, DirectoryFencedError, generations, record_name
from fsdp_ext.checkpoint.lock import RELEASED, LockOwner, read_beat
from fsdp_ext.checkpoint.manifest import MANIFEST_NAME
from fsdp_ext.job.ownership import claim
from tests.host_helpers import power_off, signal_host, start_on_host
from tests.test_train_job_life import TINY, contents, same
from tests.train_flags import train_in_ranks
from tests.warm_helpers import forked_warm

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "ckpt_programs"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TRAIN_SCRIPT = [str(REPO / "examples" / "train.py"), *TINY.split()]
TRAIN = [sys.executable, *TRAIN_SCRIPT]  # forked warm in this module (the fixture below)
CLAIM_OUT = [sys.executable, str(PROGRAMS / "claim_out.py")]
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True, scope="module")
def _programs_forked_warm(warm_server_socket):
    """TRAIN and CLAIM_OUT start through the session's warm server: each is a fork that joins
    its host's network, mount and UTS namespaces (fsdp_ext/warm), so it holds --out under
    that host's name and boot id, and a host paused or powered off takes it along. Who owns
    --out is the subject here, and the programs' imports were most of the module's CPU.
    Fresh interpreters where that matters: a clock skewed by libfaketime (LD_PRELOAD loads
    only into a new process), and the launcher-record test (it needs the program's pid)."""
    with forked_warm(warm_server_socket, TRAIN, CLAIM_OUT):
        yield


def _lines_until(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if needle in line:
            return seen
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {needle!r} within {timeout} s")


def _manifests(root: Path) -> dict[int, dict]:
    return {
        step: json.loads((path / MANIFEST_NAME).read_text())
        for step, path in checkpoint_steps(root)
    }


def _frozen_while_another_takes_over(tmp_path, a, out, lease, argv_b, **popen) -> dict:
    """SIGSTOP host-a's processes; start ``argv_b`` on host-b and wait until it owns --out
    and 3 leases have passed; SIGCONT; both jobs' outcomes and what was published before."""
    b = None
    try:
        signal_host(a, signal.SIGSTOP)
        stopped = time.monotonic()
        before = {s: m["save_id"] for s, m in _manifests(out / "checkpoints").items()}
        b = start_on_host(tmp_path, "host-b", argv_b, **popen)
        fs = LocalStorage()
        while generations(fs, out / "checkpoints") != [2] or time.monotonic() - stopped < 3 * lease:
            # B may finish its run inside the 3 leases on a fast machine; it must have
            # taken --out over (generation 2) and ended well
            if b.poll() is not None:
                assert b.returncode == 0, b.stderr.read()[-3000:]
                assert generations(fs, out / "checkpoints") == [2]
            time.sleep(0.1)
        taken_s = time.monotonic() - stopped
        signal_host(a, signal.SIGCONT)
        thawed = time.monotonic()
        _a_out, a_err = a.communicate(timeout=120)
        a_ran_s = time.monotonic() - thawed
        _b_out, b_err = b.communicate(timeout=300)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                power_off(proc)
    assert b.returncode == 0, b_err[-3000:]
    assert a.returncode == 3, (a.returncode, a_err[-3000:])
    return {"before": before, "a_err": a_err, "taken_s": taken_s, "a_ran_s": a_ran_s}


# ----------------------------------------------------------------------- a paused owner


def test_a_paused_owner_is_fenced_and_the_claimant_keeps_its_own_chain(tmp_path):
    """Job A (host-a, --lease 2) is frozen for over 3 leases; job B (host-b) takes --out
    over and trains; A, thawed, exits 3 at its next save, having written nothing; every
    checkpoint left is, value for value, the uninterrupted run's."""
    out, lease = tmp_path / "run", 2.0
    flags = ["--steps", "40", "--ckpt-every", "2", "--keep", "100", "--lease", str(lease)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": ENV}
    a = start_on_host(tmp_path, "host-a", [*TRAIN, *flags, "--out", str(out)], **pipes)
    try:
        _lines_until(a, "step     4 ")
        while len(checkpoint_steps(out / "checkpoints")) < 2:
            time.sleep(0.05)
    except BaseException:
        power_off(a)
        raise
    seen = _frozen_while_another_takes_over(
        tmp_path, a, out, lease, [*TRAIN, *flags, "--out", str(out)], **pipes
    )
    before, a_err = seen["before"], seen["a_err"]
    taken_s, a_ran_s = seen["taken_s"], seen["a_ran_s"]
    (line,) = [x for x in a_err.splitlines() if "error" in x]
    assert "argument --out:" in line and "taken over by job" in line and "host-b" in line, line
    assert "this job writes nothing more there" in line
    after = _manifests(out / "checkpoints")
    assert list(after) == list(range(2, 41, 2))
    # nothing A had published was replaced, and nothing replaced anything: one writer
    assert all(after[s]["save_id"] == sid for s, sid in before.items())
    assert all(m["replaces"] is None for m in after.values())
    # every checkpoint equals the one an uninterrupted run saves at that step
    alone = tmp_path / "alone"
    train_in_ranks([*TINY.split(), *flags, "--out", str(alone)], 1)
    for step in (2, max(before), max(before) + 2, 40):
        name = f"step-{step:07d}"
        got, want = contents(out / "checkpoints" / name), contents(alone / "checkpoints" / name)
        assert same(got, want), step
    # nothing of A is left: only B's generation, released
    owners = sorted(os.listdir(out / "checkpoints" / OWNER_DIR))
    assert [n for n in owners if not n.startswith(record_name(2))] == [], owners
    print(
        json.dumps(
            {
                "lease_s": lease,
                "taken_over_after_stop_s": round(taken_s, 2),
                "fenced_job_ran_after_sigcont_s": round(a_ran_s, 2),
                "checkpoints_before_pause": sorted(before),
            }
        )
    )


# ----------------------------------------------------------------------- clock skew


def _claimant(env: dict, root: Path, lease: float) -> subprocess.Popen:
    program = [sys.executable, CLAIM_OUT[-1]] if "LD_PRELOAD" in env else CLAIM_OUT
    return subprocess.Popen(
        [*program, str(root), str(lease), "try"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ask(proc: subprocess.Popen) -> dict:
    proc.stdin.write("claim\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return json.loads(line)


@pytest.fixture
def faketime_leaves_nothing():
    """libfaketime leaves a shared-memory segment and a semaphore per process in /dev/shm
    (``faketime_shm_<pid>``, ``sem.faketime_sem_<pid>``); remove the ones this test made."""
    before = set(os.listdir("/dev/shm"))
    yield
    for name in set(os.listdir("/dev/shm")) - before:
        if "faketime" in name:
            Path("/dev/shm", name).unlink(missing_ok=True)


def _skewed(seconds: int) -> dict:
    if not seconds:
        return dict(ENV)
    # the wall clock only: a faked monotonic clock makes Python's Event.wait hang
    return {
        **ENV,
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": f"{seconds:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.mark.parametrize(
    "owner_skew, claimant_skew",
    [
        (-120, 0),
        pytest.param(120, 0, marks=pytest.mark.slow),
        pytest.param(0, -120, marks=pytest.mark.slow),
        pytest.param(0, 120, marks=pytest.mark.slow),
    ],
)
def test_clock_skew_neither_breaks_a_live_owner_nor_keeps_a_dead_one(
    tmp_path, owner_skew, claimant_skew, faketime_leaves_nothing
):
    if not FAKETIME.exists():
        pytest.skip("needs Debian's faketime (scripts/lab-packages.sh installs it)")
    root, lease = tmp_path / "out", 2.0
    owner = start_on_host(
        tmp_path,
        "skewed-owner",
        [sys.executable, str(PROGRAMS / "claim_out.py"), str(root), str(lease), "hold"],
        env=_skewed(owner_skew),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    claimant = _claimant(_skewed(claimant_skew), root, lease)
    try:
        held = json.loads(owner.stdout.readline() or "{}")
        assert held.get("owned") == 1, owner.stderr.read()[-3000:]
        if owner_skew:  # the skew is real: its clock is off by the skew
            assert abs(held["wall"] - time.time() - owner_skew) < 30
        live = _ask(claimant)
        assert "refused" in live and "on host skewed-owner" in live["refused"], live
        assert "last seen change" in live["refused"] and " -" not in live["refused"]
        assert live["s"] < lease, live  # refused as soon as a heartbeat was seen to move
        power_off(owner)
        dead = _ask(claimant)
    finally:
        claimant.kill()
        if owner.poll() is None:
            power_off(owner)
    assert dead.get("took") == 2, dead
    # taken over a whole lease after this claimant began watching, and within one heartbeat
    # interval (lease / 4) and a little more: neither clock entered the judgement
    assert lease <= dead["s"] <= lease + lease / 4 + 1.5, dead
    print(json.dumps({"owner_skew": owner_skew, "claimant_skew": claimant_skew, **dead}))


# ----------------------------------------------------------------------- which machine


@pytest.mark.parametrize(
    "name, own_boot",
    [
        pytest.param("container-b", False, marks=pytest.mark.slow),  # a container's name
        (socket.gethostname(), True),  # this host's name after a reboot: another boot id
    ],
)
def test_a_holder_is_on_this_machine_only_with_its_name_and_boot_id(tmp_path, name, own_boot):
    """The pid shortcut needs the same host name and boot id; otherwise a dead holder is
    taken over only after a whole lease without a heartbeat change."""
    root, lease = tmp_path / "out", 2.0
    owner = start_on_host(
        tmp_path,
        name,
        [*CLAIM_OUT, str(root), str(lease), "hold"],
        env=ENV,
        own_boot=own_boot,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    claimant = _claimant(ENV, root, lease)
    try:
        assert json.loads(owner.stdout.readline() or "{}").get("owned") == 1
        power_off(owner)  # its pid is gone from this machine's view
        took = _ask(claimant)
    finally:
        claimant.kill()
    assert took.get("took") == 2, took
    assert took["s"] >= lease, took  # not at once: its pid proves nothing here


# ----------------------------------------------------------------------- heartbeats


def test_the_heartbeat_moves_several_times_a_lease_and_stops_when_lost(tmp_path):
    fs, root, lease = LocalStorage(), tmp_path / "out", 2.0
    mine = claim(root, lease_s=lease)
    record = root / OWNER_DIR / record_name(1)
    beats, t0 = set(), time.monotonic()
    while time.monotonic() - t0 < lease:
        beats.add(read_beat(fs, record, mine.owner))
        time.sleep(0.02)
    assert len(beats - {""}) >= 3, beats  # seen to change at least three times per lease
    # another job takes the next generation (as a claimant does once this one is gone)
    other = LockOwner.here("owner-other", lease_s=lease, generation=2)
    fs.symlink(other.encode(), root / OWNER_DIR / record_name(2))
    deadline = time.monotonic() + 5 * lease
    last = read_beat(fs, record, mine.owner)
    while time.monotonic() < deadline:
        time.sleep(lease / 2)
        now = read_beat(fs, record, mine.owner)
        if now == last:
            break
        last = now
    else:
        pytest.fail("the heartbeat went on renewing a lease another job had taken")
    with pytest.raises(DirectoryFencedError, match="taken over by job other"):
        mine.fence.check()
    mine.release()  # a fenced job does not mark the directory released
    assert read_beat(fs, record, mine.owner) != RELEASED


def test_a_worker_that_joined_its_launchers_record_leaves_it_on_close(tmp_path, monkeypatch):
    root = tmp_path / "out"
    env = {**ENV, "FSDP_EXT_RUN_ID": "run-7"}
    launcher = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "claim_out.py"), str(root), "60", "hold"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(launcher.stdout.readline()).get("owned") == 1
        monkeypatch.setenv("FSDP_EXT_RUN_ID", "run-7")
        worker = claim(root)
        assert worker.joined and worker.owner.pid == launcher.pid
        worker.release()
        monkeypatch.delenv("FSDP_EXT_RUN_ID")
        fs = LocalStorage()
        record = root / OWNER_DIR / record_name(1)
        assert read_beat(fs, record, worker.owner) != RELEASED
        from fsdp_ext.job import DirectoryOwnedError

        with pytest.raises(DirectoryOwnedError, match=f"pid {launcher.pid}"):
            claim(root)  # still the launcher's
    finally:
        launcher.kill()
        launcher.wait(30)


# ----------------------------------------------------------------------- bad input


def test_a_lease_that_cannot_work_is_refused_in_one_line(tmp_path):
    """End to end once (the launcher's exit status and stderr), then each kind of bad value
    through the same check in process: none creates the output directory."""
    proc = subprocess.run(
        [*TRAIN, "--nproc-per-node", "1", "--out", str(tmp_path / "r"), "--lease", "nan"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "argument --lease: must be a finite number of seconds >= 1" in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("lease", ["inf", "0.5", "-1"])
def test_each_kind_of_unworkable_lease_is_refused_before_any_worker(tmp_path, lease, capsys):
    from examples.config import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--nproc-per-node", "1", "--out", str(tmp_path / "r"), "--lease", lease])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "argument --lease: must be a finite number of seconds >= 1" in err, err
    assert not (tmp_path / "r").exists()


def test_an_out_that_is_a_file_or_read_only_is_refused_before_workers_start(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    file = tmp_path / "file"
    file.write_text("mine")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        for out, needle in ((file, "is a file, not a directory"), (ro / "run", "read-only")):
            proc = subprocess.run(
                [*TRAIN, "--nproc-per-node", "2", "--out", str(out)],
                env=ENV,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 2, proc.stderr[-2000:]
            (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
            assert "argument --out:" in line and needle in line, line
            assert "torchrun" not in proc.stderr and "Traceback" not in proc.stderr
        assert file.read_text() == "mine" and os.listdir(ro) == []
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    shutil.rmtree(ro)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    flags = ["--steps", "4", "--ckpt-every", "2", "--keep", "1"]
    step2 = probe_step2(tmp_path)  # the uninterrupted run's step 2, and a checkpoint's size
    one = sum(f.stat().st_size for f in step2.iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    size = int(one * 1.6) + (64 << 10)  # one checkpoint and the run record fit, two do not
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    try:
        proc = subprocess.run(
            [*TRAIN, *flags, "--out", str(disk / "run")],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        root = disk / "run" / "checkpoints"
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
        assert "no space left on the device" in line and "bytes are free now" in line, line
        assert [s for s, _ in checkpoint_steps(root)] == [2]  # the previous one, whole
        kept = tmp_path / "kept" / "step-0000002"
        kept.parent.mkdir(exist_ok=True)
        subprocess.run(["cp", "-r", str(root / "step-0000002"), str(kept)], check=True)
        assert same(contents(kept), contents(step2))
        leftovers = [n for n in os.listdir(root) if n.startswith(".step-")]
        assert leftovers == [], leftovers  # no lock, no partial version
        work = [p for p in (root / OWNER_DIR).iterdir() if p.is_dir()]
        assert all(not any(p.iterdir()) for p in work), [list(p.iterdir()) for p in work]
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def probe_step2(tmp_path: Path) -> Path:
    """The uninterrupted run's step 2."""
    ref = tmp_path / "ref"
    flags = ["--steps", "2", "--ckpt-every", "2"]
    train_in_ranks([*TINY.split(), *flags, "--out", str(ref)], 1)
    return ref / "checkpoints" / "step-0000002"


# ----------------------------------------------------------------------- fenced mid-save


class _TakeOverAt(LocalStorage):
    """Counts a save's operations once armed; before operation ``at``, another job takes the
    directory over (what a pause of this job at that point lets happen)."""

    def __init__(self, root: Path, at: int | None):
        super().__init__()
        self.root, self.at, self.count, self.ops = root, at, None, []

    def before(self, op, path):
        if self.count is None:
            return
        if self.count == self.at:
            _take_over(self.root)
        self.ops.append((op, str(path)))
        self.count += 1


def _take_over(root: Path) -> None:
    """What a claimant on host-b does once it judged this job gone: the next generation's
    record, then the old generation fenced (then it released it, so the test goes on)."""
    from fsdp_ext.checkpoint.lock import beat_path, replace_link
    from fsdp_ext.job.ownership import retire

    fs = LocalStorage()
    other = LockOwner("owner-hostb", "host-b", "boot-b", 1, "", 0, time.time(), generation=2)
    record = root / OWNER_DIR / record_name(2)
    fs.symlink(other.encode(), record)
    retire(fs, root, below=2)
    replace_link(fs, beat_path(record, other), RELEASED)


def _tiny_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Linear(6, 4)


def _fenced_at(tmp_path: Path, at: int | None) -> tuple[list, bool, bool]:
    from fsdp_ext import Checkpointer

    root = tmp_path / f"at{at}"
    fs = _TakeOverAt(root, at)
    a = Checkpointer(root, model=_tiny_model(1), keep=1, fs=fs)
    a.save(1)
    fs.count = 0
    fenced = False
    try:
        a.save(2)
    except DirectoryFencedError as exc:
        fenced = "taken over by job hostb" in str(exc)
        assert fenced, exc
    published = [s for s, _ in checkpoint_steps(root)]
    a.close()
    # the next owner: resumes the newest, saves, prunes; nothing of the fenced job is left
    model = _tiny_model(9)
    with Checkpointer(root, model=model, keep=2) as b:
        step = b.resume()
        assert step == max(published)
        b.save(step + 1)
        b.save(step + 2)
    from fsdp_ext.checkpoint import verify_checkpoint

    assert [s for s, _ in checkpoint_steps(root)] == [step + 1, step + 2]
    assert all(verify_checkpoint(p).ok for _, p in checkpoint_steps(root))
    assert [n for n in os.listdir(root) if not n.startswith("step-")] == [OWNER_DIR]
    (last,) = generations(LocalStorage(), root)  # the older ones all retired
    assert all(n.startswith(record_name(last)) for n in os.listdir(root / OWNER_DIR))
    return fs.ops, fenced, 2 in published


def test_a_takeover_before_any_operation_of_a_save_keeps_it_out(tmp_path):
    """The pause lands before each storage operation of a save in turn (stage, write, commit,
    publish, clean up, prune): whatever was not published before the takeover never is, and
    the next owner's save leaves nothing of it behind."""
    ops, fenced, published = _fenced_at(tmp_path, None)
    assert not fenced and published
    target = str(tmp_path / "atNone" / "step-0000002")
    publish = next(i for i, (op, path) in enumerate(ops) if path == target and op != "lstat")
    outcomes = {}
    for at in range(len(ops)):
        _, fenced, published = _fenced_at(tmp_path, at)
        assert published == (at > publish), (at, ops[at], fenced, published)
        assert fenced or published, (at, ops[at])  # an unpublished save never passes quietly
        outcomes[ops[at][0]] = outcomes.get(ops[at][0], 0) + 1
    print(json.dumps({"operations": len(ops), "publish_at": publish, "by_op": outcomes}))


# ----------------------------------------------------------------------- keep and set aside


def test_keep_defaults_to_three_and_a_corrupt_step_saved_again_is_set_aside(tmp_path):
    from fsdp_ext import Checkpointer
    from fsdp_ext.checkpoint import verify_checkpoint

    root = tmp_path / "out"
    with Checkpointer(root, model=_tiny_model(1)) as ckpt:
        for step in range(1, 6):
            ckpt.save(step)
    assert [s for s, _ in checkpoint_steps(root)] == [3, 4, 5]
    data = sorted((root / "step-0000005").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    model = _tiny_model(2)
    with Checkpointer(root, model=model) as ckpt:
        with pytest.warns(UserWarning, match="skipping .*step-0000005"):
            assert ckpt.resume() == 4
        with pytest.warns(UserWarning, match="corrupt, moved to"):
            ckpt.save(5)
    (aside,) = root.glob("step-0000005.corrupt-*")
    assert (aside / data.name).read_bytes() == bytes(raw)  # the evidence, as it was
    assert verify_checkpoint(root / "step-0000005").ok


class Opaque:
    """A class no allowlist admits: a checkpoint holding one verifies but does not load."""


class _Box:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_checkpoint_that_verifies_but_fails_to_load_is_recorded_and_never_pruned(tmp_path):
    from fsdp_ext import Checkpointer
    from fsdp_ext.checkpoint import verify_checkpoint
    from fsdp_ext.job.resume import skipped_checkpoints

    root = tmp_path / "out"
    with Checkpointer(root, model=_tiny_model(1), extra={"box": _Box(1)}, keep=None) as ckpt:
        ckpt.save(1)
        ckpt.state["box"].value = Opaque()
        ckpt.save(2)
    assert verify_checkpoint(root / "step-0000002").ok  # sound bytes, an unloadable pickle
    with Checkpointer(root, model=_tiny_model(2), extra={"box": _Box(0)}, keep=1) as ckpt:
        with pytest.warns(UserWarning, match="skipping .*step-0000002: it failed to load"):
            assert ckpt.resume() == 1
        assert "step-0000002" in skipped_checkpoints(root)
        ckpt.state["box"].value = 3
        ckpt.save(3)
        ckpt.save(4)
    # keep=1 counts only what loads: step 2 is kept for inspection, never pruned
    assert [s for s, _ in checkpoint_steps(root)] == [2, 4]


# ----------------------------------------------------------------------- snapshots in RAM


def test_snapshots_that_do_not_fit_are_skipped_and_nothing_is_left(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small RAM disk needs root")
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(shm)], check=True)
    try:
        small = {**ENV, "FSDP_EXT_SNAPSHOT_ROOT": str(shm)}
        flags = ["--steps", "6", "--ckpt-every", "3", "--snapshot-every", "1"]
        proc = subprocess.run(
            [*TRAIN, *flags, "--out", str(tmp_path / "small")],
            env=small,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        skipped = [x for x in proc.stderr.splitlines() if "in-memory snapshot of step" in x]
        assert len(skipped) == 6 and "step 1 skipped: it needs" in skipped[0], skipped
        assert f"bytes in {shm} on each node and" in skipped[0] and "are free" in skipped[0]
        assert [s for s, _ in checkpoint_steps(tmp_path / "small" / "checkpoints")] == [3, 6]
        assert os.listdir(shm) == []  # nothing of the job left in RAM
    finally:
        subprocess.run(["umount", "--lazy", str(shm)], check=True)


@pytest.mark.slow
def test_a_dead_jobs_snapshots_are_cleaned_and_a_live_ones_kept(tmp_path):
    """A job that fails for good leaves its snapshots; clean-snapshots removes those of a
    job that is provably gone and keeps a live one's; the next start on --out removes its.
    Fresh interpreters: the snapshots name their job's pid, the process started here."""
    ram = tmp_path / "ram"
    env = {**ENV, "FSDP_EXT_SNAPSHOT_ROOT": str(ram)}
    long = ["--steps", "100000", "--ckpt-every", "2", "--snapshot-every", "1"]
    jobs = {
        name: subprocess.Popen(
            [sys.executable, *TRAIN_SCRIPT, *long, "--out", str(tmp_path / name)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for name in ("dead", "live")
    }
    try:
        for proc in jobs.values():
            _lines_until(proc, "step     3 ")
        jobs["dead"].kill()
        jobs["dead"].wait(30)
        assert len(os.listdir(ram)) == 2
        cleaned = subprocess.run(
            [sys.executable, "-m", "fsdp_ext.job", "clean-snapshots", str(ram)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cleaned.returncode == 0, cleaned.stderr
        lines = sorted(cleaned.stdout.splitlines())
        assert len(lines) == 2, lines
        assert any(f"removed (its process {jobs['dead'].pid} has exited)" in x for x in lines)
        assert any("kept: the job owning" in x and "live" in x for x in lines), lines
        assert len(os.listdir(ram)) == 1
    finally:
        jobs["live"].kill()
        jobs["live"].wait(30)
    again = subprocess.run(
        [*TRAIN, *long[:4], "--stop-after", "1", "--out", str(tmp_path / "live")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert os.listdir(ram) == []


PUBLISH_STEPS = [
    r"rename@\.manifest\.json",  # the commit
    r"rename@step-\d+",  # the publish
    "fsync@checkpoints",  # just after it
    r"rename@\.fsdp_ext-trash-.*",  # the prune
]


@pytest.mark.slow
@pytest.mark.parametrize("point", PUBLISH_STEPS)
def test_a_pause_inside_a_save_at_each_publish_step_is_fenced(tmp_path, point):
    """The owner's host is frozen (SIGSTOP) while its background save stands at a publish
    step; another host takes over; thawed, the save goes on, is refused by the storage
    (or was published before the takeover), and the job exits 3 at its next save."""
    out, lease = tmp_path / "run", 2.0
    flags = [*TINY.split(), "--steps", "30", "--ckpt-every", "2", "--keep", "2"]
    flags += ["--lease", str(lease), "--async-save", "--out", str(out)]
    program = REPO / "tests" / "ckpt_programs" / "train_killed_at.py"
    env_a = {**ENV, "KILL_PLAN": f"0/pause@{point}", "PAUSE_S": "1"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    a = start_on_host(
        tmp_path, "host-a", [sys.executable, str(program), *flags], env=env_a, **pipes
    )
    try:
        for line in a.stderr:
            if line.startswith("paused:"):
                break
    except BaseException:
        power_off(a)
        raise
    argv_b = [*TRAIN, *flags[len(TINY.split()) :]]
    before = _frozen_while_another_takes_over(tmp_path, a, out, lease, argv_b, env=ENV, **pipes)[
        "before"
    ]
    after = _manifests(out / "checkpoints")
    assert list(after) == [28, 30]
    assert all(m["replaces"] is None for m in after.values())
    assert all(after[s]["save_id"] == sid for s, sid in before.items() if s in after)
    root = out / "checkpoints"
    assert [n for n in os.listdir(root) if n.startswith(".")] == [OWNER_DIR]
    assert all(n.startswith(record_name(2)) for n in os.listdir(root / OWNER_DIR))
