"""Bytes on each node's links, from the kernel's interface counters inside its namespace.

These counters are the ground truth for what crossed a link: they count every frame the
interface sent or received (payload and TCP/IP/Ethernet headers), whoever sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fsdp_ext.lab.network import FABRIC_DEVICE, STORAGE_DEVICE, Topology
from fsdp_ext.lab.system import run_tool

__all__ = ["NodeBytes", "read_node_bytes"]


@dataclass(frozen=True)
class NodeBytes:
    """One node's interface counters (or their change over a run), in bytes."""

    link_tx: int = 0  # sent on the node's link to the other nodes
    link_rx: int = 0
    storage_tx: int = 0  # sent on the node's storage link (writes to the shared directory)
    storage_rx: int = 0
    loopback: int = 0  # traffic between ranks of this node (lo counts it once each way)

    def __sub__(self, other: NodeBytes) -> NodeBytes:
        """The change from ``other`` to this reading. A counter that went down belongs to an
        interface made again in between (a lost node's namespace built afresh, or the cable
        it shared): it counts from its new start, so its reading is the change."""
        return NodeBytes(
            *(_change(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        )

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _change(now: int, before: int) -> int:
    return now - before if now >= before else now


# a device that is gone (a lost node's links, until it is built again) reads 0
_READ = 'for f; do cat "$f" 2>/dev/null || echo 0; done'


def _statistics(ns: str, devices: list[str]) -> dict[tuple[str, str], int]:
    """The counters of ``devices`` in ``ns``; all 0 while the namespace is gone."""
    paths = [f"/sys/class/net/{d}/statistics/{k}_bytes" for d in devices for k in ("tx", "rx")]
    keys = [(d, k) for d in devices for k in ("tx", "rx")]
    done = run_tool(["ip", "netns", "exec", ns, "sh", "-c", _READ, "sh", *paths], check=False)
    values = done.stdout.split() if done.returncode == 0 else ["0"] * len(keys)
    return dict(zip(keys, map(int, values), strict=True))


def read_node_bytes(topology: Topology) -> list[NodeBytes]:
    """Every node's counters now (absolute since the interfaces were created)."""
    devices = ["lo"]
    if topology.nodes > 1:
        devices.append(FABRIC_DEVICE)
    if topology.storage:
        devices.append(STORAGE_DEVICE)
    out = []
    for ns in topology.node_namespaces:
        stats = _statistics(ns, devices)
        out.append(
            NodeBytes(
                link_tx=stats.get((FABRIC_DEVICE, "tx"), 0),
                link_rx=stats.get((FABRIC_DEVICE, "rx"), 0),
                storage_tx=stats.get((STORAGE_DEVICE, "tx"), 0),
                storage_rx=stats.get((STORAGE_DEVICE, "rx"), 0),
                loopback=stats[("lo", "tx")],
            )
        )
    return out
