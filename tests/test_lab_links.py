"""The lab's links hold their caps: a plain TCP transfer between node namespaces."""

from __future__ import annotations

import json
import subprocess
import sys

from fsdp_ext.lab import Cluster
from tests.lab_helpers import PROGRAMS, require_lab

CAP = 80_000_000  # bits/s: slow enough to stay exact on a loaded 2-core machine
PORT = 5201
# the transfer's two ends run ahead of the machine's other work (they sleep on the socket
# almost all the time), so a loaded 2-core machine measures the link, not its run queue
PRIORITY = ["nice", "-n", "-15"]


def transfer(lab: Cluster, receiver: int, senders: list[int], seconds: float) -> dict:
    """Send for about ``seconds`` from every sender to ``receiver``; the receiver's timing."""
    per_sender = int(CAP / 8 * seconds / len(senders))
    program = str(PROGRAMS / "throughput.py")
    before = lab.link_bytes()
    server = lab.popen(
        receiver,
        [*PRIORITY, sys.executable, program, "serve", str(PORT), str(len(senders))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "listening"
    address = lab.node_address(receiver)
    args = [str(PORT), str(per_sender)]
    clients = [
        lab.popen(node, [*PRIORITY, sys.executable, program, "send", address, *args])
        for node in senders
    ]
    for client in clients:
        assert client.wait(timeout=60) == 0
    report = json.loads(server.stdout.readline())
    assert server.wait(timeout=10) == 0
    after = lab.link_bytes()
    received = sum(report["bytes"])
    assert received == per_sender * len(senders)
    return {
        "bits_per_s": received * 8 / report["seconds"],
        "link_rx": after[receiver].link_rx - before[receiver].link_rx,
        "link_tx": [after[n].link_tx - before[n].link_tx for n in senders],
        "payload": received,
    }


def test_link_cap_holds_through_the_switch_in_both_directions():
    """3 nodes meet in a bridge: one sender gets the cap; two senders into one node share
    it, because the switch's end of that node's link is capped too."""
    require_lab(storage=False)
    with Cluster(nodes=3, ranks_per_node=1, link="80mbit", storage=False) as lab:
        one = transfer(lab, receiver=0, senders=[1], seconds=1.5)
        two = transfer(lab, receiver=0, senders=[1, 2], seconds=1.5)
        back = transfer(lab, receiver=2, senders=[0], seconds=1.0)
    for measured in (one, two, back):
        assert 0.8 * CAP <= measured["bits_per_s"] <= 1.2 * CAP, measured
        # the interface counters saw the payload (plus headers) cross the links
        assert measured["payload"] <= measured["link_rx"] <= 1.05 * measured["payload"]
        assert sum(measured["link_tx"]) >= measured["payload"]
