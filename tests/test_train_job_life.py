"""The main job across a cluster's habits: two jobs on one --out, a dead host, a corrupt
newest checkpoint. Each job is a real `examples/train.py --nproc-per-node 2` process."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp_ext.checkpoint import checkpoint_steps
from fsdp_ext.checkpoint.fence import generations, holder
from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.warm import CLIENT_ENV, SOCKET_ENV
from tests.host_helpers import power_off, signal_host, start_on_host
from tests.train_flags import TINY as TINY_FLAGS
from tests.train_flags import train_in_ranks

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "examples" / "train.py"), "--nproc-per-node", "2"]
TINY = " ".join([*TINY_FLAGS, "--warmup-steps", "2"])
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def job(out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*TRAIN, *TINY.split(), "--out", str(out), *args],
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def contents(path: Path) -> dict:
    """Every value a checkpoint holds (through DCP's own converter)."""
    file = path.parent.parent / f"{path.name}.{os.getpid()}.pt"
    dcp_to_torch_save(path, file)
    try:
        return torch.load(file, weights_only=False)
    finally:
        file.unlink()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _with_descendants(pids: list[int]) -> set[int]:
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += _children(pid)
    return found


def _job_processes(launcher: int) -> set[int]:
    """The launcher, its descendants, and the warm workers forked for them (the warm
    server's children whose environment names one of those as their client)."""
    found = _with_descendants([launcher])
    clients = {f"{CLIENT_ENV}={pid}".encode() for pid in found}
    workers = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in found:
            with contextlib.suppress(OSError):
                if clients & set((entry / "environ").read_bytes().split(b"\0")):
                    workers.append(int(entry.name))
    return found | _with_descendants(workers)


def _stop(launcher: int) -> set[int]:
    """SIGSTOP every process of a job, until a second look finds no new one (a worker the
    warm server forked for an already stopped client)."""
    stopped: set[int] = set()
    while True:
        new = _job_processes(launcher) - stopped
        if not new:
            return stopped
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
        time.sleep(0.2)


def two_jobs(tmp_path: Path, delay: float, env: dict | None = None) -> None:
    """Whichever job claims --out first is held (SIGSTOP, all its processes, well within
    its 60 s lease) until the other has been refused, then let go: the refusal meets a
    live owner however slowly the second job starts, never an owner that already finished
    its 6 steps (which a loaded machine's second start could otherwise let happen)."""
    out = tmp_path / "run"
    flags = ["--steps", "6", "--ckpt-every", "2", "--keep", "5"]
    first = job(out, *flags, "--seed", "0", env=env)
    time.sleep(delay)
    second = job(out, *flags, "--seed", "1", env=env)
    jobs = {first.pid: first, second.pid: second}
    deadline = time.monotonic() + 120
    while (owner := holder(LocalStorage(), out / "checkpoints", 1)) is None:
        assert time.monotonic() < deadline, "no job claimed --out in 120 s"
        assert first.poll() is None or second.poll() is None, "both jobs ended unclaimed"
        time.sleep(0.01)
    assert owner.pid in jobs, (owner, list(jobs))  # the launcher holds the record
    held = _stop(owner.pid)
    try:
        (other,) = [p for pid, p in jobs.items() if pid != owner.pid]
        other_result = finish(other)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    owner_result = finish(jobs[owner.pid])
    results = {
        seed: owner_result if proc.pid == owner.pid else other_result
        for seed, proc in ((0, first), (1, second))
    }
    ran = [seed for seed, (rc, _o, _e) in results.items() if rc == 0]
    assert len(ran) == 1, {s: (rc, e[-1500:]) for s, (rc, _o, e) in results.items()}
    winner, loser = ran[0], 1 - ran[0]
    assert "fresh interpreter" not in results[winner][2]  # forked warm when given a server
    rc, stdout, stderr = results[loser]
    assert rc != 0
    assert "step " not in stdout  # refused before its first step
    (line,) = [x for x in stderr.splitlines() if "error" in x]
    assert f"argument --out: {out / 'checkpoints'}: owned by a live job" in line, stderr
    assert "on host" in line and "choose another output directory" in line
    # every checkpoint left is, value for value, what the job that ran saves by itself
    alone = tmp_path / "alone"
    train_in_ranks([*TINY.split(), *flags, "--seed", str(winner), "--out", str(alone)], 2)
    left = checkpoint_steps(out / "checkpoints")
    assert [s for s, _ in left] == [2, 4, 6]
    for step, path in left:
        assert same(contents(path), contents(alone / "checkpoints" / path.name)), step


def test_two_jobs_started_together_one_trains(tmp_path, warm_server_socket):
    """The workers are forked from a warm server ($FSDP_EXT_WARM_SOCKET): who owns --out
    is the subject here, and the workers' imports were half the test's CPU."""
    two_jobs(tmp_path, delay=0.0, env={SOCKET_ENV: warm_server_socket})


@pytest.mark.slow
def test_two_jobs_started_3s_apart_one_trains(tmp_path):
    two_jobs(tmp_path, delay=3.0)


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_resumes_from_the_previous(tmp_path):
    out = tmp_path / "run"
    rc, _o, err = finish(job(out, "--steps", "4", "--ckpt-every", "1", "--stop-after", "3"))
    assert rc == 0, err[-2000:]
    newest = Path(os.path.realpath(out / "checkpoints" / "step-0000003"))
    data = sorted(newest.glob("*.distcp"))[-1]
    newest_files = list(newest.iterdir())
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    rc, stdout, err = finish(job(out, "--steps", "4", "--ckpt-every", "1"))  # --resume auto
    assert rc == 0, err[-2000:]
    assert "resumed from" in stdout and "step-0000002 at step 2" in stdout
    assert f"skipping {out / 'checkpoints' / 'step-0000003'}" in err
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 4
    # kept for inspection, beside the step 3 the resumed run saved again
    (aside,) = (out / "checkpoints").glob("step-0000003.corrupt-*")
    assert sorted(p.name for p in aside.iterdir()) == sorted(p.name for p in newest_files)


@pytest.mark.slow
@pytest.mark.parametrize("same_run", [False, True])
def test_a_dead_host_holding_a_lock_is_resumed_here(tmp_path, same_run):
    """Host B trains, saving every step; it loses power while it holds a checkpoint lock.
    A --resume here reaches the last step by itself: within the lease (3 s here), at once
    for the same run."""
    out = tmp_path / "run"
    lease = "3" if not same_run else "120"
    env = {"FSDP_EXT_RUN_ID": "run-b"}
    flags = ["--steps", "40", "--ckpt-every", "1", "--keep", "2", "--lease", lease]
    argv = [*TRAIN, *TINY.split(), "--out", str(out), *flags]
    host_b = start_on_host(
        tmp_path,
        "node-b",
        argv,
        env={**ENV, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    root = out / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            locks = [p for p in root.glob(".step-*.lock")] if root.is_dir() else []
            if locks and checkpoint_steps(root):
                # frozen whole (SIGSTOP, a stopped VM), the host can no longer let its lock
                # go: power off if it still holds one, else let it run on and look again
                signal_host(host_b, signal.SIGSTOP)
                if list(root.glob(".step-*.lock")):
                    break
                signal_host(host_b, signal.SIGCONT)
            time.sleep(0.002)
    finally:
        power_off(host_b)
    locks = sorted(p.name for p in root.glob(".step-*.lock"))
    assert locks, "host B was not caught holding a lock"
    (generation,) = generations(LocalStorage(), root)  # host B's claim, the only one
    assert holder(LocalStorage(), root, generation).host == "node-b"
    here = {"FSDP_EXT_RUN_ID": "run-b"} if same_run else {}
    t0 = time.monotonic()
    rc, stdout, err = finish(job(out, *flags, "--resume", env=here))
    took = time.monotonic() - t0
    assert rc == 0, err[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 40
    assert "on host node-b" in err
    if same_run:
        assert "earlier attempt of this run (run-b)" in err
        assert "waiting up to" not in err
    else:
        assert "lease expired" in err
    print(
        json.dumps(
            {
                "same_run": same_run,
                "lease_s": float(lease),
                "resume_s": round(took, 1),
                "locks_left_by_b": locks,
            }
        )
    )


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (every thread's, from /proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(k) for k in (task / "children").read_text().split()]
    return found


def test_workers_die_with_their_launcher(tmp_path):
    """SIGKILL of the launcher (torchrun's agent) ends its workers: no orphan trains on."""
    proc = job(tmp_path / "run", "--steps", "100000", "--ckpt-every", "5")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("step") or (not line and proc.poll() is not None):
                break
        workers = _children(proc.pid)
        assert len(workers) == 2, (workers, proc.stderr.read()[-2000:] if proc.poll() else "")
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
        time.sleep(0.05)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()]
    zombies = [w for w in alive if " Z " in Path(f"/proc/{w}/stat").read_text()]
    assert alive == zombies, f"workers {alive} outlived their launcher"
