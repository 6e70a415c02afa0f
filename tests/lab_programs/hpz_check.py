"""hpZ in the lab: what crosses the link while backward gathers the weights.

    hpz_check.py STEPS

A stack of Linear units with frozen weights and an input that needs a gradient, so
backward all-gathers every unit (to get the input's gradient) and reduce-scatters nothing.
Two phases, each a fresh model sharded over all ranks with qwZ on: ``node``
(``reshard_after_forward="node"``, the node size from the launcher) and ``full``
(``reshard_after_forward=True``). Each node's local rank 0 reads its namespace's link and
loopback counters around the backward passes only. Rank 0 prints one JSON line.
"""

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext

steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
link = os.environ["GLOO_SOCKET_IFNAME"]
mesh = init_device_mesh("cpu", (world,))


def counters() -> dict[str, int]:
    def read(device: str, kind: str) -> int:
        return int(Path(f"/sys/class/net/{device}/statistics/{kind}_bytes").read_text())

    return {"link_tx": read(link, "tx"), "loopback": read("lo", "tx")}


def phase(reshard_after_forward) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    for p in model.parameters():
        p.requires_grad_(False)
    fsdp_ext.shard_by_policy(
        model,
        auto_wrap_policy={nn.Linear},
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
    )
    handle = fsdp_ext.register_weight_all_gather(model, fsdp_ext.WeightQuantConfig())
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    delta = {"link_tx": 0, "loopback": 0}
    for _ in range(steps):
        loss = model(x).square().mean()
        # Each reading is fenced on both sides: no rank starts backward before local rank
        # 0 has read, nor the next step's forward before it has read again. Without the
        # second fence, node 0's other rank could run ahead into the next forward, whose
        # qwZ all-gather sends its int8 shards across the link (measured: 139 KB, two
        # units' shards) while local rank 0, descheduled on a loaded machine, had not read
        # yet: the flaky bound of tests/test_lab_hpz.py.
        dist.barrier()
        before = counters() if local_rank == 0 else None
        dist.barrier()
        loss.backward()
        dist.barrier()
        if local_rank == 0:
            after = counters()
            for key in delta:
                delta[key] += after[key] - before[key]
        dist.barrier()
        x.grad = None
    return {
        "counters": delta if local_rank == 0 else None,
        "stats": asdict(handle.stats),
        "finite": bool(model(x).isfinite().all()),
    }


mine = {
    "node": phase("node"),
    "full": phase(True),
    "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
}
everyone = [None] * world
dist.all_gather_object(everyone, mine)
if rank == 0:
    print(json.dumps({"ranks": everyone}), flush=True)
dist.destroy_process_group()
