"""How PP and ZeRO-1/2/3 work together: communication, memory and step time, measured.

    PYTHONPATH=. python benchmarks/pipeline.py [--quick] [--steps 6] [--microbatches 4,8]

4 gloo ranks. Every PP configuration is pp=2 x dp=2 with the 1F1B schedule and four FSDP
units per stage; the reference is FSDP alone over dp=4 (one forward/backward per step on
the same global batch). Per configuration and microbatch count M:
  - step ms (median over timed steps; the slowest rank's time per step);
  - all-gathers and reduce-scatters per step (counting comms on every unit);
  - dp wire bytes per step per rank: what a ring sends for each all-gather and
    reduce-scatter ((W-1)/W of the unsharded buffer), or LoCo's own count of the 4-bit
    payload; stage-to-stage activations are the same for every PP row and left out;
  - peak unsharded parameter and gradient bytes per rank, sampled by hooks on FSDP's
    param groups right before every point where FSDP frees memory and after every
    all-gather (``fsdp_ext.UnshardedBytesTracker`` over the configuration's own units): a
    measurement of FSDP's own buffers, not an estimate;
  - losses.
All configurations start from the same weights and see the same batches, rotated in
order every step so that machine load hits them alike. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_ext
from examples.model import ModelConfig, Transformer
from fsdp_ext.testing import CountingAllGather, CountingReduceScatter, fsdp_units

WORLD, PP = 4, 2
# name -> (pp, build_pipeline kwargs); ZeRO stage equivalents are in docs/pipeline.md
CONFIGS: dict[str, tuple[int, dict]] = {
    "deferred_fp32": (PP, dict(grad_sync="deferred")),
    "naive_fp32": (PP, dict(grad_sync="per_microbatch", reshard_after_forward=True)),
    "per_microbatch_fp32": (PP, dict(grad_sync="per_microbatch")),
    "per_microbatch_loco": (PP, dict(grad_sync="per_microbatch", comm="loco")),
    "deferred_reshard": (PP, dict(grad_sync="deferred", reshard_after_forward=True)),
    "fsdp_only_dp4": (1, {}),
}
FP32 = ("deferred_fp32", "naive_fp32", "per_microbatch_fp32", "deferred_reshard", "fsdp_only_dp4")


def _model_config(quick: bool) -> ModelConfig:
    dim = 128 if quick else 256
    return ModelConfig(
        vocab_size=256,
        dim=dim,
        n_layers=8,
        n_heads=4,
        hidden_dim=3 * dim,
        max_seq_len=64,
        num_experts=0,
    )


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Runner:
    """One configuration on this rank: its model parts, schedule, counters and meter."""

    def __init__(self, name: str, n_microbatches: int, cfg: ModelConfig):
        pp, kwargs = CONFIGS[name]
        self.name = name
        self.dims = fsdp_ext.ParallelDims(WORLD, pp=pp)
        self.dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = Transformer(cfg)
        self.rs, self.ag = CountingReduceScatter(), CountingAllGather()
        self.loco = kwargs.get("comm") == "loco"
        if pp > 1:
            kwargs = {**kwargs, "comm": fsdp_ext.LoCoConfig() if self.loco else self.rs}
            self.schedule, self.stages = fsdp_ext.build_pipeline(
                model,
                self.dims,
                schedule="1F1B",
                n_microbatches=n_microbatches,
                loss_fn=_loss,
                **kwargs,
            )
            self.parts = [s.submod for s in self.stages]
        else:
            fsdp_ext.shard_by_policy(
                model, auto_wrap_policy=fsdp_ext.GranularityPolicy(), mesh=self.dims.dp_mesh
            )
            for _, m in fsdp_units(model):
                m.set_custom_reduce_scatter(self.rs)
            self.schedule, self.stages, self.parts = None, [], [model]
        for part in self.parts:
            for _, m in fsdp_units(part):
                m.set_custom_all_gather(self.ag)
        self.units = sum(len(fsdp_units(part)) for part in self.parts)
        self.opt = torch.optim.AdamW([p for part in self.parts for p in part.parameters()], lr=1e-3)
        self.meter = fsdp_ext.UnshardedBytesTracker(self.parts)
        self.records: list[dict] = []

    def step(self, x, y, measure: bool) -> None:
        local = x.shape[0] // self.dims.dp
        dp_rank = self.dims.dp_flat_mesh.get_local_rank()
        x, y = (
            x[dp_rank * local : (dp_rank + 1) * local],
            y[dp_rank * local : (dp_rank + 1) * local],
        )
        handles = [s.comm_handle for s in self.stages if s.comm_handle is not None]
        self.rs.reset()
        self.ag.reset()
        for h in handles:
            h.reset_stats()
        dist.barrier()
        t0 = time.perf_counter()
        with self.meter if measure else contextlib.nullcontext():
            if self.schedule is not None:
                losses = fsdp_ext.pipeline_step(self.schedule, self.stages, x, y)
                loss = fsdp_ext.reduce_pipeline_loss(losses, self.stages, self.dims)
            else:
                out = _loss(self.parts[0](x), y)
                out.backward()
                loss = out.detach()
                dist.all_reduce(loss)
                loss = float(loss) / self.dims.dp
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        rs_calls = sum(h.stats.reductions for h in handles) if self.loco else self.rs.calls
        rs_bytes = sum(h.stats.bytes_sent for h in handles) if self.loco else self.rs.wire_bytes
        self.records.append(
            dict(
                ms=float(elapsed) * 1e3,
                loss=loss,
                rs=rs_calls,
                ag=self.ag.calls,
                rs_bytes=rs_bytes,
                ag_bytes=self.ag.wire_bytes,
            )
        )


def rank_run(microbatches: list[int], steps: int, warmup: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    cfg = _model_config(quick)
    g = torch.Generator().manual_seed(1)
    batch = 16
    data = [
        (
            torch.randint(0, 256, (batch, 64), generator=g),
            torch.randint(0, 256, (batch, 64), generator=g),
        )
        for _ in range(warmup + steps)
    ]
    results = {}
    for m in microbatches:
        runners = [Runner(name, m, cfg) for name in CONFIGS]
        for i, (x, y) in enumerate(data):
            order = runners[i % len(runners) :] + runners[: i % len(runners)]
            for r in order:
                r.step(x, y, measure=i >= warmup)
        for r in runners:
            timed = r.records[warmup:]
            results[f"{r.name}@M{m}"] = {
                "n_microbatches": m,
                "pp": r.dims.pp,
                "units_per_rank": r.units,
                "step_ms": round(statistics.median(t["ms"] for t in timed), 2),
                "all_gathers_per_step": statistics.median(t["ag"] for t in timed),
                "reduce_scatters_per_step": statistics.median(t["rs"] for t in timed),
                "rs_wire_bytes_per_step": statistics.median(t["rs_bytes"] for t in timed),
                "ag_wire_bytes_per_step": statistics.median(t["ag_bytes"] for t in timed),
                "peak_unsharded_param_bytes": r.meter.peak_param_bytes,
                "peak_unsharded_grad_bytes": r.meter.peak_grad_bytes,
                "peak_unsharded_param_plus_grad_bytes": r.meter.peak_bytes,
                "losses": [round(t["loss"], 6) for t in r.records],
            }
    return results


def _max_over_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's row, with per-rank quantities replaced by their max over ranks."""
    out = {}
    for key, row in per_rank[0].items():
        merged = dict(row)
        for field in (
            "peak_unsharded_param_bytes",
            "peak_unsharded_grad_bytes",
            "peak_unsharded_param_plus_grad_bytes",
            "rs_wire_bytes_per_step",
            "ag_wire_bytes_per_step",
            "all_gathers_per_step",
            "reduce_scatters_per_step",
        ):
            merged[field] = max(r[key][field] for r in per_rank)
        out[key] = merged
    return out


def plot(summary: dict, path: str) -> None:
    """Wire bytes against peak unsharded bytes per rank, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ms = sorted({row["n_microbatches"] for row in summary["configs"].values()})
    for ax, m in zip(axes, ms, strict=False):
        for name in CONFIGS:
            row = summary["configs"][f"{name}@M{m}"]
            wire = (row["rs_wire_bytes_per_step"] + row["ag_wire_bytes_per_step"]) / 2**20
            peak = row["peak_unsharded_param_plus_grad_bytes"] / 2**20
            ax.scatter(wire, peak, s=40)
            ax.annotate(
                f"{name}\n{row['step_ms']:.0f} ms",
                (wire, peak),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_title(f"M = {m} microbatches (pp=2 x dp=2; FSDP-only: dp=4)")
        ax.set_xlabel("dp wire bytes per step per rank (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("peak unsharded param + grad (MiB per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--quick", action="store_true", help="smaller model, 3 timed steps")
    parser.add_argument("--plot", help="save the bytes-vs-memory figure here")
    parser.add_argument("--from-json", help="re-plot a saved last line instead of running")
    args = parser.parse_args(argv)
    if args.from_json:
        summary = json.loads(Path(args.from_json).read_text().strip().splitlines()[-1])
        plot(summary, args.plot or "pipeline.png")
        return summary
    microbatches = [int(m) for m in args.microbatches.split(",")]
    if any(m not in (4, 8) for m in microbatches):
        parser.error("--microbatches: values must be 4 or 8 (16 sequences over dp=2)")
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    from fsdp_ext.testing import run_distributed

    t0 = time.perf_counter()
    per_rank = run_distributed(
        rank_run, WORLD, microbatches, steps, warmup, args.quick, timeout=1800
    )
    configs = _max_over_ranks(per_rank)
    for key, row in configs.items():
        print(key, json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    m = 4 if 4 in microbatches else microbatches[0]
    at = {name: configs[f"{name}@M{m}"] for name in CONFIGS}
    fp32_losses = [configs[f"{n}@M{mm}"]["losses"] for n in FP32 for mm in microbatches]
    loss_spread = max(
        max(abs(a - b) for a, b in zip(ls, fp32_losses[0], strict=True)) for ls in fp32_losses
    )
    summary = {
        "bench": "pipeline",
        "configs": configs,
        "n_microbatches_for_ratios": m,
        "reduce_scatters_per_step_deferred": at["deferred_fp32"]["reduce_scatters_per_step"],
        "speedup_deferred_vs_naive": round(
            at["naive_fp32"]["step_ms"] / at["deferred_fp32"]["step_ms"], 3
        ),
        "bytes_ratio_per_microbatch_loco_vs_deferred_fp32": round(
            at["per_microbatch_loco"]["rs_wire_bytes_per_step"]
            / at["deferred_fp32"]["rs_wire_bytes_per_step"],
            4,
        ),
        "grad_bytes_ratio_per_microbatch_vs_deferred": round(
            at["per_microbatch_loco"]["peak_unsharded_grad_bytes"]
            / at["deferred_fp32"]["peak_unsharded_grad_bytes"],
            4,
        ),
        "max_fp32_loss_diff": loss_spread,
        "losses_identical": loss_spread <= 1e-5,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.plot:
        plot(summary, args.plot)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
