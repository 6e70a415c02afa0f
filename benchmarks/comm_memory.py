"""Benchmark: LoCo's error memory per parameter per rank, measured from the real buffers.

    python benchmarks/comm_memory.py              # 4 ranks (2 emulated nodes of 2), example LM
    python benchmarks/comm_memory.py --world 2

The sender-side error covers the unit's whole unsharded gradient on every rank (each rank
keeps what it failed to send to every peer), so unlike ZeRO-3's sharded states it does not
shrink with the world size; hierarchical mode keeps it only for the chunks that cross nodes,
which divides it by the node size. For each ``error_dtype`` x hierarchical setting this
trains one step of the example model, sums the bytes of every error buffer (values and
int8 scales) on each rank, and divides by the model's parameter count. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fsdp_ext.testing import run_distributed  # noqa: E402

ERROR_DTYPES = {"int8": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32}


def _measure(world: int, node_size: int, small: bool) -> list[dict]:
    import torch.distributed as dist

    from examples.model import ModelConfig, Transformer
    from examples.train import TrainConfig, shard_model
    from fsdp_ext import CommConfig, LoCoConfig, ParallelDims, enable

    cfg = TrainConfig()
    if small:
        cfg = replace(cfg, model=ModelConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64))
    dims = ParallelDims(world)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = shard_model(Transformer(cfg.model), cfg, dims)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(
        0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    rows = []
    for name, dtype in ERROR_DTYPES.items():
        for hierarchical in (None, node_size):
            handle = enable(
                model,
                CommConfig(
                    gradients=LoCoConfig(error_dtype=dtype),
                    hierarchical=hierarchical is not None,
                    node_size=hierarchical or "auto",
                ),
            )
            model(tokens).float().square().mean().backward()
            model.zero_grad(set_to_none=True)
            total = 0
            for unit in handle._units.values():
                for feedback in unit.feedbacks():
                    for t in (feedback.error, feedback.error_scales):
                        if t is not None:
                            total += t.numel() * t.element_size()
            handle.remove()
            rows.append(
                {
                    "error_dtype": name,
                    "intra_node_size": hierarchical,
                    "error_bytes_per_rank": total,
                    "model_params": params,
                    "bytes_per_param_per_rank": total / params,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2, help="ranks per emulated node")
    p.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    args = p.parse_args(argv)
    per_rank = run_distributed(_measure, args.world, args.world, args.node_size, args.small)
    table = per_rank[0]
    for rank_rows in per_rank[1:]:  # every rank holds the same amount
        for row, other in zip(table, rank_rows, strict=True):
            row["max_over_ranks"] = max(
                row.get("max_over_ranks", row["error_bytes_per_rank"]),
                other["error_bytes_per_rank"],
            )
    print(f"{'error_dtype':>11} {'node size':>9} {'bytes/rank':>12} {'bytes/param/rank':>17}")
    for row in table:
        print(
            f"{row['error_dtype']:>11} {row['intra_node_size'] or '-':>9} "
            f"{row['error_bytes_per_rank']:>12,} {row['bytes_per_param_per_rank']:>17.3f}"
        )
    flat = {
        r["error_dtype"]: r["bytes_per_param_per_rank"] for r in table if not r["intra_node_size"]
    }
    result = {
        "bench": "comm_memory",
        "world_size": args.world,
        "node_size": args.node_size,
        "rows": table,
        # what that means per GPU for a 7B / 70B model (flat: does not shrink with the world)
        "gb_per_gpu_7b": {k: round(v * 7e9 / 1e9, 2) for k, v in flat.items()},
        "gb_per_gpu_70b": {k: round(v * 70e9 / 1e9, 1) for k, v in flat.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
