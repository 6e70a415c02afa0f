"""Nothing of a lab outlives it: not after a rank is killed, not after its parent is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster
from fsdp_ext.lab.cleanup import clean_stale, lab_runs, namespace_pids
from fsdp_ext.lab.names import PREFIX, RunNames
from tests.lab_helpers import PROGRAMS, alive, leftovers, require_lab, sshfs_mounts_of

REPO = Path(__file__).resolve().parent.parent


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_teardown_after_a_timeout_and_a_killed_rank_leaves_nothing():
    require_lab()
    with Cluster(2, 2, "100mbit") as lab:
        run_id, shared = lab.run_id, lab.shared_dir
        namespaces = list(lab.namespaces)
        started = time.monotonic()
        slow = lab.run([str(PROGRAMS / "sleeper.py"), str(shared), "120"], timeout=4)
        assert slow.timed_out and slow.returncode == 124
        assert time.monotonic() - started < 30  # stopped at the deadline, not after the sleep
        # the timed-out job's ranks (those that had started) are gone; the lab is not
        assert alive([int(p.read_text()) for p in shared.glob("rank*.pid")]) == []
        for p in shared.glob("rank*.pid"):
            p.unlink()
        program = [str(PROGRAMS / "sleeper.py"), str(shared), "120", "3"]
        result = lab.run(program, timeout=90)
        # rank 3 (node 1) SIGKILLed itself; node 1's torchrun failed, the lab stopped node 0
        assert result.returncode != 0 and not result.timed_out
        assert result.seconds < 60
        rank_pids = [int(p.read_text()) for p in shared.glob("rank*.pid")]
        assert len(rank_pids) == 4
        service_pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
        assert service_pids  # sshd and sshfs were still up inside the lab
        assert sshfs_mounts_of(run_id)
    assert leftovers(run_id, pids=rank_pids + service_pids) == []


def test_ctrl_c_during_a_job_leaves_nothing():
    """SIGINT reaches only the lab (the job runs in sessions of its own), as Ctrl-C would."""
    require_lab()

    def interrupt_once_up(shared: Path) -> None:
        _wait_for(lambda: len(list(shared.glob("rank*.pid"))) == 2, 120, "both ranks")
        signal.raise_signal(signal.SIGINT)  # handled in the main thread, inside lab.run

    # Python's own Ctrl-C handling, whatever an earlier test in this process installed
    # (in a full run one did, and the SIGINT below went to it, not to the lab)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), Cluster(2, 1, "100mbit") as lab:
            run_id, shared = lab.run_id, lab.shared_dir
            watcher = threading.Thread(target=interrupt_once_up, args=(shared,), daemon=True)
            watcher.start()
            try:
                lab.run([str(PROGRAMS / "sleeper.py"), str(shared), "300"], timeout=200)
            finally:
                pids = [int(p.read_text()) for p in shared.glob("rank*.pid")]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(pids) == 2
    assert leftovers(run_id, pids=pids) == []


def test_sigterm_to_a_lab_benchmark_tears_its_lab_down():
    """A scheduler's or a timeout's SIGTERM to a benchmark in the middle of a lab job: the
    benchmark unwinds as from Ctrl-C, and its lab (namespaces, the job's processes) is gone."""
    require_lab()
    argv = [sys.executable, str(REPO / "benchmarks" / "cluster.py"), "--plan", "1x1:100"]
    argv += ["--configs", "stock_fp32", "--steps", "400", "--plot", ""]
    bench = subprocess.Popen(
        argv,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"{PREFIX}-{bench.pid}-"  # the run ids of the labs it owns
    try:

        def its_job_runs() -> bool:
            runs = [r for r in lab_runs() if r.startswith(prefix)]
            return bool(runs) and any(namespace_pids(ns) for ns in lab_runs()[runs[0]])

        _wait_for(its_job_runs, 180, "the benchmark's lab job")
        (run_id,) = [r for r in lab_runs() if r.startswith(prefix)]
        pids = [pid for ns in lab_runs()[run_id] for pid in namespace_pids(ns)]
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
        assert bench.returncode != 0, err[-2000:]
        assert leftovers(run_id, pids=pids) == [], err[-2000:]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        clean_stale()  # whatever a failure left


def test_every_benchmark_that_builds_a_lab_tears_it_down_on_sigterm():
    """The test above runs one; each program that builds a Cluster installs the same."""
    import ast

    missing = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        mains = [
            node
            for node in tree.body
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        ]
        program = "Cluster(" in path.read_text() and mains  # not a module of one
        if program and "teardown_on_termination()" not in ast.unparse(mains[0]):
            missing.append(path.name)
    assert missing == []


def _netns_add(name: str) -> None:
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)


def _netns_del(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.mark.slow
def test_sigkill_of_the_parent_is_cleaned_by_the_next_lab_and_only_its_prefix(tmp_path):
    require_lab()
    shared = tmp_path / "shared"
    shared.mkdir()
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdp_ext.lab",
            "run",
            "--nodes",
            "2",
            "--link",
            "100mbit",
            "--shared-dir",
            str(shared),
            "--",
            str(PROGRAMS / "sleeper.py"),
            str(shared),
            "300",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    prefix = f"fsdplab-{cli.pid}-"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live_decoy = f"{RunNames(os.getpid(), 'abcdef').run_id}-decoy"  # a live owner: this test
    foreign = f"otherlab-{dead.pid}-abcdef-node0"  # a dead owner, but not the lab's prefix
    try:
        _wait_for(lambda: len(list(shared.glob("rank*.pid"))) == 2, 120, "both ranks")
        run_ids = [r for r in lab_runs() if r.startswith(prefix)]
        assert len(run_ids) == 1
        run_id = run_ids[0]
        namespaces = sorted(lab_runs()[run_id])
        pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
        pids += [int(p.read_text()) for p in shared.glob("rank*.pid")]
        _netns_add(live_decoy)
        _netns_add(foreign)
        os.kill(cli.pid, signal.SIGKILL)
        cli.wait()
        time.sleep(0.5)
        # the dead parent could not clean up: its namespaces, processes and mounts remain
        assert len(leftovers(run_id, pids=pids)) > 0
        assert sshfs_mounts_of(run_id, (str(shared),))
        with Cluster(2, 1, "100mbit", storage=False) as lab:  # the next lab's stale cleanup
            assert lab.run_id != run_id
        assert leftovers(run_id, pids=pids, shared_dir=str(shared)) == []
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert live_decoy in names and foreign in names  # not stale, or not ours: untouched
    finally:
        if cli.poll() is None:
            os.kill(cli.pid, signal.SIGKILL)
            cli.wait()
        _netns_del(live_decoy)
        _netns_del(foreign)
