"""Benchmark auto-wrap policies on a fine-grained Qwen2-MoE-like model, 2 gloo ranks.

Policies, all through ``fsdp_ext.shard_by_policy`` on the same model and data:
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

Budget sweep: per-block units (``{DecoderLayer}``) against
``GranularityPolicy(memory_budget_bytes=B)`` for B = 2.5, 4.5, 8.5 decoder layers' bytes,
interleaved and rotated the same way, with the measured peak of live unsharded
parameters and gradients (``UnshardedBytesTracker``, on an untimed first step).

    python benchmarks/wrap.py --quick          # 4 layers x 64 experts, no plot
    python benchmarks/wrap.py                  # 8 layers; budget sweep plot
    python benchmarks/wrap.py --growth         # and growth over 16/64/128 experts
    python benchmarks/wrap.py --quick --norm decomposed   # leaf's last bits differ
    python benchmarks/wrap.py --hf              # only: HF Llama / Mixtral, ours vs torch per layer
    python benchmarks/wrap.py --hf --quick      # the tiny HF configs only

HF configs (``--hf``; built from a config, nothing downloaded): ``LlamaForCausalLM`` and
``MixtralForCausalLM``, tiny and about 100M parameters, on 4 gloo ranks. Each is sharded
three times from the same initial weights: ``default``, ``fsdp_ext.shard_by_policy`` with
``GranularityPolicy()``; ``torch_per_layer``, torch's own ``fully_shard`` per decoder layer
and then the root, as the PyTorch tutorials write it; ``torch_same_plan``, the same with the
last layer kept gathered after forward (torchtitan's former default, and our plan on these
models). All train on the same batches, steps interleaved and rotated as above.
``default_over_torch_per_layer_<config>`` and ``default_over_torch_same_plan_<config>`` are
paired medians (the median over batches of our step over theirs; the steps of one batch run
back to back). ``--burners N`` runs N busy processes beside it (the loaded condition).

The model's RMSNorm is fused (one backward node) by default. ``--norm decomposed`` uses
the eager form, whose input gets two gradients; FSDP2's node on a norm unit's input then
regroups a float sum, so ``leaf`` differs from the others in the last bits (docs/wrap.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import multiprocessing
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
from benchmarks.wrap_torch import torch_per_layer
from fsdp_ext.testing import WireCounter, fsdp_units, run_distributed

WORLD = 2


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


def _collectives(counter: WireCounter) -> dict[str, int]:
    """All-gather and reduce-scatter calls so far (``fsdp_ext.testing.WireCounter``)."""
    return {kind: counter.calls.get(kind, 0) for kind in ("all_gather", "reduce_scatter")}


def _batch(cfg: FineMoEConfig, rank: int, step: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _step(run: dict, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = run["model"](tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    run["optim"].step()
    run["optim"].zero_grad()
    elapsed = time.perf_counter() - start
    run["losses"].append(loss.item())
    return elapsed


def _run_policies(
    cfg: FineMoEConfig, policies: dict[str, object], steps: int, warmup: int, seq: int
) -> dict[str, dict]:
    """Build, shard and train every policy's model on the same batches, interleaved.

    Step 0 of every policy runs under ``UnshardedBytesTracker`` (the measured peak) and
    is not timed; then ``warmup`` untimed and ``steps`` timed steps, the policy order
    rotating every step.
    """
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    counter = WireCounter().open()  # for the whole rank
    runs = {}
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = FineMoE(cfg)
        plan = fsdp_ext.plan_units(model, policy)
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
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
    tokens = _batch(cfg, rank, 0, 2, seq)
    for run in runs.values():
        with fsdp_ext.UnshardedBytesTracker() as tracker:
            _step(run, tokens)
        run["measured_peak"] = tracker.peak_bytes
    names = list(runs)
    gc.disable()
    for step in range(1, 1 + warmup + steps):
        tokens = _batch(cfg, rank, step, 2, seq)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            gc.collect()
            dist.barrier()
            before = _collectives(counter)
            elapsed = _step(run, tokens)
            after = _collectives(counter)
            if step > warmup:
                run["times"].append(elapsed)
                run["gathers"] += after["all_gather"] - before["all_gather"]
                run["scatters"] += after["reduce_scatter"] - before["reduce_scatter"]
    gc.enable()
    return {
        name: {
            "units": len(run["plan"].units),
            "grouped_units": sum(len(g) > 1 for g in run["plan"].modules),
            "all_gathers_per_step": run["gathers"] / steps,
            "reduce_scatters_per_step": run["scatters"] / steps,
            "step_times_s": run["times"],
            "est_peak_unsharded_bytes": run["plan"].peak_bytes,
            "measured_peak_bytes": run["measured_peak"],
            "modelled_cost_ms": None
            if run["plan"].cost_s is None
            else round(1000 * run["plan"].cost_s, 3),
            "threshold": run["plan"].threshold,
            "losses": run["losses"],
        }
        for name, run in runs.items()
    }


HF_WORLD = 4
HF_MIN_TIMED_S = 5.0  # per path: a tiny config's 70 ms steps are scheduler noise one by one
HF_MAX_STEPS = 200
HF_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
HF_100M = dict(
    vocab_size=32000,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
HF_CONFIGS = {  # name: (family, config kwargs, sequences per rank, tokens per sequence)
    "llama_tiny": ("llama", HF_TINY, 2, 32),
    "mixtral_tiny": ("mixtral", {**HF_TINY, "num_local_experts": 4}, 2, 32),
    # 8 x 6.3M per layer + 2 x 24.6M embedding and head: 99M parameters
    "llama_100m": (
        "llama",
        {**HF_100M, "hidden_size": 768, "num_hidden_layers": 8, "intermediate_size": 2048},
        1,
        32,
    ),
    # 6 x 12.9M per layer (8 experts) + 2 x 16.4M: 110M parameters
    "mixtral_100m": (
        "mixtral",
        {
            **HF_100M,
            "hidden_size": 512,
            "num_hidden_layers": 6,
            "intermediate_size": 1024,
            "num_local_experts": 8,
        },
        1,
        32,
    ),
}


def hf_model(name: str) -> torch.nn.Module:
    """The named HF causal LM, built from its config (random weights, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    family, kwargs, _, _ = HF_CONFIGS[name]
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kwargs))
    return MixtralForCausalLM(MixtralConfig(**kwargs, num_experts_per_tok=2))


HF_PATHS = ("default", "torch_per_layer", "torch_same_plan")


def _shard_hf(path: str, model: torch.nn.Module, mesh) -> None:
    """``default``: ``fsdp_ext.shard_by_policy`` with ``GranularityPolicy()`` (our plan);
    ``torch_per_layer``: torch's ``fully_shard`` per decoder layer, then the root, as the
    tutorials write it; ``torch_same_plan``: the same with the last layer kept gathered after
    forward (torchtitan's former default), which is our plan on these models."""
    if path == "default":
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=fsdp_ext.GranularityPolicy(), mesh=mesh)
    else:
        torch_per_layer(model, mesh, keep_last=path == "torch_same_plan")


def _hf_rank(name: str, steps: int, warmup: int) -> dict:
    """Our default against torch's per-layer fully_shard on one HF config: same weights,
    same batches, steps interleaved and rotated."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (HF_WORLD,))
    _, kwargs, batch, seq = HF_CONFIGS[name]
    runs = {}
    for path in HF_PATHS:
        torch.manual_seed(0)
        model = hf_model(name)
        _shard_hf(path, model, mesh)
        runs[path] = {
            "model": model,
            # plain SGD: no optimizer state, so three copies of a 100M model fit on 4 ranks
            "optim": torch.optim.SGD(model.parameters(), lr=1e-2),
            "times": [],
            "losses": [],
            "wire": {},
        }
    vocab = kwargs["vocab_size"]
    counter = WireCounter().open()  # for the whole rank

    def step(run: dict, tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        logits = run["model"](tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        run["optim"].step()
        run["optim"].zero_grad()
        run["losses"].append(loss.item())
        return time.perf_counter() - start

    names = list(runs)
    gc.disable()
    warm_s = []

    def round_of_steps(i: int) -> None:
        g = torch.Generator().manual_seed(10_000 * i + rank)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        shift = i % len(names)
        for path in names[shift:] + names[:shift]:
            run = runs[path]
            gc.collect()
            dist.barrier()
            before = _wire(counter)
            elapsed = step(run, tokens)
            if i >= warmup:
                run["times"].append(elapsed)
                for key, value in _wire(counter).items():
                    run["wire"][key] = run["wire"].get(key, 0) + value - before[key]
            else:
                warm_s.append(elapsed)

    for i in range(warmup):
        round_of_steps(i)
    steps = timed_steps(steps, warm_s)
    for i in range(warmup, warmup + steps):
        round_of_steps(i)
    gc.enable()
    counter.close()
    return {
        path: {
            "units": [fqn or "<root>" for fqn, _ in fsdp_units(run["model"])],
            "params": sum(p.numel() for p in run["model"].parameters()),
            "times": run["times"],
            "losses": run["losses"],
            **{key: value / len(run["times"]) for key, value in run["wire"].items()},
        }
        for path, run in runs.items()
    }


def timed_steps(steps: int, warm_s: list[float]) -> int:
    """At least ``steps``, and enough that each path's timed steps take ``HF_MIN_TIMED_S``
    at the warm-up's pace (the slowest rank's, so every rank runs the same count)."""
    pace = torch.tensor([statistics.median(warm_s) if warm_s else 0.0], dtype=torch.float64)
    dist.all_reduce(pace, op=dist.ReduceOp.MAX)
    if float(pace) <= 0:
        return steps
    return max(steps, min(HF_MAX_STEPS, math.ceil(HF_MIN_TIMED_S / float(pace))))


WIRE_KEYS = (
    "all_gathers_per_step",
    "reduce_scatters_per_step",
    "all_gather_bytes_per_step",
    "reduce_scatter_bytes_per_step",
)


def _wire(counter: WireCounter) -> dict[str, int]:
    """Calls and bytes sent so far, by :data:`WIRE_KEYS` (totals, not yet per step)."""
    return {
        "all_gathers_per_step": counter.calls.get("all_gather", 0),
        "reduce_scatters_per_step": counter.calls.get("reduce_scatter", 0),
        "all_gather_bytes_per_step": counter.sent.get("all_gather", 0),
        "reduce_scatter_bytes_per_step": counter.sent.get("reduce_scatter", 0),
    }


def _paired_median(ours: list[float], base: list[float]) -> float:
    """The median of per-batch ratios: the steps of one batch run back to back, so each
    ratio sees one load."""
    return round(statistics.median(o / b for o, b in zip(ours, base, strict=True)), 3)


def run_hf(names: list[str], steps: int, warmup: int) -> dict:
    """Per config and path: units, collectives and bytes per step, median step ms (slowest
    rank per step); ours over each torch baseline, by medians and paired."""
    out = {}
    for name in names:
        ranks = run_distributed(_hf_rank, HF_WORLD, name, steps, warmup, timeout=3600)
        row = {"params": ranks[0]["default"]["params"]}  # DTensors report global numel
        timed = len(ranks[0]["default"]["times"])  # steps, or more for a fast config
        row["timed_steps"] = timed
        for path in HF_PATHS:
            per_step = [max(r[path]["times"][i] for r in ranks) for i in range(timed)]
            mine = ranks[0][path]
            row[path] = {
                "units": mine["units"],
                "median_step_ms": round(1000 * statistics.median(per_step), 1),
                "step_ms": [round(1000 * t, 1) for t in per_step],
                **{key: mine[key] for key in WIRE_KEYS},
            }
        row["losses_identical"] = all(
            r[path]["losses"] == r["default"]["losses"] for r in ranks for path in HF_PATHS
        )
        for base in ("torch_per_layer", "torch_same_plan"):
            row[f"default_over_{base}_medians"] = round(
                row["default"]["median_step_ms"] / row[base]["median_step_ms"], 3
            )
            row[f"default_over_{base}"] = _paired_median(
                row["default"]["step_ms"], row[base]["step_ms"]
            )
        row["same_collectives_as_same_plan"] = all(
            row["default"][k] == row["torch_same_plan"][k] for k in ("units", *WIRE_KEYS)
        )
        d = row["default"]
        print(
            f"{name}: {row['params'] / 1e6:.1f}M params, units {d['units']}; median ms "
            + ", ".join(f"{p} {row[p]['median_step_ms']}" for p in HF_PATHS)
            + f"; ours / torch per layer {row['default_over_torch_per_layer']} paired "
            f"({row['default_over_torch_per_layer_medians']} by medians), / same plan "
            f"{row['default_over_torch_same_plan']} ({row['default_over_torch_same_plan_medians']})"
            f"; all-gathers per step {d['all_gathers_per_step']} vs "
            f"{row['torch_per_layer']['all_gathers_per_step']} (tutorial loop)",
            flush=True,
        )
        out[name] = row
    return out


def _burn() -> None:
    """A CPU burner beside the benchmark (``--burners``): a loop that never sleeps."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


@contextlib.contextmanager
def burners(n: int):
    """``n`` busy processes for as long as the block runs (the loaded condition)."""
    procs = [
        multiprocessing.get_context("spawn").Process(target=_burn, daemon=True) for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


def _layer_bytes(cfg: FineMoEConfig) -> tuple[int, int]:
    with torch.device("meta"):
        meta = FineMoE(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    return model_bytes, sum(p.numel() * p.element_size() for p in meta.layers[0].parameters())


def _bench_rank(cfg_dict: dict, budget_layers: float, steps: int, warmup: int, seq: int):
    cfg = FineMoEConfig(**cfg_dict)
    model_bytes, layer_bytes = _layer_bytes(cfg)
    budget = int(budget_layers * layer_bytes)
    policies = _run_policies(cfg, make_policies(budget), steps, warmup, seq)
    return {"budget_bytes": budget, "model_bytes": model_bytes, "policies": policies}


def _sweep_rank(cfg_dict: dict, budgets: list[float], steps: int, warmup: int, seq: int):
    cfg = FineMoEConfig(**cfg_dict)
    model_bytes, layer_bytes = _layer_bytes(cfg)
    policies = {"block": {DecoderLayer}}
    for layers in budgets:
        budget = int(layers * layer_bytes)
        policies[f"budget_{layers}"] = fsdp_ext.GranularityPolicy(memory_budget_bytes=budget)
    results = _run_policies(cfg, policies, steps, warmup, seq)
    return {"layer_bytes": layer_bytes, "model_bytes": model_bytes, "policies": results}


def _median_step_ms(ranks: list[dict], name: str, steps: int) -> float:
    # A step takes as long as its slowest rank.
    per_step = [max(r["policies"][name]["step_times_s"][i] for r in ranks) for i in range(steps)]
    return round(1000 * statistics.median(per_step), 2)


def run_sweep(cfg: FineMoEConfig, budgets: list[float], steps: int, warmup: int, seq: int):
    """Per-block units against our plan at each budget (in decoder layers' bytes)."""
    ranks = run_distributed(
        _sweep_rank, WORLD, asdict(cfg), budgets, steps, warmup, seq, timeout=3600
    )
    block = ranks[0]["policies"]["block"]
    block_ms = _median_step_ms(ranks, "block", steps)
    rows = []
    for layers in budgets:
        name = f"budget_{layers}"
        ours = ranks[0]["policies"][name]
        budget = int(layers * ranks[0]["layer_bytes"])
        measured = max(r["policies"][name]["measured_peak_bytes"] for r in ranks)
        ms = _median_step_ms(ranks, name, steps)
        rows.append(
            {
                "budget_layers": layers,
                "budget_bytes": budget,
                "ours": {
                    "units": ours["units"],
                    "grouped_units": ours["grouped_units"],
                    "all_gathers_per_step": ours["all_gathers_per_step"],
                    "reduce_scatters_per_step": ours["reduce_scatters_per_step"],
                    "est_peak_bytes": ours["est_peak_unsharded_bytes"],
                    "measured_peak_bytes": measured,
                    "modelled_cost_ms": ours["modelled_cost_ms"],
                    "median_step_ms": ms,
                },
                "peak_within_budget": measured <= budget,
                "step_ratio_vs_block": round(ms / block_ms, 3),
                "losses_identical_to_block": all(
                    r["policies"][name]["losses"] == r["policies"]["block"]["losses"] for r in ranks
                ),
            }
        )
    return {
        "layers": cfg.n_layers,
        "num_experts": cfg.num_experts,
        "layer_bytes": ranks[0]["layer_bytes"],
        "block": {
            "units": block["units"],
            "all_gathers_per_step": block["all_gathers_per_step"],
            "reduce_scatters_per_step": block["reduce_scatters_per_step"],
            "est_peak_bytes": block["est_peak_unsharded_bytes"],
            "measured_peak_bytes": max(
                r["policies"]["block"]["measured_peak_bytes"] for r in ranks
            ),
            "median_step_ms": block_ms,
        },
        "budgets": rows,
    }


def _print_sweep(sweep: dict) -> None:
    b = sweep["block"]
    print(
        f"\nbudget sweep: layers={sweep['layers']} experts/layer={sweep['num_experts']} "
        f"layer={sweep['layer_bytes']} B; per-block: {b['units']} units, "
        f"{b['all_gathers_per_step']:.0f} AG + {b['reduce_scatters_per_step']:.0f} RS/step, "
        f"measured peak {b['measured_peak_bytes']} B, {b['median_step_ms']} ms"
    )
    print(
        f"{'budget':>7} {'units':>6} {'grouped':>8} {'AG':>4} {'RS':>4} {'est peak':>10} "
        f"{'meas peak':>10} {'budget B':>10} {'model ms':>9} {'step ms':>8} {'ratio':>6} same"
    )
    for row in sweep["budgets"]:
        o = row["ours"]
        print(
            f"{row['budget_layers']:>7} {o['units']:>6} {o['grouped_units']:>8} "
            f"{o['all_gathers_per_step']:>4.0f} {o['reduce_scatters_per_step']:>4.0f} "
            f"{o['est_peak_bytes']:>10} {o['measured_peak_bytes']:>10} {row['budget_bytes']:>10} "
            f"{o['modelled_cost_ms']:>9} {o['median_step_ms']:>8} {row['step_ratio_vs_block']:>6} "
            f"{row['losses_identical_to_block']}",
            flush=True,
        )


def run_config(cfg: FineMoEConfig, budget_layers: float, steps: int, warmup: int, seq: int):
    ranks = run_distributed(
        _bench_rank, WORLD, asdict(cfg), budget_layers, steps, warmup, seq, timeout=3600
    )
    result = ranks[0]
    policies = {}
    for name, stats in result["policies"].items():
        final = [r["policies"][name]["losses"][-1] for r in ranks]
        policies[name] = {
            "units": stats["units"],
            "all_gathers_per_step": stats["all_gathers_per_step"],
            "reduce_scatters_per_step": stats["reduce_scatters_per_step"],
            "median_step_ms": _median_step_ms(ranks, name, steps),
            "measured_peak_bytes": max(r["policies"][name]["measured_peak_bytes"] for r in ranks),
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
        "granularity_peak_within_budget": policies["granularity"]["measured_peak_bytes"]
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


def _plot_budgets(sweep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [r["budget_layers"] for r in sweep["budgets"]]
    ours = [r["ours"]["median_step_ms"] for r in sweep["budgets"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, ours, "o-", label="GranularityPolicy(memory_budget_bytes)")
    ax.axhline(sweep["block"]["median_step_ms"], color="C1", ls="--", label="per-block units")
    for b, ms, row in zip(budgets, ours, sweep["budgets"], strict=True):
        ax.annotate(
            f"{row['ours']['units']} units", (b, ms), textcoords="offset points", xytext=(4, 6)
        )
    ax.set(
        xlabel="memory budget (decoder layers' parameter bytes)",
        ylabel="median step ms",
        title=f"FineMoE {sweep['layers']} layers x {sweep['num_experts']} experts, 2 gloo ranks",
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[2.5, 4.5, 8.5],
        help="budget sweep: per-block units against our plan at each budget (layers' bytes)",
    )
    parser.add_argument("--budget-plot", default="docs/wrap_budget.png")
    parser.add_argument("--growth", action="store_true", help="also sweep experts per layer")
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the budget sweep (skip leaf/block/granularity/fsdp1_transformer)",
    )
    parser.add_argument("--sweep", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument(
        "--norm",
        choices=("fused", "decomposed"),
        default="fused",
        help="RMSNorm with one backward node (as on GPUs) or the decomposed eager form",
    )
    parser.add_argument("--plot", default="docs/wrap_growth.png")
    parser.add_argument(
        "--hf", action="store_true", help="only the HF configs: ours vs torch per layer, 4 ranks"
    )
    parser.add_argument(
        "--hf-steps", type=int, default=6, help="timed steps per policy (6; more for a fast config)"
    )
    parser.add_argument(
        "--burners", type=int, default=0, help="--hf: busy processes beside it (loaded runs)"
    )
    parser.add_argument(
        "--hf-configs", nargs="+", default=None, help=f"a subset of {list(HF_CONFIGS)}"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.burners < 0:
        parser.error(f"--burners must be >= 0, got {args.burners}")
    layers = args.layers or (4 if args.quick else 8)
    if args.hf:
        names = args.hf_configs or [n for n in HF_CONFIGS if n.endswith("_tiny") or not args.quick]
        unknown = sorted(set(names) - set(HF_CONFIGS))
        if unknown:
            parser.error(f"--hf-configs must be among {list(HF_CONFIGS)}, got {unknown}")
        with burners(args.burners):
            hf = run_hf(names, args.hf_steps, args.warmup)
        summary = {"bench": "wrap_hf", "world_size": HF_WORLD, "burners": args.burners}
        summary["configs"] = hf
        for base in ("torch_per_layer", "torch_same_plan"):
            for n, r in hf.items():
                summary[f"default_over_{base}_{n}"] = r[f"default_over_{base}"]
            summary[f"default_over_{base}_max"] = max(
                r[f"default_over_{base}"] for r in hf.values()
            )
        print(json.dumps(summary))
        return summary

    def measure(experts: int) -> dict:
        cfg = FineMoEConfig(n_layers=layers, num_experts=experts, fused_norm=args.norm == "fused")
        return run_config(cfg, args.budget_layers, args.steps, args.warmup, args.seq)

    summary: dict = {"bench": "wrap"}
    if not args.sweep_only:
        main_result = measure(args.experts)
        _print_table(main_result)
        summary.update(main_result)
    cfg = FineMoEConfig(n_layers=layers, num_experts=args.experts, fused_norm=args.norm == "fused")
    sweep = run_sweep(cfg, sorted(args.budgets), args.steps, args.warmup, args.seq)
    _print_sweep(sweep)
    if not args.quick:
        _plot_budgets(sweep, args.budget_plot)
    best = sweep["budgets"][-1]
    summary["budget_sweep"] = sweep
    summary["step_ratio_best_budget_vs_block"] = best["step_ratio_vs_block"]
    summary["step_ratio_max_over_budgets"] = max(r["step_ratio_vs_block"] for r in sweep["budgets"])
    summary["measured_peak_bytes_best_budget"] = best["ours"]["measured_peak_bytes"]
    summary["budget_bytes_best_budget"] = best["budget_bytes"]
    summary["peak_within_budget_all"] = all(r["peak_within_budget"] for r in sweep["budgets"])
    summary["losses_identical_all_budgets"] = all(
        r["losses_identical_to_block"] for r in sweep["budgets"]
    )
    if args.growth and not args.quick and not args.sweep_only:
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
