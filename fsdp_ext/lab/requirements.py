"""What the lab needs from the machine, and the one line that says what is missing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from fsdp_ext.lab.names import RunNames
from fsdp_ext.lab.rendezvous import ETCD_INSTALL, etcd_missing
from fsdp_ext.lab.s3 import S3_INSTALL, s3_missing
from fsdp_ext.lab.system import LabCommandError, run_tool

__all__ = [
    "APT_INSTALL",
    "STORAGE_SERVICES",
    "LabUnavailable",
    "check_requirements",
    "storage_service",
    "unavailable_reason",
]

APT_INSTALL = "apt-get install -y iproute2 sshfs openssh-server"
SSHD = "/usr/sbin/sshd"  # sshd must be started by its absolute path
FUSE_DEVICE = "/dev/fuse"
STORAGE_SERVICES = ("sshfs", "s3")  # what the storage namespace serves: a directory, or S3


def storage_service(storage: bool | str) -> str | None:
    """The storage service ``storage`` asks for: True is sshfs, False none (None)."""
    if storage is True:
        return "sshfs"
    if storage is False:
        return None
    if storage in STORAGE_SERVICES:
        return storage
    choices = ", ".join(repr(s) for s in STORAGE_SERVICES)
    raise ValueError(f"storage must be True, False, {choices}, got {storage!r}")


class LabUnavailable(RuntimeError):
    """The lab cannot run on this machine; the message is one line that says why and how."""


def _missing_tools(service: str | None) -> list[str]:
    tools = ["ip", "tc", "nsenter"]
    if service == "sshfs":
        tools += ["sshfs", "ssh-keygen", "ssh"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if service == "sshfs" and not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    return missing


def _netns_refusal(names: RunNames) -> str | None:
    """Create and delete a namespace: the only reliable test that namespaces are allowed."""
    try:
        run_tool(["ip", "netns", "add", names.probe])
    except LabCommandError as exc:
        return str(exc).splitlines()[0]
    run_tool(["ip", "netns", "del", names.probe], check=False)
    return None


def unavailable_reason(
    *,
    storage: bool | str = True,
    names: RunNames | None = None,
    rdzv: str = "c10d",
    python: str = sys.executable,
) -> str | None:
    """None when a lab can be built here, else the one-line reason (with the fix).
    ``storage``: True or "sshfs" (the default), "s3", or False (none)."""
    service = storage_service(storage)
    storage = service is not None
    if os.geteuid() != 0:
        return (
            "fsdp_ext.lab needs root (it creates network namespaces, tc caps and FUSE mounts); "
            f"run it as root on a Linux host, with the packages from: {APT_INSTALL}"
        )
    missing = _missing_tools(service)
    if missing:
        what = ", ".join(missing)
        hint = "" if not storage else " (or run without storage: --no-storage / storage=False)"
        return f"fsdp_ext.lab needs {what}, which is missing; install with: {APT_INSTALL}{hint}"
    if service == "sshfs" and not Path(FUSE_DEVICE).exists():
        return (
            f"fsdp_ext.lab needs {FUSE_DEVICE} for the shared sshfs directory, and this machine "
            "has none (load the fuse module, or run without storage: --no-storage)"
        )
    if rdzv == "etcd" and etcd_missing():
        return (
            f"fsdp_ext.lab --rdzv etcd needs {', '.join(etcd_missing())}, which is missing; "
            f"install with: {ETCD_INSTALL} (or use the default --rdzv c10d)"
        )
    lacking = s3_missing(python) if service == "s3" else []
    if lacking:
        return (
            f"fsdp_ext.lab --storage s3 needs {', '.join(lacking)}, which is missing; "
            f"install with: {S3_INSTALL} (or use the default --storage sshfs)"
        )
    refusal = _netns_refusal(names or RunNames.new())
    if refusal is not None:
        return (
            f"fsdp_ext.lab: network namespaces are not permitted here ({refusal}); run as real "
            f"root on the host, not in an unprivileged user namespace (packages: {APT_INSTALL})"
        )
    return None


def check_requirements(
    *,
    storage: bool | str = True,
    names: RunNames | None = None,
    rdzv: str = "c10d",
    python: str = sys.executable,
) -> None:
    """Raise :class:`LabUnavailable` with the one-line reason when the lab cannot run here."""
    reason = unavailable_reason(storage=storage, names=names, rdzv=rdzv, python=python)
    if reason is not None:
        raise LabUnavailable(reason)
