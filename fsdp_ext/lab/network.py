"""Node namespaces joined by rate-capped veth links; a bridge in a switch namespace for N > 2.

Every link is capped with tbf on both of its ends, so each direction of a node's link
carries at most the rate, whichever way the traffic flows. No interface or address is ever
placed in the host's namespace: every link is created inside the namespaces of this run.
Storage gets its own link per node (a separate storage network, as on most clusters), and
so does the infrastructure namespace (``--rdzv etcd``: the rendezvous, on a management
network that no training traffic crosses and that no training node hosts).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from fsdp_ext.lab.names import ETC_NETNS, RunNames
from fsdp_ext.lab.system import LabCommandError, run_tool

__all__ = [
    "FABRIC_DEVICE",
    "INFRA_DEVICE",
    "MAX_NODES",
    "RDZV_HOST",
    "STORAGE_DEVICE",
    "STORAGE_HOST",
    "Topology",
    "build_network",
    "rebuild_node",
    "set_rate",
]

FABRIC_DEVICE = "eth0"  # a node's link to the other nodes (GLOO_SOCKET_IFNAME)
STORAGE_DEVICE = "stor0"  # a node's link to the storage namespace
INFRA_DEVICE = "infra0"  # a node's link to the infrastructure namespace (the rendezvous)
# the rendezvous server's name on every node (its /etc/hosts), as a cluster's DNS names a
# service: each node reaches it over its own infra link
RDZV_HOST = "rendezvous"
# the storage server's name on every node: the storage side of the node's own storage link
STORAGE_HOST = "storage"
ETCD_CLIENT_PORT = 2379
GONE_WAIT_S = 10.0  # a dead namespace's links vanish asynchronously
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


def infra_addresses(index: int) -> tuple[str, str]:
    """(node side, infrastructure side) of node ``index``'s management link."""
    return f"10.202.{index}.1", f"10.202.{index}.2"


@dataclass(frozen=True)
class Topology:
    names: RunNames
    nodes: int
    storage: bool
    infra: bool = False  # an infrastructure namespace (etcd) off the training nodes

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
    def infra_namespace(self) -> str | None:
        return self.names.infra if self.infra else None

    @property
    def rendezvous_endpoint(self) -> str:
        """host:port of the rendezvous server in the infrastructure namespace."""
        if not self.infra:
            raise ValueError("the rendezvous endpoint needs infra=True (rdzv='etcd')")
        return f"{RDZV_HOST}:{ETCD_CLIENT_PORT}"

    @property
    def namespaces(self) -> list[str]:
        extra = [self.switch_namespace, self.storage_namespace, self.infra_namespace]
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

    def peer_ends(self, index: int) -> list[tuple[str, str]]:
        """The ends of node ``index``'s links that live outside its namespace: they vanish
        with it, and must be gone before it is built again."""
        ends = []
        if self.nodes == 2:
            ends.append((self.node_namespaces[1 - index], FABRIC_DEVICE))
        elif self.switch_namespace is not None:
            ends.append((self.switch_namespace, f"node{index}"))
        for ns in (self.storage_namespace, self.infra_namespace):
            if ns is not None:
                ends.append((ns, f"node{index}"))
        return ends

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
        if self.infra and namespace in nodes:
            names.append((infra_addresses(nodes.index(namespace))[1], RDZV_HOST))
        if self.storage and namespace in nodes:
            names.append((storage_addresses(nodes.index(namespace))[1], STORAGE_HOST))
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


def _add_namespace(topology: Topology, ns: str) -> None:
    run_tool(["ip", "netns", "add", ns])
    etc = ETC_NETNS / ns
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(topology.hosts_file(ns))
    _no_ipv6(ns)
    _ip(ns, "link", "set", "lo", "up")


def _cap_and_up(ends: list[tuple[str, str]], bits: int | None) -> None:
    for ns, device in ends:
        if bits is not None:
            set_rate(ns, device, bits, replace=False)
        _ip(ns, "link", "set", device, "up")


def _link_node(topology: Topology, i: int, link_bits: int, storage_bits: int) -> None:
    """Node ``i``'s links: to the switch (N > 2), to storage, to the infrastructure. Two
    nodes share one cable, made by node 1's call (or node 0's when rebuilt alone)."""
    nodes = topology.node_namespaces
    ns = nodes[i]
    switch = topology.switch_namespace
    fabric: list[tuple[str, str]] = []
    if switch is not None:
        _veth(ns, FABRIC_DEVICE, switch, f"node{i}")
        _ip(switch, "link", "set", f"node{i}", "master", "br0")
        _ip(ns, "addr", "add", f"{node_address(i)}/24", "dev", FABRIC_DEVICE)
        fabric = [(ns, FABRIC_DEVICE), (switch, f"node{i}")]
    storage = topology.storage_namespace
    if storage is not None:
        node_side, storage_side = storage_addresses(i)
        _veth(ns, STORAGE_DEVICE, storage, f"node{i}")
        _ip(ns, "addr", "add", f"{node_side}/24", "dev", STORAGE_DEVICE)
        _ip(storage, "addr", "add", f"{storage_side}/24", "dev", f"node{i}")
        _cap_and_up([(ns, STORAGE_DEVICE), (storage, f"node{i}")], storage_bits)
    infra = topology.infra_namespace
    if infra is not None:  # the management link is not capped: it carries only the rendezvous
        node_side, infra_side = infra_addresses(i)
        _veth(ns, INFRA_DEVICE, infra, f"node{i}")
        _ip(ns, "addr", "add", f"{node_side}/24", "dev", INFRA_DEVICE)
        _ip(infra, "addr", "add", f"{infra_side}/24", "dev", f"node{i}")
        _cap_and_up([(ns, INFRA_DEVICE), (infra, f"node{i}")], None)
    _cap_and_up(fabric, link_bits)


def _cable(topology: Topology, link_bits: int) -> None:
    """The one link of a two-node lab, with both nodes' addresses."""
    a, b = topology.node_namespaces
    _veth(b, FABRIC_DEVICE, a, FABRIC_DEVICE)
    for i, ns in enumerate((a, b)):
        _ip(ns, "addr", "add", f"{node_address(i)}/24", "dev", FABRIC_DEVICE)
    _cap_and_up([(a, FABRIC_DEVICE), (b, FABRIC_DEVICE)], link_bits)


def build_network(topology: Topology, link_bits: int, storage_bits: int) -> None:
    """Create the namespaces, links, bridge and caps of ``topology``.

    Namespaces are created first and all at once, so a failure half way leaves only names
    of this run behind, which teardown removes.
    """
    for ns in topology.namespaces:
        _add_namespace(topology, ns)
    switch = topology.switch_namespace
    if switch is not None:
        _ip(switch, "link", "add", "br0", "type", "bridge")
        _ip(switch, "link", "set", "br0", "up")
    if topology.nodes == 2:
        _cable(topology, link_bits)
    for i in range(topology.nodes):
        _link_node(topology, i, link_bits, storage_bits)


def _device_exists(ns: str, device: str) -> bool:
    return run_tool(["ip", "-n", ns, "link", "show", device], check=False).returncode == 0


def rebuild_node(topology: Topology, i: int, link_bits: int, storage_bits: int) -> None:
    """Node ``i`` afresh, as a scheduler hands out a new machine: its namespace (deleted
    first if it is still there; it must hold no process) and every link of it, at the same
    addresses. Waits for the old links' far ends to vanish, which the kernel does
    asynchronously once the old namespace's last process is gone."""
    ns = topology.node_namespaces[i]
    run_tool(["ip", "netns", "del", ns], check=False)
    deadline = time.monotonic() + GONE_WAIT_S
    while any(_device_exists(*end) for end in topology.peer_ends(i)):
        if time.monotonic() > deadline:
            left = [f"{d} in {n}" for n, d in topology.peer_ends(i) if _device_exists(n, d)]
            raise LabCommandError(
                f"node {i}'s old links are still there after {GONE_WAIT_S:g} s ({left}): a "
                "process still holds its old namespace; kill it (ip netns pids does not "
                "list an unnamed namespace: look for it in /proc/PID/ns/net)"
            )
        time.sleep(0.05)
    _add_namespace(topology, ns)
    if topology.nodes == 2:
        _cable(topology, link_bits)
    _link_node(topology, i, link_bits, storage_bits)
