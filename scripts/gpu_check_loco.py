"""Two ranks of LoCoReduceScatter over NCCL on one machine, checked bit for bit against a
single-process model built from the torch references (run by scripts/gpu-check.sh).

    torchrun --standalone --nproc-per-node 2 scripts/gpu_check_loco.py

Every rank uses ``cuda:<local_rank % device_count>``, so on a one-GPU machine both ranks share
the device; NCCL may refuse that ("Duplicate GPU detected"), which this reports as skipped.
Prints one JSON line per rank (rank 0's last).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from fsdp_ext import LoCoConfig, LoCoReduceScatter
from fsdp_ext.kernels.codec_common import payload_chunk_bytes
from fsdp_ext.kernels.dequantize_reduce import dequantize_reduce_from_payload_reference
from fsdp_ext.kernels.quantize_ef import quantize_ef_to_payload_reference

STEPS, SHARD = 3, 100_003  # padded, several tiles


def expected(inputs: torch.Tensor, config: LoCoConfig, rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` must receive, modelled on CPU with the references."""
    world = inputs.shape[0]
    groups = -(-SHARD // config.group_size)
    errors = [
        torch.zeros(world * groups * config.group_size, dtype=torch.int8) for _ in range(world)
    ]
    scales = [torch.zeros(world * groups) for _ in range(world)]
    outs = []
    for step in range(STEPS):
        rows = []
        for sender in range(world):
            payload = torch.empty(
                world,
                payload_chunk_bytes(groups, config.group_size, config.bits),
                dtype=torch.uint8,
            )
            quantize_ef_to_payload_reference(
                inputs[sender].view(world, SHARD) * (step + 1),
                payload,
                errors[sender],
                scales[sender],
                group_size=config.group_size,
                bits=config.bits,
                beta=config.err_beta,
            )
            rows.append(payload[rank])
        out = torch.empty(SHARD)
        dequantize_reduce_from_payload_reference(
            torch.stack(rows),
            out,
            group_size=config.group_size,
            bits=config.bits,
            out_scale=1 / world,
        )
        outs.append(out)
    return outs


def main() -> dict:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    result = {"check": "loco_2proc", "rank": None, "ok": False}
    try:
        dist.init_process_group("nccl", device_id=device)
        rank, world = dist.get_rank(), dist.get_world_size()
        result["rank"] = rank
        inputs = torch.randn(world, world * SHARD, generator=torch.Generator().manual_seed(0))
        comm = LoCoReduceScatter(LoCoConfig())
        got = []
        for step in range(STEPS):
            out = torch.empty(SHARD, device=device)
            comm(
                output_tensor=out,
                input_tensor=(inputs[rank] * (step + 1)).to(device),
                group=dist.group.WORLD,
                op=dist.ReduceOp.AVG,
            )
            got.append(out.cpu())
        want = expected(inputs, comm.config, rank)
        result["ok"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        result["max_abs_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(got, want, strict=True)
        )
        dist.barrier()
    except Exception as exc:  # NCCL's refusal of two ranks on one device is a result, not a crash
        text = str(exc)
        result["error"] = text.splitlines()[0][:300] if text else type(exc).__name__
        result["skipped"] = "Duplicate GPU" in text or "duplicate" in text.lower()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["ok"] else (3 if outcome.get("skipped") else 1))
