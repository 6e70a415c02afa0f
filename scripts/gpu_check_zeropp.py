"""A ZeRO++ training step (qwZ weights + 4-bit LoCo gradients) on 2 processes over NCCL, with
its kernel launches and host syncs counted (run by scripts/gpu-check.sh on >= 2 GPUs).

    torchrun --standalone --nproc-per-node 2 scripts/gpu_check_zeropp.py

Three steps on one batch: the loss must fall, each unit's gather must take one launch each
way and each reduce-scatter one launch each way, and the counted step must make no host
sync. Prints one JSON line per rank (rank 0's last); exit code 0 when every check holds.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.testing import HostSyncs, KernelLaunches


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def main() -> dict:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    result = {"check": "zeropp_2proc", "rank": None, "ok": False}
    try:
        dist.init_process_group("nccl", device_id=device)
        result["rank"] = dist.get_rank()
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        torch.manual_seed(0)
        net = nn.Sequential(*(Block(256) for _ in range(4)), nn.Linear(256, 16)).to(device)
        fsdp_ext.shard_by_policy(net, auto_wrap_policy={Block}, mesh=mesh)
        handle = fsdp_ext.comm.enable(net, fsdp_ext.CommConfig(gradients="loco", weights="int8"))
        optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 16, generator=gen)
        x, y = x.to(device), y.to(device)
        losses = []

        def step():
            loss = F.mse_loss(net(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss.detach()

        losses.append(step())  # lazy init, error buffers, tile tables
        handle.reset_stats()
        handle.weights.reset_stats()
        torch.cuda.synchronize()
        with KernelLaunches() as launches, HostSyncs() as syncs:
            losses.append(step())
        losses.append(step())
        losses = [float(v) for v in losses]  # read back after the counted step
        gathers = handle.weights.stats.quantized_gathers
        reductions = handle.stats.reductions
        counts = launches.counts
        result.update(
            losses=losses,
            gathers=gathers,
            reductions=reductions,
            launches=dict(counts),
            host_syncs=dict(syncs.counts),
            sync_sites=sorted({where for _, where in syncs.where}),
        )
        result["ok"] = (
            all(math.isfinite(v) for v in losses)
            and losses[-1] < losses[0]
            and counts["_quantize_blockwise_kernel"] == gathers
            and counts["_dequantize_blockwise_kernel"] == gathers
            and counts["_quantize_ef_kernel"] == reductions
            and counts["_dequantize_reduce_kernel"] == reductions
            and syncs.total == 0
        )
        dist.barrier()
    except Exception as exc:  # reported as a result, so the JSON line always comes out
        result["error"] = (
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
