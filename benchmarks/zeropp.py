"""Benchmark: the ZeRO++ stack (LoCo 4-bit hierarchical + qwZ + hpZ) against stock fp32 FSDP.

    python benchmarks/zeropp.py                    # 4 ranks as 2 nodes x 2, 3 seeds
    python benchmarks/zeropp.py --steps 20 --seeds 0 --modes zeropp hpz qwz loco_hierarchical

Both modes train the example LM (examples/train.py) from the same seed on the same batches,
on 4 gloo ranks that emulate 2 nodes of 2 (``--intra-node-size 2``). Each rank wraps every
all-gather, reduce-scatter and all-to-all with ``fsdp_ext.testing.WireCounter`` (a ring
all-gather: ``(g - 1) x`` its input; a reduce-scatter: ``(g - 1) / g`` of it; an all-to-all:
the rows for other ranks, for a group of ``g`` ranks), split by whether the group lies
inside one emulated node. Those counts are checked against the per-collective formula
of docs/comm.md computed from FSDP's own shard sizes. The validation-loss gap of ZeRO++ to
fp32 is averaged over seeds (mean and standard error).

The last line printed is one JSON object; ``val_loss_gap_zeropp`` is in percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from examples.train import TrainConfig, parallelize, train  # noqa: E402
from fsdp_ext.testing import WireCounter, fsdp_units, run_distributed  # noqa: E402

WORLD, NODE = 4, 2
MODES = {
    "fp32": {"comm": "stock"},
    "zeropp": {"comm": "loco", "intra_node_size": NODE, "qwz": True, "hpz": True, "zeropp": True},
    # one part at a time: hpZ alone moves bytes, not values (bit-identical to fp32)
    "hpz": {"comm": "stock", "intra_node_size": NODE, "hpz": True},
    "qwz": {"comm": "stock", "qwz": True},
    "loco_hierarchical": {"comm": "loco", "intra_node_size": NODE},
}
DEFAULT_MODES = ("fp32", "zeropp")
COUNTED = ("all_gather", "reduce_scatter", "all_to_all")  # the traffic ZeRO++ changes


def unit_shards(model) -> list[tuple[list[int], bool]]:
    """Per FSDP unit gathered over more than one rank: (each of its parameters' all-gather
    input on one rank, from the parameter's shape alone: dim 0 padded to a multiple of the
    unit's ranks, divided by them; whether the unit is the root). A unit of several modules
    counts its first module's parameters (the example makes none)."""
    units = fsdp_units(model)
    out = []
    for fqn, unit in units:
        prefix = f"{fqn}." if fqn else ""
        inner = [n for n, _ in units if n != fqn and n.startswith(prefix)]
        sizes = []
        for name, p in unit.named_parameters():
            if any((prefix + name).startswith(f"{n}.") for n in inner):
                continue  # a nested unit's parameter
            ranks = p.device_mesh.size()
            if ranks > 1:
                sizes.append(-(-p.shape[0] // ranks) * p.shape[1:].numel())
        if sizes:
            out.append((sizes, fqn == ""))
    return out


def _unit_payload(numels: list[int], group_size: int) -> int:
    groups = sum(-(-n // group_size) for n in numels)
    return groups * group_size + 16 * -(-groups // 4)


def predicted_bytes(
    shards: list[tuple[list[int], bool]], mode: str, group_size: int
) -> dict[str, int]:
    """The formulas of docs/comm.md: bytes this rank sends per step, per collective.

    Per unit, ``n = sum_i n_i`` its shard (elements; ``n_i`` a parameter's); ``W`` ranks,
    ``r`` per node, ``N = W / r`` nodes. fp32: all-gather ``(W - 1) 4n`` in forward and
    again in backward (the root once: FSDP keeps it gathered), reduce-scatter ``(W - 1) 4n``.
    ZeRO++: forward all-gather ``(W - 1) (g G + 16 ceil(g / 4))`` with ``g = sum_i ceil(n_i /
    G)`` (qwZ, one payload per unit: int8 codes in groups of one parameter's G values, then
    an fp32 scale per group, the scales padded to 16 bytes); backward all-gather in the
    node ``(r - 1) N 4n`` (hpZ: the fp32 node copy; the root too); reduce-scatter in the
    node ``(r - 1) N 4n`` (LoCo's full-precision stage), then across nodes an all-to-all
    of ``(N - 1) ceil(n / 128) 68`` (4-bit codes and a scale per 128).
    """
    w, r = WORLD, NODE
    nodes = w // r
    if mode == "fp32":
        gathers = sum((w - 1) * 4 * sum(p) * (1 if root else 2) for p, root in shards)
        return {
            "all_gather_inter": gathers,
            "reduce_scatter_inter": sum((w - 1) * 4 * sum(p) for p, _ in shards),
        }
    payload = sum(_unit_payload(p, group_size) for p, _ in shards)
    sizes = [sum(p) for p, _ in shards]
    return {
        "all_gather_inter": (w - 1) * payload,
        "all_gather_intra": sum((r - 1) * nodes * 4 * n for n in sizes),
        "reduce_scatter_intra": sum((r - 1) * nodes * 4 * n for n in sizes),
        "all_to_all_inter": sum((nodes - 1) * -(-n // 128) * 68 for n in sizes),
    }


def _run_rank(cfg: TrainConfig, mode: str) -> dict:
    shards: list[tuple[list[int], bool]] = []
    wire = WireCounter(NODE)
    wire.paused = True  # counting starts after sharding (and its one-off probes): the steps

    def parallelize_and_measure(model, c, dims):
        par = parallelize(model, c, dims)
        shards.extend(unit_shards(model))
        wire.paused = False
        eval_step = par.eval_step

        def eval_unmeasured(x, y):
            wire.paused = True  # validation is not a training step
            return eval_step(x, y)

        par.eval_step = eval_unmeasured
        return par

    with wire:
        summary = train(cfg, parallelize=parallelize_and_measure)
    steps = len(summary["losses"])
    return {
        "mode": mode,
        "val_loss": summary["val_loss"],
        "losses": summary["losses"],
        "step_ms": summary["step_ms"],
        "bytes": {k: v for k, v in wire.by_scope.items() if k.rsplit("_", 1)[0] in COUNTED},
        "steps": steps,
        "shards": shards,
        "weight_stats": summary["weight_stats"],
        "comm_stats": summary["comm_stats"],
    }


def run(
    base: TrainConfig, seeds: list[int], modes: tuple[str, ...] = DEFAULT_MODES
) -> dict[str, list[dict]]:
    """Train ``base`` once per mode and seed on 4 ranks: {mode: [result per seed]}."""
    runs = {mode: [] for mode in modes}
    for seed in seeds:
        for mode in modes:
            t0 = time.perf_counter()
            cfg = replace(base, seed=seed, **MODES[mode])
            result = run_distributed(_run_rank, WORLD, cfg, mode, timeout=3600)[0]
            result["wall_s"] = time.perf_counter() - t0
            runs[mode].append(result)
            print(
                f"seed {seed} {mode:7s} val {result['val_loss']:.4f} "
                f"step {result['step_ms']:.0f} ms ({result['wall_s']:.0f} s)",
                flush=True,
            )
    return runs


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, se


def summarize(runs: dict[str, list[dict]], base: TrainConfig) -> dict:
    """Validation-loss gaps to fp32 per mode (percent, mean and standard error over seeds),
    bytes per step per collective (measured and predicted), median step times."""
    gaps = {
        mode: [
            100 * (r["val_loss"] / f["val_loss"] - 1)
            for f, r in zip(runs["fp32"], results, strict=True)
        ]
        for mode, results in runs.items()
        if mode != "fp32"
    }
    out = {
        "benchmark": "zeropp",
        "world": WORLD,
        "node_size": NODE,
        "steps": base.steps,
        "seeds": len(runs["fp32"]),
        "val_loss": {m: [r["val_loss"] for r in results] for m, results in runs.items()},
    }
    for mode, values in gaps.items():
        mean, se = mean_and_stderr(values)
        out[f"val_loss_gap_{mode}_per_seed"] = [round(g, 3) for g in values]
        out[f"val_loss_gap_{mode}"] = round(mean, 3)
        out[f"val_loss_gap_{mode}_stderr"] = round(se, 3)
    per_step, predicted = {}, {}
    for mode, results in runs.items():
        first = results[0]
        per_step[mode] = {k: v / first["steps"] for k, v in sorted(first["bytes"].items())}
        if mode in ("fp32", "zeropp"):
            predicted[mode] = predicted_bytes(first["shards"], mode, base.qwz_group_size)
    crossing = {m: sum(v for k, v in per_step[m].items() if k.endswith("inter")) for m in per_step}
    out["bytes_per_step"] = per_step
    out["bytes_per_step_predicted"] = predicted
    if "zeropp" in crossing:
        out["cross_node_bytes_ratio_zeropp_vs_fp32"] = round(
            crossing["zeropp"] / crossing["fp32"], 4
        )
    out["step_ms"] = {
        m: round(statistics.median(r["step_ms"] for r in results), 1) for m, results in runs.items()
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(DEFAULT_MODES),
        help="fp32 always runs (the baseline); the others one part of ZeRO++ at a time",
    )
    args = parser.parse_args(argv)
    modes = ("fp32", *(m for m in args.modes if m != "fp32"))
    base = TrainConfig(steps=args.steps, verbose=False, log_every=10**9)
    summary = summarize(run(base, args.seeds, modes), base)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
