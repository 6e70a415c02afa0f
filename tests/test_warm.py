"""Warm workers (fsdp_ext/warm): a program run through the client and a real server gets
its argv, environment, working directory and stdio; its end (exit status, death by signal)
is the client's; the launcher's signals reach it; it dies with its client; and without a
server the client runs the program in a fresh interpreter. Real processes, real sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_ext.warm import CLIENT, SERVER, client_argv, server_argv
from tests.warm_helpers import warm_server

PROGRAM = """
import os, sys, time, signal, socket
from pathlib import Path
out = Path(os.environ["WARM_TEST_DIR"])
mode = sys.argv[1]
if mode == "report":
    environ = Path(f"/proc/{os.getpid()}/environ").read_bytes().split(b"\\0")
    print("argv", sys.argv, flush=True)
    print("cwd", os.getcwd())
    print("env", os.environ.get("WARM_TEST_VALUE"))
    print("proc-environ", b"WARM_TEST_VALUE=" + os.environ["WARM_TEST_VALUE"].encode() in environ)
    print("stdin", sys.stdin.readline().strip())
    print("torch-preloaded", "torch.distributed.fsdp" in sys.modules and __name__)
    print("parent", os.getppid())
    print("host", socket.gethostname())
    print("client", os.environ.get("FSDP_EXT_WARM_CLIENT"))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise RuntimeError("the program failed")
elif mode == "signal":
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
elif mode in ("term", "sleep"):
    if mode == "term":
        def on_term(signum, frame):
            (out / "term").write_text(str(signum))
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
    (out / "pid").write_text(str(os.getpid()))
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A warm server on a socket of its own, ready (its imports done); stopped after."""
    with warm_server(tmp_path_factory.mktemp("warm")) as running:
        yield running


def _program(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = dict(os.environ, WARM_TEST_DIR=str(tmp_path), WARM_TEST_VALUE="v-42")
    return script, env


def _client(path: str, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-u", *client_argv(path, [str(script), *args])]


def _wait_for_file(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    return path.read_text()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_program_gets_argv_env_cwd_and_stdio(server, tmp_path):
    path, proc = server
    script, env = _program(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        _client(path, script, "report", "two words"),
        input="a line on stdin\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["argv"] == repr([str(script), "report", "two words"])
    assert lines["cwd"] == str(work)
    assert lines["env"] == "v-42"
    assert lines["proc-environ"] == "True"  # what tools see from outside, too
    assert lines["stdin"] == "a line on stdin"
    assert lines["torch-preloaded"] == "__main__"  # forked from the server, run as __main__
    assert lines["parent"] == str(proc.pid)
    assert done.stderr == "to stderr\n"


def test_a_client_on_another_host_gets_a_worker_with_that_hosts_name(server, tmp_path):
    """A client in a UTS + mount namespace of its own (another emulated host): the worker,
    forked by the server outside it, joins it, so what the program reads as its host name
    (a checkpoint lock's holder) is the client's host's. Its parent is the server, and the
    client's pid is in its environment (fsdp_ext.exit_with_launcher's tie goes through it)."""
    path, proc = server
    script, env = _program(tmp_path)
    host = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c"]
    host += ['hostname warm-host-b && exec "$@"', "sh"]
    done = subprocess.run(
        [*host, *_client(path, script, "report")],
        input="\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["host"] == "warm-host-b" != os.uname().nodename
    assert lines["parent"] == str(proc.pid)
    assert lines["client"].isdigit() and int(lines["client"]) != proc.pid


@pytest.mark.parametrize(
    ("args", "code"),
    [(("exit", "3"), 3), (("exit", "0"), 0), (("raise",), 1), (("signal", "SIGKILL"), -9)],
)
def test_the_client_ends_as_the_program_ended(server, tmp_path, args, code):
    script, env = _program(tmp_path)
    done = subprocess.run(
        _client(server[0], script, *args), capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == code, done.stderr
    if args == ("raise",):
        assert "RuntimeError: the program failed" in done.stderr


def test_sigterm_to_the_client_reaches_the_program(server, tmp_path):
    script, env = _program(tmp_path)
    client = subprocess.Popen(_client(server[0], script, "term"), env=env)
    try:
        worker = int(_wait_for_file(tmp_path / "pid"))
        assert worker != client.pid
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 7  # the program's own handler chose the status
        assert _wait_for_file(tmp_path / "term") == str(int(signal.SIGTERM))
    finally:
        client.kill()


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_killed_client_takes_its_program_along(server, tmp_path):
    """torchrun SIGKILLs a worker that does not stop; the forked program is not its child,
    so it must end on its own."""
    script, env = _program(tmp_path)
    client = subprocess.Popen(_client(server[0], script, "sleep"), env=env)
    worker = int(_wait_for_file(tmp_path / "pid"))
    try:
        client.kill()
        assert client.wait(timeout=30) == -9
        assert _gone_within(worker, 10), "the program outlived its killed client"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_killed_launcher_takes_client_and_program_along(server, tmp_path):
    """torchrun's agent killed alone: its workers must not train on (exit_with_launcher
    watches the worker's parent, which is the server here, so the client carries the tie)."""
    script, env = _program(tmp_path)
    client = " ".join(_client(server[0], script, "sleep"))
    launcher = subprocess.Popen(["sh", "-c", f"{client} & wait"], env=env)
    worker = int(_wait_for_file(tmp_path / "pid"))
    try:
        launcher.kill()
        launcher.wait(timeout=30)
        assert _gone_within(worker, 10), "the program outlived its killed launcher"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_without_a_server_the_program_runs_in_a_fresh_interpreter(tmp_path):
    script, env = _program(tmp_path)
    absent = str(tmp_path / "nobody.sock")
    done = subprocess.run(
        _client(absent, script, "exit", "5"), capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 5
    assert f"warm: no warm server at {absent}" in done.stderr
    assert "fresh interpreter" in done.stderr


def test_the_client_imports_only_the_standard_library(tmp_path):
    """The client is what a restart waits for: it must not import torch (or fsdp_ext)."""
    probe = "import runpy, sys; sys.argv = ['client.py']\n"
    probe += f"try:\n    runpy.run_path({str(CLIENT)!r}, run_name='__main__')\n"
    probe += "except SystemExit as exc:\n    print(exc, file=sys.stderr)\n"
    probe += "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fsdp_ext')))"
    env = dict(os.environ, PYTHONPATH=str(CLIENT.parent))
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stderr
    assert "usage: client.py" in done.stderr


def test_a_stopped_server_removes_its_socket_and_waits_for_its_workers(server, tmp_path):
    """SIGTERM: no new clients (the socket is gone: they fall back), running ones finish.
    A server of its own here (the module's one serves the other tests)."""
    path = str(tmp_path / "own.sock")
    proc = subprocess.Popen(server_argv(sys.executable, path), stdout=subprocess.PIPE, text=True)
    try:
        assert "warm: ready" in proc.stdout.readline()
        script, env = _program(tmp_path)
        client = subprocess.Popen(_client(path, script, "term"), env=env)
        _wait_for_file(tmp_path / "pid")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
        time.sleep(0.3)
        assert proc.poll() is None  # still reaping its worker
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 7  # the status still came back
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_the_server_needs_a_socket():
    done = subprocess.run([sys.executable, str(SERVER)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--socket" in done.stderr


def test_a_preload_resolves_from_the_working_directory_as_python_m_would(tmp_path):
    """chaos.py preloads examples.train from the repository: run by path, the server's own
    folder is first on sys.path, and an editable install maps only fsdp_ext; without the
    working directory on the path the preload failed and every worker silently paid a fresh
    interpreter (a chaos run's restarts: 5.6-8.2 s of imports each, against 0.1-0.2 s)."""
    package = tmp_path / "warmtestpkg"
    package.mkdir()
    (package / "__init__.py").write_text("MARK = 'preloaded'\n")
    path = str(tmp_path / "own.sock")
    argv = server_argv(sys.executable, path, ("warmtestpkg",))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert "warm: ready" in proc.stdout.readline()
        script = tmp_path / "probe.py"
        script.write_text("import sys\nprint('warmtestpkg' in sys.modules)\n")
        done = subprocess.run(
            _client(path, script), capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert done.stdout.strip() == "True", done.stderr  # forked from the server
        assert "fresh interpreter" not in done.stderr
    finally:
        proc.kill()
        proc.wait()


def test_a_preload_the_server_cannot_find_is_one_clear_error_before_it_listens(tmp_path):
    path = tmp_path / "own.sock"
    argv = server_argv(sys.executable, str(path), ("no_such_warm_module.sub",))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "--preload no_such_warm_module.sub: no module 'no_such_warm_module'" in done.stderr
    assert f"the working directory {tmp_path}" in done.stderr and "PYTHONPATH" in done.stderr
    assert not path.exists()  # never listened: no client waits on it
