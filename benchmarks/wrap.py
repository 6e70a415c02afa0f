"""Benchmark auto-wrap policies on a fine-grained Qwen2-MoE-like model, 2 gloo ranks.

Policies, all through ``fsdp_ext.fully_shard`` on the same model and data:
  leaf         every parameterised leaf its own unit (the finest wrap)
  block        one unit per decoder layer (torchtitan style, a set of classes)
  granularity  GranularityPolicy(memory_budget_bytes=budget_layers * one layer's bytes)
  fsdp1_transformer  FSDP1 transformer_auto_wrap_policy(DecoderLayer) via the adapter

Per policy: units, all-gathers and reduce-scatters per step (counted by wrapping the
torch.distributed collectives FSDP2 calls), median step ms, estimated peak unsharded
bytes, final loss. Steps of the policies are interleaved so machine load hits all alike, and
their order rotates every step, so no policy always runs right after leaf's long step. The
garbage collector runs between steps, not inside them: with it on, the three identical plans
(block, granularity, fsdp1_transformer) measured up to 13 % apart; with it off, about 1 %.

    python benchmarks/wrap.py --quick          # 4 layers x 64 experts, < 3 min
    python benchmarks/wrap.py                  # 8 layers; growth over 16/64/128 experts
    python benchmarks/wrap.py --quick --norm decomposed   # leaf's last bits differ

The model's RMSNorm is fused (one backward node) by default. ``--norm decomposed`` uses
the eager form, whose input gets two gradients; FSDP2's node on a norm unit's input then
regroups a float sum, so ``leaf`` differs from the others in the last bits (docs/wrap.md).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import fsdp_ext
from benchmarks.wrap_models import DecoderLayer, FineMoE, FineMoEConfig
from tests.dist import run_distributed

WORLD = 2
GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")
SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def _is_param_leaf(module: torch.nn.Module) -> bool:
    return not any(True for _ in module.children()) and any(
        True for _ in module.parameters(recurse=False)
    )


def make_policies(budget_bytes: int) -> dict[str, object]:
    return {
        "leaf": _is_param_leaf,
        "block": {DecoderLayer},
        "granularity": fsdp_ext.GranularityPolicy(memory_budget_bytes=budget_bytes),
        "fsdp1_transformer": functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer}
        ),
    }


class CollectiveCounter:
    """Counts the collectives FSDP2 issues by wrapping the torch.distributed functions."""

    def __init__(self) -> None:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        for names, kind in ((GATHER_NAMES, "all_gather"), (SCATTER_NAMES, "reduce_scatter")):
            for name in names:
                if hasattr(dist, name):
                    setattr(dist, name, self._counting(getattr(dist, name), kind))

    def _counting(self, fn, kind):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def _batch(cfg: FineMoEConfig, rank: int, step: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _bench_rank(cfg_dict: dict, budget_layers: float, steps: int, warmup: int, seq: int):
    cfg = FineMoEConfig(**cfg_dict)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    counter = CollectiveCounter()
    with torch.device("meta"):
        meta = FineMoE(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in meta.layers[0].parameters())
    budget = int(budget_layers * layer_bytes)
    runs = {}
    for name, policy in make_policies(budget).items():
        torch.manual_seed(0)
        model = FineMoE(cfg)
        plan = fsdp_ext.plan_units(model, policy)
        fsdp_ext.fully_shard(model, auto_wrap_policy=policy, mesh=mesh)
        runs[name] = {
            "model": model,
            # fused: one optimizer op over all DTensors, not ~15 per parameter, so the
            # step time measures FSDP units rather than DTensor dispatch in AdamW.
            "optim": torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
            "plan": plan,
            "times": [],
            "losses": [],
            "gathers": 0,
            "scatters": 0,
        }
    names = list(runs)
    gc.disable()
    for step in range(warmup + steps):
        tokens = _batch(cfg, rank, step, 2, seq)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            gc.collect()
            dist.barrier()
            before = counter.snapshot()
            start = time.perf_counter()
            logits = run["model"](tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            run["optim"].step()
            run["optim"].zero_grad()
            elapsed = time.perf_counter() - start
            after = counter.snapshot()
            run["losses"].append(loss.item())
            if step >= warmup:
                run["times"].append(elapsed)
                run["gathers"] += after["all_gather"] - before["all_gather"]
                run["scatters"] += after["reduce_scatter"] - before["reduce_scatter"]
    gc.enable()
    out = {"budget_bytes": budget, "model_bytes": model_bytes, "policies": {}}
    for name, run in runs.items():
        out["policies"][name] = {
            "units": len(run["plan"].units),
            "all_gathers_per_step": run["gathers"] / steps,
            "reduce_scatters_per_step": run["scatters"] / steps,
            "step_times_s": run["times"],
            "est_peak_unsharded_bytes": run["plan"].peak_bytes,
            "threshold": run["plan"].threshold,
            "losses": run["losses"],
        }
    return out


def run_config(cfg: FineMoEConfig, budget_layers: float, steps: int, warmup: int, seq: int):
    ranks = run_distributed(
        _bench_rank, WORLD, asdict(cfg), budget_layers, steps, warmup, seq, timeout=3600
    )
    result = ranks[0]
    policies = {}
    for name, stats in result["policies"].items():
        # A step takes as long as its slowest rank.
        per_step = [
            max(r["policies"][name]["step_times_s"][i] for r in ranks) for i in range(steps)
        ]
        final = [r["policies"][name]["losses"][-1] for r in ranks]
        policies[name] = {
            "units": stats["units"],
            "all_gathers_per_step": stats["all_gathers_per_step"],
            "reduce_scatters_per_step": stats["reduce_scatters_per_step"],
            "median_step_ms": round(1000 * statistics.median(per_step), 2),
            "est_peak_unsharded_bytes": stats["est_peak_unsharded_bytes"],
            "final_loss": sum(final) / len(final),
        }

    def identical(names) -> bool:
        return all(
            r["policies"][name]["losses"] == r["policies"]["block"]["losses"]
            for r in ranks
            for name in names
        )

    max_rel_loss_diff = max(
        abs(a - b) / abs(b)
        for r in ranks
        for name in r["policies"]
        for a, b in zip(
            r["policies"][name]["losses"], r["policies"]["block"]["losses"], strict=True
        )
    )
    return {
        "layers": cfg.n_layers,
        "num_experts": cfg.num_experts,
        "budget_bytes": result["budget_bytes"],
        "model_bytes": result["model_bytes"],
        "granularity_threshold": result["policies"]["granularity"]["threshold"],
        "policies": policies,
        "speedup_granularity_vs_leaf": round(
            policies["leaf"]["median_step_ms"] / policies["granularity"]["median_step_ms"], 3
        ),
        "step_ratio_granularity_vs_block": round(
            policies["granularity"]["median_step_ms"] / policies["block"]["median_step_ms"], 3
        ),
        "losses_identical": identical(policies),
        "norm": "fused" if cfg.fused_norm else "decomposed",
        "losses_identical_except_leaf": identical([n for n in policies if n != "leaf"]),
        "max_rel_loss_diff_vs_block": max_rel_loss_diff,
        "granularity_peak_within_budget": policies["granularity"]["est_peak_unsharded_bytes"]
        <= result["budget_bytes"],
    }


def _print_table(result: dict) -> None:
    print(
        f"\nlayers={result['layers']}  experts/layer={result['num_experts']}  "
        f"model={result['model_bytes']} B  "
        f"budget={result['budget_bytes']} B  granularity threshold="
        f"{result['granularity_threshold']}  norm={result['norm']}"
    )
    print(
        f"{'policy':<18} {'units':>6} {'AG/step':>8} {'RS/step':>8} {'step ms':>9} "
        f"{'est peak B':>11} {'final loss':>11}"
    )
    for name, p in result["policies"].items():
        print(
            f"{name:<18} {p['units']:>6} {p['all_gathers_per_step']:>8.0f} "
            f"{p['reduce_scatters_per_step']:>8.0f} {p['median_step_ms']:>9.1f} "
            f"{p['est_peak_unsharded_bytes']:>11} {p['final_loss']:>11.6f}"
        )
    print(
        f"speedup granularity vs leaf: {result['speedup_granularity_vs_leaf']}  "
        f"step ratio granularity/block: {result['step_ratio_granularity_vs_block']}  "
        f"losses identical: {result['losses_identical']} "
        f"(max rel diff vs block {result['max_rel_loss_diff_vs_block']:.1e})",
        flush=True,
    )


def _plot(growth: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experts = [g["num_experts"] for g in growth]
    fig, (ax_units, ax_ms) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("leaf", "block", "granularity"):
        ax_units.plot(experts, [g["policies"][name]["units"] for g in growth], "o-", label=name)
        ax_ms.plot(
            experts, [g["policies"][name]["median_step_ms"] for g in growth], "o-", label=name
        )
    ax_units.set(xlabel="experts per layer", ylabel="FSDP units", yscale="log", title="Units")
    ax_ms.set(xlabel="experts per layer", ylabel="median step ms", yscale="log", title="Step time")
    for ax in (ax_units, ax_ms):
        ax.set_xticks(experts)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"FineMoE, {growth[0]['layers']} layers, 2 gloo ranks on a 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, no sweep (< 3 min)")
    parser.add_argument("--layers", type=int, default=None, help="default 8 (4 with --quick)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per policy (>= 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=65, help="tokens per sequence (+1 target)")
    parser.add_argument(
        "--budget-layers",
        type=float,
        default=2.5,
        help="granularity's memory budget, in decoder layers' parameter bytes",
    )
    parser.add_argument("--sweep", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument(
        "--norm",
        choices=("fused", "decomposed"),
        default="fused",
        help="RMSNorm with one backward node (as on GPUs) or the decomposed eager form",
    )
    parser.add_argument("--plot", default="docs/wrap_growth.png")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    layers = args.layers or (4 if args.quick else 8)

    def measure(experts: int) -> dict:
        cfg = FineMoEConfig(n_layers=layers, num_experts=experts, fused_norm=args.norm == "fused")
        return run_config(cfg, args.budget_layers, args.steps, args.warmup, args.seq)

    main_result = measure(args.experts)
    _print_table(main_result)
    summary = {"bench": "wrap", **main_result}
    if not args.quick:
        growth = []
        for experts in args.sweep:
            result = main_result if experts == args.experts else measure(experts)
            if experts != args.experts:
                _print_table(result)
            growth.append(result)
        _plot(growth, args.plot)
        summary["growth"] = [
            {
                "num_experts": g["num_experts"],
                **{
                    f"{name}_{key}": g["policies"][name][key]
                    for name in ("leaf", "block", "granularity")
                    for key in ("units", "median_step_ms")
                },
            }
            for g in growth
        ]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
