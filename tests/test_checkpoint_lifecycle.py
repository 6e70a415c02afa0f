"""A cluster job's life: one owner per directory, leased locks, a second host, pid reuse,
the newest intact checkpoint, step order, and loads racing a prune.

A second host is a UTS + mount namespace with its own name, boot id and /etc/hosts entry
(tests/host_helpers.py); its power loss is SIGKILL of every process in it.
"""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_ext import Checkpointer, DirectoryOwnedError, latest_intact
from fsdp_ext.checkpoint import (
    CheckpointBusyError,
    CheckpointPrunedError,
    LocalStorage,
    checkpoint_steps,
    read_lease,
    remove_checkpoint,
    step_name,
)
from fsdp_ext.checkpoint.fence import OWNER_DIR, generations, record_name
from fsdp_ext.checkpoint.lock import RELEASED, LockOwner, acquire, lock_path, read_beat
from fsdp_ext.job import load_intact
from fsdp_ext.job.ownership import claim
from fsdp_ext.job.resume import SKIPPED_RECORD
from tests.host_helpers import power_off, require_unshare, start_on_host
from tests.warm_helpers import forked_warm

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "ckpt_programs"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
PYTHON = [sys.executable]  # how the holders below start: forked warm (the fixture below)


@pytest.fixture(autouse=True, scope="module")
def _holders_forked_warm(warm_server_socket):
    """The lock holders on another host and the unlock CLI start through the session's warm
    server (fsdp_ext/warm): forks that join the host's network, mount and UTS namespaces,
    without paying torch's imports. The pid-namespace test keeps fresh interpreters (a fork
    of the server would not be in the new pid namespace)."""
    with forked_warm(warm_server_socket, PYTHON):
        yield


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def save_steps(root: Path, steps: list[int], keep=None) -> dict[int, list[torch.Tensor]]:
    """Save a differently seeded tiny model at each step; the weights each one holds."""
    saved = {}
    for step in steps:
        model, opt = tiny(step % 1000)
        with Checkpointer(root, model=model, optimizer=opt, keep=keep) as ckpt:
            ckpt.save(step)
        saved[step] = weights(model)
    return saved


def resume_into_fresh(root: Path) -> tuple[int, list[torch.Tensor]]:
    model, opt = tiny(999)
    with Checkpointer(root, model=model, optimizer=opt, keep=None) as ckpt:
        step = ckpt.resume()
    return step, weights(model)


# ----------------------------------------------------------------------- step order


def test_steps_sort_by_number_past_ten_million(tmp_path):
    root = tmp_path / "ckpts"
    assert step_name(9_999_999) == "step-9999999" and step_name(10_000_000) == "step-10000000"
    saved = save_steps(root, [9_999_999, 10_000_000, 999])
    assert [s for s, _ in checkpoint_steps(root)] == [999, 9_999_999, 10_000_000]
    assert latest_intact(root) == (10_000_000, root / "step-10000000")
    step, got = resume_into_fresh(root)
    assert step == 10_000_000
    assert all(torch.equal(a, b) for a, b in zip(got, saved[10_000_000], strict=True))
    # pruning keeps the newest by number too
    model, opt = tiny(0)
    with Checkpointer(root, model=model, optimizer=opt, keep=1) as ckpt:
        ckpt.prune()
    assert [s for s, _ in checkpoint_steps(root)] == [10_000_000]


# ----------------------------------------------------------------------- corrupt newest


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_corrupt_newest_is_skipped_named_kept_and_not_counted(tmp_path, where):
    root = tmp_path / "ckpts"
    saved = save_steps(root, [1, 2, 3], keep=2)
    assert [s for s, _ in checkpoint_steps(root)] == [2, 3]
    newest = Path(os.path.realpath(root / "step-0000003"))
    if where == "data":
        target = sorted(newest.glob("*.distcp"))[0]
        _flip(target, target.stat().st_size // 2)
    else:
        target = newest / ".manifest.json"
        text = target.read_text()
        _flip(target, text.index('"checksum": "') + len('"checksum": "') + 2)
    before = sorted(p.name for p in newest.iterdir())
    with pytest.warns(UserWarning, match="skipping .*step-0000003"):
        assert latest_intact(root) == (2, root / "step-0000002")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, got = resume_into_fresh(root)
    assert step == 2
    assert all(torch.equal(a, b) for a, b in zip(got, saved[2], strict=True))
    named = [str(w.message) for w in caught if "skipping" in str(w.message)]
    assert len(named) == 1 and str(root / "step-0000003") in named[0], named
    assert "step-0000003" in json.loads((root / SKIPPED_RECORD).read_text())
    # kept for inspection, and not counted toward keep: two intact ones stay beside it
    save_steps(root, [4, 5], keep=2)
    assert [s for s, _ in checkpoint_steps(root)] == [3, 4, 5]
    assert sorted(p.name for p in newest.iterdir()) == before


# ----------------------------------------------------------------------- one owner


def test_a_second_owner_is_refused_until_the_first_ends(tmp_path):
    root = tmp_path / "ckpts"
    code = (
        "import sys, time; from fsdp_ext.job.ownership import claim; "
        "claim(sys.argv[1]); print('owned', flush=True); time.sleep(600)"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", code, str(root)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout.readline().strip() == "owned"
        model, _ = tiny(0)
        with pytest.raises(DirectoryOwnedError) as err:
            Checkpointer(root, model=model)
        message = str(err.value)
        assert str(root) in message and f"pid {job.pid}" in message
        assert "choose another output directory" in message
        assert sorted(os.listdir(root)) == [OWNER_DIR]  # the refused job wrote nothing
        assert generations(LocalStorage(), root) == [1]
    finally:
        job.kill()
        job.wait(30)
    # its process is gone (same machine): taken over at once, with a warning naming it
    with pytest.warns(UserWarning, match=f"taking it over from .* pid {job.pid} .*has exited"):
        ckpt = Checkpointer(root, model=model)
    ckpt.close()
    fs = LocalStorage()
    assert generations(fs, root) == [2]  # the takeover's record; the old one retired
    record = root / OWNER_DIR / record_name(2)
    mine = LockOwner.decode(os.readlink(record))
    assert read_beat(fs, record, mine) == RELEASED  # a finished job gives the directory up
    t0 = time.monotonic()
    Checkpointer(root, model=model).close()  # at once: no lease to wait out
    assert time.monotonic() - t0 < 5
    assert generations(fs, root) == [3]


# ----------------------------------------------------------------------- pid reuse


def _in_pid_namespace(script: str) -> str:
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_reused_pid_does_not_keep_a_dead_holder_alive(tmp_path):
    """A holder whose pid now belongs to a later process is gone: real pid reuse, made
    with two pid namespaces (pid 2 in each is a different process)."""
    require_unshare()
    target = tmp_path / "ckpt"
    py = sys.executable
    holder = _in_pid_namespace(f"{py} {PROGRAMS / 'take_lock_and_die.py'} {target}; exit $?")
    assert holder == "2"
    verdict = _in_pid_namespace(f"sleep 60 & {py} {PROGRAMS / 'judge_lock.py'} {target}; kill %1")
    assert verdict == "holder pid 2, me 3: its process 2 has exited (the pid was reused)"


# ----------------------------------------------------------------------- second host


def _wait_line(proc, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if needle in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"no {needle!r} within {timeout} s")


def test_a_dead_host_lets_go_within_its_lease(tmp_path, capfd):
    lease = 3.0
    root = tmp_path / "ckpts"
    argv = [*PYTHON, str(PROGRAMS / "hold_locks.py"), str(root), str(lease)]
    host_b = start_on_host(
        tmp_path,
        "node-b",
        argv,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_line(host_b, "held")
        # alive on another host: its heartbeat moves, so it is refused (no waiting it out)
        t0 = time.monotonic()
        with pytest.raises(DirectoryOwnedError, match="on host node-b"):
            claim(root, lease_s=lease)
        refused_s = time.monotonic() - t0
        assert refused_s < lease + 1.5
        with pytest.raises(CheckpointBusyError, match="on host node-b"):
            acquire(LocalStorage(), root / "step-0000005", LockOwner.here("save-a"))
    finally:
        killed = power_off(host_b)
    assert len(killed) >= 1
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="taking it over from .* on host node-b.*lease expired"):
        mine = claim(root, lease_s=lease)
    waited = time.monotonic() - t0
    # judged by this process's clock alone: a whole lease with no heartbeat change, plus one
    # heartbeat interval, never less
    assert lease <= waited <= lease + lease / 4 + 1.5, waited
    assert "last seen change" in capfd.readouterr().err
    print(
        json.dumps(
            {
                "lease_s": lease,
                "refused_live_s": round(refused_s, 2),
                "took_over_dead_s": round(waited, 2),
            }
        )
    )
    with pytest.warns(UserWarning, match="on host node-b.*lease expired"):
        acquire(LocalStorage(), root / "step-0000005", LockOwner.here("save-a"))
    assert json.loads(os.readlink(lock_path(root / "step-0000005")))["save_id"] == "save-a"
    mine.release()


def test_the_same_run_takes_over_from_a_dead_host_at_once(tmp_path, monkeypatch):
    lease = 60.0
    root = tmp_path / "ckpts"
    env = {**ENV, "FSDP_EXT_RUN_ID": "run-42"}
    argv = [*PYTHON, str(PROGRAMS / "hold_locks.py"), str(root), str(lease)]
    host_b = start_on_host(
        tmp_path,
        "node-b",
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_line(host_b, "held")
    finally:
        power_off(host_b)
    monkeypatch.setenv("FSDP_EXT_RUN_ID", "run-42")
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="earlier attempt of this run \\(run-42\\) on host node-b"):
        mine = claim(root, lease_s=lease)
        acquire(LocalStorage(), root / "step-0000005", LockOwner.here("save-a"))
    took = time.monotonic() - t0
    assert took < 10  # not the 60 s lease
    print(json.dumps({"lease_s": lease, "same_run_took_over_s": round(took, 2)}))
    mine.release()


def test_unlock_prints_who_held_it(tmp_path):
    target = tmp_path / "ckpt"
    taker = subprocess.run(
        [*PYTHON, str(PROGRAMS / "take_lock_and_die.py"), str(target)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    pid = taker.stdout.strip()
    proc = subprocess.run(
        [*PYTHON, "-m", "fsdp_ext.checkpoint", "unlock", str(target)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"held by save save-dead by pid {pid} on host" in proc.stdout
    assert not os.path.lexists(lock_path(target))


# ----------------------------------------------------------------------- loads racing a prune


def test_a_prune_skips_a_checkpoint_being_read_and_a_read_skips_one_being_pruned(tmp_path):
    root = tmp_path / "ckpts"
    save_steps(root, [1, 2, 3])
    model, opt = tiny(0)
    with Checkpointer(root, model=model, optimizer=opt, keep=1) as ckpt:
        with read_lease(root / "step-0000001"):
            with pytest.raises(CheckpointBusyError, match=f"being read by .*pid {os.getpid()}"):
                remove_checkpoint(root / "step-0000001")
            with pytest.warns(UserWarning, match="being read"):
                assert ckpt.prune() == [root / "step-0000002"]
        assert ckpt.prune() == [root / "step-0000001"]  # the reader is done: a later prune
    # a remover holding the lock: a reader backs off with an error that says so
    code = (
        "import sys, time; from pathlib import Path; "
        "from fsdp_ext.checkpoint.fs import LocalStorage; "
        "from fsdp_ext.checkpoint.lock import LockOwner, acquire; "
        "acquire(LocalStorage(), Path(sys.argv[1]), LockOwner.here('remove-test')); "
        "print('held', flush=True); time.sleep(600)"
    )
    remover = subprocess.Popen(
        [sys.executable, "-c", code, str(root / "step-0000003")],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert remover.stdout.readline().strip() == "held"
        with (
            pytest.raises(CheckpointPrunedError, match="is being pruned"),
            read_lease(root / "step-0000003"),
        ):
            pass
    finally:
        remover.kill()
        remover.wait(30)
    assert not list(root.glob(".step-*.read-*"))  # every read lease was given back


SAVER = """
import os, sys, torch
from torch import nn
from fsdp_ext import Checkpointer
torch.manual_seed(0)
model = nn.Linear(64, 64)
ckpt = Checkpointer(sys.argv[1], model=model, keep=1)
step = 0
while not os.path.exists(sys.argv[2]) and step < 100_000:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step)
    ckpt.save(step)
    print(step, flush=True)
ckpt.close()
"""


def race(tmp_path: Path, loads: int) -> dict:
    """``loads`` loads of the newest intact checkpoint while a --keep 1 job saves a new
    one and prunes the previous, over and over."""
    root, stop = tmp_path / "ckpts", tmp_path / "stop"
    saver = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", SAVER, str(root), str(stop)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    counts = {"loaded": 0, "none": 0, "errors": [], "saves": 0}
    try:
        assert saver.stdout.readline().strip() == "1"
        model = nn.Linear(64, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(loads):
                try:
                    step = load_intact(root, {"model": model})
                except BaseException as exc:
                    counts["errors"].append(repr(exc)[:300])
                    continue
                if step is None:
                    counts["none"] += 1
                    continue
                counts["loaded"] += 1
                # what was loaded is whole: one step's weights, not a mix
                assert torch.all(model.weight == model.weight.flatten()[0])
    finally:
        stop.touch()
        out, err = saver.communicate(timeout=300)
    assert saver.returncode == 0, err[-3000:]
    counts["saves"] = 1 + len(out.split())
    return counts


def test_loads_racing_a_keep_1_job_never_fail_misleadingly(tmp_path):
    counts = race(tmp_path, loads=25)
    print(json.dumps({k: v if k != "errors" else len(v) for k, v in counts.items()}))
    assert counts["errors"] == [] and counts["loaded"] >= 20 and counts["saves"] >= 5, counts


@pytest.mark.slow
def test_a_thousand_loads_racing_a_keep_1_job(tmp_path):
    counts = race(tmp_path, loads=1000)
    print(json.dumps({k: v if k != "errors" else len(v) for k, v in counts.items()}))
    assert counts["errors"] == [] and counts["loaded"] >= 500, counts
