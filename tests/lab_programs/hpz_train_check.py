"""hpZ training in the lab: losses, and what crosses each node's link over whole steps.

    hpz_train_check.py STEPS

A stack of trainable Linear units, AdamW, the same batches in two phases, each a fresh
model sharded over all ranks: ``node`` (``reshard_after_forward="node"``, the node size
from the launcher) and ``full`` (``reshard_after_forward=True``, stock FSDP). Each node's
local rank 0 reads its namespace's link counter around the training steps. Rank 0 prints
one JSON line.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext._torch import group_reshard_after_forward, param_group

steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
link = os.environ["GLOO_SOCKET_IFNAME"]
mesh = init_device_mesh("cpu", (world,))


def link_tx() -> int:
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text())


def phase(reshard_after_forward) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    fsdp_ext.shard_by_policy(
        model, auto_wrap_policy={nn.Linear}, mesh=mesh, reshard_after_forward=reshard_after_forward
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    dist.barrier()
    before = link_tx() if local_rank == 0 else None
    for _ in range(steps):
        g = torch.Generator().manual_seed(rank)  # one batch per rank: the loss must fall
        x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    dist.barrier()
    return {
        "link_tx": link_tx() - before if local_rank == 0 else None,
        "losses": losses,
        "reshard": [group_reshard_after_forward(param_group(m)) for m in model],
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
