"""Lab behaviours no test held before: each test here fails under a hand-made mutant of the
code it guards (named in its docstring), checked against an independent source (the
kernel's /proc and tc, a process tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster, clean_stale, parse_rate
from fsdp_ext.lab.cleanup import lab_runs
from fsdp_ext.lab.cli import _status_cause
from fsdp_ext.lab.launcher import LOST, Job, node_env
from fsdp_ext.lab.names import RunNames, owner_alive, process_start_time
from fsdp_ext.lab.network import Topology
from tests.lab_helpers import PROGRAMS, alive, require_lab


@pytest.mark.parametrize(
    ("text", "bits"),
    [("4.1mbit", 4_100_000), ("8.2mbit", 8_200_000), ("4.1gbit", 4_100_000_000)],
)
def test_fractional_rates_round_to_the_nearest_bit(text, bits):
    """4.1 * 10**6 is 4099999.9999999995 in floats: int() would cap the link 1 bit low
    (mutant: ``int`` for ``round`` in parse_rate)."""
    assert parse_rate(text) == bits


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_lab_without_its_owner_record_is_cleaned_once_its_pid_is_gone():
    """A namespace of a dead owner whose working directory (owner.json) is gone is still
    removed (mutant: a missing record judged alive, so the namespace stays forever)."""
    require_lab(storage=False)
    names = RunNames(_dead_pid(), "a0b1c2")
    assert not names.workdir.exists()
    subprocess.run(["ip", "netns", "add", names.node(0)], check=True)
    try:
        assert names.run_id in lab_runs()
        assert names.run_id in clean_stale()
        assert names.run_id not in lab_runs()
    finally:
        subprocess.run(["ip", "netns", "del", names.node(0)], capture_output=True)


def test_a_zombie_owner_is_dead():
    """An owner that exited but was not reaped yet holds nothing: its lab is stale
    (mutant: the "Z" state check removed from process_start_time)."""
    child = subprocess.Popen(["sleep", "0.1"])
    started = process_start_time(child.pid)
    assert owner_alive(child.pid, started)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        assert not owner_alive(child.pid, started)
    finally:
        child.wait()


def test_start_time_is_the_processes_start_in_clock_ticks_after_boot():
    """Field 22 of /proc/PID/stat, against the boot clock: a process started now started
    uptime seconds after boot (mutant: a neighbouring field, e.g. fields[20], vsize)."""
    child = subprocess.Popen(["sleep", "5"])
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        assert abs(process_start_time(child.pid) / ticks - uptime) < 5.0
    finally:
        child.kill()
        child.wait()


def test_stopping_a_job_kills_the_whole_process_group(monkeypatch):
    """A torchrun that ignores SIGTERM gets SIGKILL with its children, never alone
    (mutant: ``os.kill(proc.pid, sig)`` for ``os.killpg`` in launcher._signal_group)."""
    monkeypatch.setattr("fsdp_ext.lab.launcher.STOP_GRACE_S", 0.5)
    script = 'trap "" TERM; sleep 300 & echo $! ; wait'
    leader = subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(leader.stdout.readline())
    try:
        Job([leader], []).stop()
        deadline = time.monotonic() + 5
        while alive([child]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive([child]) == []
    finally:
        if alive([child]):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(("nodes", "ranks", "cores"), [(2, 2, 8), (2, 1, 2), (4, 2, 2)])
def test_ranks_share_the_cores_without_oversubscribing(monkeypatch, nodes, ranks, cores):
    """Every rank's OMP threads together fit the machine (one thread at least)
    (mutant: cores // nodes, which gives each of a node's ranks the node's share)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    env = node_env({}, Topology(RunNames(1, "abcdef"), nodes, False), ranks)
    threads = int(env["OMP_NUM_THREADS"])
    assert threads == max(1, cores // (nodes * ranks))
    assert threads * nodes * ranks <= max(cores, nodes * ranks)


def _tc_rate(lab: Cluster, ns: str, device: str) -> str:
    out = subprocess.run(
        ["tc", "-n", ns, "qdisc", "show", "dev", device], capture_output=True, text=True
    ).stdout
    return out.split(" rate ")[1].split()[0]


def test_storage_link_has_its_own_rate_and_counts_writes_as_sent():
    """tc shows the storage link's own rate on both ends (mutant: the node link's rate used
    for the storage ends), and 4 MB written to the shared directory from node 0 count as
    sent on its storage link, not received (mutant: storage_tx read from rx_bytes)."""
    require_lab()
    with Cluster(2, 1, "100mbit", storage_link="300mbit") as lab:
        storage_ns = lab.topology.storage_namespace
        node0 = lab.topology.node_namespaces[0]
        assert _tc_rate(lab, node0, "stor0") == "300Mbit"
        assert _tc_rate(lab, storage_ns, "node0") == "300Mbit"
        assert _tc_rate(lab, node0, "eth0") == "100Mbit"
        before = lab.link_bytes()[0]
        target = lab.shared_dir / "written.bin"
        lab.exec(0, ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=4", "conv=fsync"])
        moved = lab.link_bytes()[0] - before
        assert target.stat().st_size == 4 << 20  # on the storage's disk
        assert moved.storage_tx >= 4 << 20
        assert moved.storage_rx < (4 << 20) // 10
        # a job's processes never outlive it, whatever session they put themselves in
        # (mutant: no kill_marked after the job)
        result = lab.run([str(PROGRAMS / "orphan.py"), str(lab.shared_dir)], timeout=120)
        assert result.returncode == 0, result.output[-2000:]
        orphans = [int(p.read_text()) for p in lab.shared_dir.glob("orphan*.pid")]
        assert len(orphans) == 2 and alive(orphans) == []
        assert any("outlived its torchruns" in p for p in result.problems)


@pytest.mark.parametrize(("code", "name"), [(247, "SIGKILL"), (-9, "SIGKILL"), (241, "SIGTERM")])
def test_an_exit_status_from_a_signal_names_it(code, name):
    """torchrun exits with its worker's -9, which reads 247: the lab names SIGKILL."""
    assert f"killed by {name}" in _status_cause(code)
    assert _status_cause(1) == "" and "was lost" in _status_cause(LOST)


RUN = ["run", "--nodes", "2", "--link", "1gbit"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--link-down", "1", "--kill-after", "1"], "argument --link-down: needs --for T"),
        (["--for", "3"], "argument --for: only with --link-down"),
        (["--kill-node", "1"], "one of --kill-after S or --kill-on TEXT"),
        (["--kill-after", "5"], "no fault to strike"),
        (["--kill-node", "2", "--kill-after", "5"], "kill-node: node must be from 0 to 1, got 2"),
        (["--kill-rank", "2", "--kill-after", "5"], "kill-rank: rank must be from 0 to 1, got 2"),
        (["--min-nodes", "1"], "min_nodes needs max_restarts >= 1"),
        (["--max-restarts", "1", "--min-nodes", "3"], "min_nodes must be an int from 1 to 2"),
        (["--no-storage", "--storage-down", "0", "--kill-after", "1"], "storage-down needs"),
    ],
)
def test_bad_elastic_and_fault_flags_fail_in_one_line_before_anything_is_built(
    extra, match, capsys
):
    from fsdp_ext.lab.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*RUN, *extra, "--", "x.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert match in err[-1] and "Traceback" not in "".join(err), err


def test_a_lab_started_under_another_tmpdir_is_found_by_the_cleanup(monkeypatch, tmp_path):
    """The run's directory (with its ssh keys) does not follow $TMPDIR, so the stale
    cleanup of any later lab finds it (mutant: tempfile.gettempdir() as the root)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    names = RunNames(_dead_pid(), "c0ffee")
    assert names.workdir.parent == Path("/tmp")
    names.workdir.mkdir()
    try:
        (names.workdir / "ssh").mkdir()
        monkeypatch.delenv("TMPDIR")
        monkeypatch.setattr(tempfile, "tempdir", None)
        assert names.run_id in lab_runs()
        clean_stale()
        assert not names.workdir.exists()
    finally:
        if names.workdir.exists():
            import shutil

            shutil.rmtree(names.workdir)


def test_idle_links_carry_nothing_and_each_node_has_its_own_ram():
    """A lab's fabric is silent while no job runs, from the moment it is built (mutant: IPv6
    left on, whose router solicitations and MLD reports of a link coming up are counted),
    and each node's /dev/shm is its own: another node and the host do not see what it
    keeps in RAM (mutant: no tmpfs of the node's own)."""
    require_lab()
    with Cluster(2, 1, "100mbit") as lab:
        first = lab.link_bytes()
        time.sleep(2.0)
        last = lab.link_bytes()
        assert [(b.link_tx, b.link_rx) for b in first + last] == [(0, 0)] * 4
        name = f"fsdp_ext_ram_probe_{lab.run_id}"
        lab.exec(0, ["sh", "-c", f"echo kept > /dev/shm/{name}"])
        assert lab.exec(0, ["cat", f"/dev/shm/{name}"]).stdout == "kept\n"
        assert lab.exec(1, ["ls", "/dev/shm"]).stdout.split() == []
        assert not Path("/dev/shm", name).exists()
