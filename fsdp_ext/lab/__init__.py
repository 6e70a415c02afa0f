"""The cluster lab: rehearse a multi-node job on one machine (root, Linux).

Nodes are network namespaces joined by veth links capped with tbf (both ends); for more
than two nodes they meet in a bridge inside a switch namespace. A storage namespace serves
a directory over sshd, mounted with sshfs at the same path on every node (or, with
``storage="s3"``, an S3 server every node reaches over its own link). torchrun runs on
every node with a real multi-node rendezvous; the interface counters say what crossed each
link. See docs/cluster.md.
"""

from fsdp_ext.lab.cleanup import clean_stale, namespace_pids, teardown_on_termination
from fsdp_ext.lab.cluster import DEFAULT_TIMEOUT_S, Cluster, LabResult
from fsdp_ext.lab.counters import NodeBytes
from fsdp_ext.lab.faults import (
    Fault,
    FaultEvent,
    kill_namespace,
    link_down,
    process_environ,
    rank_pids,
)
from fsdp_ext.lab.network import FABRIC_DEVICE
from fsdp_ext.lab.rates import parse_rate
from fsdp_ext.lab.requirements import APT_INSTALL, LabUnavailable, unavailable_reason
from fsdp_ext.lab.supervisor import NodeLoss

__all__ = [
    "APT_INSTALL",
    "DEFAULT_TIMEOUT_S",
    "FABRIC_DEVICE",
    "Cluster",
    "Fault",
    "FaultEvent",
    "LabResult",
    "LabUnavailable",
    "NodeBytes",
    "NodeLoss",
    "clean_stale",
    "kill_namespace",
    "link_down",
    "namespace_pids",
    "parse_rate",
    "process_environ",
    "rank_pids",
    "teardown_on_termination",
    "unavailable_reason",
]
