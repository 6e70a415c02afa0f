"""Node namespaces joined by rate-capped veth links; a bridge in a switch namespace for N > 2.

Every link is capped with tbf on both of its ends, so each direction of a node's link
carries at most the rate, whichever way the traffic flows. No interface or address is ever
placed in the host's namespace: every link is created inside the namespaces of this run.
Storage gets its own link per node (a separate storage network, as on most clusters).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from fsdp_ext.lab.names import ETC_NETNS, RunNames
from fsdp_ext.lab.system import run_tool

__all__ = [
    "FABRIC_DEVICE",
    "MAX_NODES",
    "STORAGE_DEVICE",
    "Topology",
    "build_network",
    "set_rate",
]

FABRIC_DEVICE = "eth0"  # a node's link to the other nodes (GLOO_SOCKET_IFNAME)
STORAGE_DEVICE = "stor0"  # a node's link to the storage namespace
MAX_NODES = 150
# tbf's bucket: large enough for 64 KiB GSO packets at every rate, small next to a transfer
TBF_BURST = "256kb"
TBF_LATENCY = "100ms"


def node_address(index: int) -> str:
    """10.200.0.101, .102, ...: three digits, so torchrun's c10d rendezvous, which orders
    nodes by address string, gives node ``index`` the group rank ``index``."""
    return f"10.200.0.{101 + index}"


def storage_addresses(index: int) -> tuple[str, str]:
    """(node side, storage side) of node ``index``'s storage link."""
    return f"10.201.{index}.1", f"10.201.{index}.2"


@dataclass(frozen=True)
class Topology:
    names: RunNames
    nodes: int
    storage: bool

    @property
    def node_namespaces(self) -> list[str]:
        return [self.names.node(i) for i in range(self.nodes)]

    @property
    def switch_namespace(self) -> str | None:
        return self.names.switch if self.nodes > 2 else None

    @property
    def storage_namespace(self) -> str | None:
        return self.names.storage if self.storage else None

    @property
    def namespaces(self) -> list[str]:
        extra = [self.switch_namespace, self.storage_namespace]
        return self.node_namespaces + [ns for ns in extra if ns is not None]

    def node_address(self, index: int) -> str:
        return node_address(index)

    def fabric_ends(self) -> list[tuple[str, str]]:
        """Every (namespace, device) end of a node link: the devices tbf caps at ``link``."""
        if self.nodes == 1:
            return []
        ends = [(ns, FABRIC_DEVICE) for ns in self.node_namespaces]
        if self.switch_namespace is not None:
            ends += [(self.switch_namespace, f"node{i}") for i in range(self.nodes)]
        return ends

    def storage_ends(self) -> list[tuple[str, str]]:
        if self.storage_namespace is None:
            return []
        ends = [(ns, STORAGE_DEVICE) for ns in self.node_namespaces]
        return ends + [(self.storage_namespace, f"node{i}") for i in range(self.nodes)]

    def hosts_file(self, namespace: str) -> str:
        """/etc/hosts inside ``namespace``: the nodes by name, and the machine's hostname as
        this namespace's own address (the namespaces share the host's UTS name, and tools
        such as torchrun --standalone look it up)."""
        nodes = self.node_namespaces
        own = "127.0.1.1"
        if namespace in nodes and self.nodes > 1:
            own = node_address(nodes.index(namespace))
        names = [("127.0.0.1", "localhost"), (own, socket.gethostname())]
        names += [(node_address(i), f"node{i}") for i in range(self.nodes)]
        lines = ["::1 localhost"] + [f"{address} {name}" for address, name in names]
        # the rendezvous store sees peers as IPv4-mapped IPv6 addresses and looks them up
        lines += [f"::ffff:{address} {name}" for address, name in names]
        return "\n".join(lines) + "\n"


def _ip(ns: str, *args: str) -> None:
    run_tool(["ip", "-n", ns, *args])


def set_rate(ns: str, device: str, bits_per_s: int, *, replace: bool = True) -> None:
    """Cap ``device``'s egress at ``bits_per_s`` (tbf: a token bucket, no added latency)."""
    verb = "replace" if replace else "add"
    run_tool(
        [
            "tc",
            "-n",
            ns,
            "qdisc",
            verb,
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{bits_per_s}bit",
            "burst",
            TBF_BURST,
            "latency",
            TBF_LATENCY,
        ]
    )


def _no_ipv6(ns: str) -> None:
    """No IPv6 in the lab's namespaces (it runs on IPv4): a link coming up otherwise sends
    router solicitations and MLD reports on its own for seconds (measured: 5 frames of
    70-250 bytes in the first 6 s), which the interface counters of a job then count, and
    a reading of two nodes can split one of them (sent, not yet received)."""
    for scope in ("all", "default"):
        sysctl = f"/proc/sys/net/ipv6/conf/{scope}/disable_ipv6"
        run_tool(["ip", "netns", "exec", ns, "sh", "-c", f"echo 1 > {sysctl}"])


def _veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """A veth pair created inside ``ns_a`` with its peer born in ``ns_b``."""
    _ip(ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)


def build_network(topology: Topology, link_bits: int, storage_bits: int) -> None:
    """Create the namespaces, links, bridge and caps of ``topology``.

    Namespaces are created first and all at once, so a failure half way leaves only names
    of this run behind, which teardown removes.
    """
    for ns in topology.namespaces:
        run_tool(["ip", "netns", "add", ns])
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(topology.hosts_file(ns))
        _no_ipv6(ns)
        _ip(ns, "link", "set", "lo", "up")
    nodes = topology.node_namespaces
    switch = topology.switch_namespace
    if len(nodes) == 2:  # two nodes: one cable, no switch
        _veth(nodes[0], FABRIC_DEVICE, nodes[1], FABRIC_DEVICE)
    elif switch is not None:
        _ip(switch, "link", "add", "br0", "type", "bridge")
        for i, ns in enumerate(nodes):
            _veth(ns, FABRIC_DEVICE, switch, f"node{i}")
            _ip(switch, "link", "set", f"node{i}", "master", "br0")
        _ip(switch, "link", "set", "br0", "up")
    for i, ns in enumerate(nodes if len(nodes) > 1 else []):
        _ip(ns, "addr", "add", f"{node_address(i)}/24", "dev", FABRIC_DEVICE)
    storage = topology.storage_namespace
    if storage is not None:
        for i, ns in enumerate(nodes):
            node_side, storage_side = storage_addresses(i)
            _veth(ns, STORAGE_DEVICE, storage, f"node{i}")
            _ip(ns, "addr", "add", f"{node_side}/24", "dev", STORAGE_DEVICE)
            _ip(storage, "addr", "add", f"{storage_side}/24", "dev", f"node{i}")
    for ns, device in topology.fabric_ends():
        set_rate(ns, device, link_bits, replace=False)
        _ip(ns, "link", "set", device, "up")
    for ns, device in topology.storage_ends():
        set_rate(ns, device, storage_bits, replace=False)
        _ip(ns, "link", "set", device, "up")
