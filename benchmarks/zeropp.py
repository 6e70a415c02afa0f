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

    python benchmarks/zeropp.py --limit            # the lab: 2 nodes x 2 at 25/50/100 Mbit/s

``--limit`` (root and the lab's tools, docs/cluster.md) runs the ZeRO++ job
(``examples/train.py --zeropp``) in the cluster lab (fsdp_ext.lab), in one run: once with
every rank on one node (the loopback step: compute, no link), then on 2 nodes of 2 behind
a tbf-capped link at each ``--rates`` rate, reading each node's link bytes per step from the
kernel's interface counter. The limit of a step at rate R is ``max(loopback step, link
bytes per node / R)``, the loopback step measured before and after the rates (their mean;
both are reported). ``zeropp_over_limit_<R>`` is the measured step over it (1.0: the
communication hides wholly behind compute, or the link is busy all the time). The link
bytes are checked against the hand formula of :func:`predicted_bytes` per node (a ring
all-gather crosses the node boundary once per node, ``(W - 1)`` payloads; each of the ``r``
ranks sends its own all-to-all rows across), from the shards of a one-step local run.

That limit pools the step's link time with all of its compute. The data do not allow it: a
forward's weight gathers need the weights the last optimizer step wrote, so they can hide
behind the forward's compute only. The rank program also times each forward (to the model's
forward returning) and reads the link bytes sent in it, and ``dependency_bound_ms_<R>`` is
``max(loopback forward, forward link time) + max(loopback rest, the rest's link time)``;
``zeropp_over_dependency_bound_<R>`` is the step over it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from benchmarks.cluster import forward_intervals_ms, run_job, step_intervals_ms  # noqa: E402
from benchmarks.cluster import summarize as summarize_lab  # noqa: E402
from examples.train import TrainConfig, parallelize, train  # noqa: E402
from fsdp_ext.lab import (  # noqa: E402
    Cluster,
    LabUnavailable,
    teardown_on_termination,
    unavailable_reason,
)
from fsdp_ext.testing import WireCounter, fsdp_units, run_distributed  # noqa: E402

LIMIT_RATES_MBIT = (25, 50, 100)
LIMIT_CONFIG = {"zeropp": ["--zeropp"]}  # examples/train.py's flags for the lab job
# --blocking: the same stack with every compressed collective blocking where FSDP calls it,
# trained beside it in the same job (a step each in turn)
BLOCKING_CONFIG = {**LIMIT_CONFIG, "zeropp_blocking": ["--zeropp", "--no-comm-overlap"]}

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


def node_link_formula(predicted: dict[str, int]) -> int:
    """Bytes one node sends over its link per step under ZeRO++, from the per-rank formula
    of :func:`predicted_bytes`: the ring all-gather over all ranks crosses the boundary once
    per node (a rank sending ``(W - 1)`` payloads to the next node's first rank); the
    all-to-all runs between the ranks of equal local index, each of a node's ``r`` ranks
    sending its rows for the other nodes. Everything else stays inside the node."""
    return predicted["all_gather_inter"] + NODE * predicted["all_to_all_inter"]


def _link_ms(nbytes: float, mbit: int) -> float:
    """Milliseconds that ``nbytes`` take on a link of ``mbit`` Mbit/s."""
    return nbytes * 8 / (mbit * 1e6) * 1e3


def dependency_bound_ms(
    loopback_ms: float, loopback_forward_ms: float, link_ms: float, forward_link_ms: float
) -> float:
    """The shortest step that the data allow: a forward's weight gathers need the weights
    the last optimizer step wrote, so the forward's link time can hide only behind the
    forward's compute, and the backward's (LoCo's all-to-all) behind the backward's and the
    optimizer's. ``max(loopback step, link)`` takes both as one pool; this bound cannot."""
    forward = max(loopback_forward_ms, forward_link_ms)
    return forward + max(loopback_ms - loopback_forward_ms, link_ms - forward_link_ms)


def limit_keys(
    loopback_ms: float,
    rows: dict[int, dict],
    formula_bytes: int,
    loopback_forward_ms: float | None = None,
) -> dict:
    """The ``--limit`` JSON keys from the loopback step (ms) and, per rate in Mbit/s, the lab
    run's median step (``step_ms``) and link bytes per step and node (``link_bytes``).
    With the loopback's forward (ms) and a row's ``forward_link_bytes`` (sent while the
    forward ran), also :func:`dependency_bound_ms` and the step over it."""
    out: dict = {
        "loopback_step_ms": round(loopback_ms, 1),
        "link_bytes_per_step_formula": formula_bytes,
    }
    if loopback_forward_ms is not None:
        out["loopback_forward_ms"] = round(loopback_forward_ms, 1)
    for mbit, row in sorted(rows.items()):
        link_ms = _link_ms(row["link_bytes"], mbit)
        limit = max(loopback_ms, link_ms)
        out[f"step_ms_{mbit}"] = round(row["step_ms"], 1)
        out[f"link_ms_{mbit}"] = round(link_ms, 1)
        out[f"link_bytes_per_step_{mbit}"] = round(row["link_bytes"])
        out[f"link_bytes_vs_formula_rel_err_{mbit}"] = round(
            abs(row["link_bytes"] - formula_bytes) / formula_bytes, 4
        )
        out[f"limit_ms_{mbit}"] = round(limit, 1)
        out[f"zeropp_over_limit_{mbit}"] = round(row["step_ms"] / limit, 4)
        if loopback_forward_ms is not None and "forward_link_bytes" in row:
            forward_link_ms = _link_ms(row["forward_link_bytes"], mbit)
            bound = dependency_bound_ms(loopback_ms, loopback_forward_ms, link_ms, forward_link_ms)
            out[f"forward_link_ms_{mbit}"] = round(forward_link_ms, 1)
            out[f"dependency_bound_ms_{mbit}"] = round(bound, 1)
            out[f"zeropp_over_dependency_bound_{mbit}"] = round(row["step_ms"] / bound, 4)
        if "cpu_floor_ms" in row:
            out[f"cpu_floor_ms_{mbit}"] = round(row["cpu_floor_ms"], 1)
            out[f"step_over_cpu_floor_{mbit}"] = round(row["step_ms"] / row["cpu_floor_ms"], 4)
    return out


def cpu_floor_ms(cpu_s_per_step: float) -> float:
    """Every rank's CPU per step spread over this machine's cores: the shortest step the
    cores allow, whatever overlaps (the lab's ranks and links share them)."""
    return cpu_s_per_step / len(os.sched_getaffinity(0)) * 1e3


def measure_limit(
    base: TrainConfig,
    rates: list[int],
    steps: int,
    warmup: int,
    timeout: float,
    blocking: bool = False,
) -> dict:
    """The ``--limit`` run: the loopback step, then each rate on 2 nodes x 2 (see the
    module doc); returns :func:`limit_keys` plus the load and the formula's inputs.
    ``blocking``: each rate's job also trains ``--no-comm-overlap`` beside it, a step each
    in turn, for ``blocking_over_overlap_<rate>`` (its median step over ours)."""
    reason = unavailable_reason(storage=False)
    if reason is not None:
        raise LabUnavailable(reason)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    local = run(replace(base, steps=1), [base.seed], ("zeropp",))["zeropp"][0]
    formula = node_link_formula(predicted_bytes(local["shards"], "zeropp", base.qwz_group_size))
    with tempfile.TemporaryDirectory(prefix="zeropp-limit-") as out_dir:
        common = ["--steps", str(steps), "--val-batches", "1", "--log-every", str(10**6)]
        common += ["--out", out_dir]

        def loopback() -> float:
            """Median step with every rank on one node (no link)."""
            with Cluster(1, WORLD, "1gbit", storage=False, timeout=timeout) as lab:
                records = run_job(lab, LIMIT_CONFIG, common, timeout, 1, 0)["zeropp"]
            ranks = records[0]
            lead = min(ranks, key=lambda r: r["rank"])
            cpu = sum(r["steps"][-1]["cpu"] - r["steps"][warmup]["cpu"] for r in ranks)
            span = len(lead["steps"]) - 1 - warmup
            loopback_floor.append(round(cpu_floor_ms(cpu / span), 1))
            loopback_forward.append(statistics.median(forward_intervals_ms(lead["steps"], warmup)))
            return statistics.median(step_intervals_ms(lead["steps"], warmup))

        loopback_floor: list[float] = []
        loopback_forward: list[float] = []
        loopback_each = [loopback()]
        rows, loads, compared = {}, {}, {}
        nodes = WORLD // NODE
        with Cluster(nodes, NODE, f"{rates[0]}mbit", storage=False, timeout=timeout) as lab:
            for mbit in rates:
                lab.set_link(f"{mbit}mbit")
                before = os.getloadavg()[0]
                configs = BLOCKING_CONFIG if blocking else LIMIT_CONFIG
                jobs = run_job(lab, configs, common, timeout, 1, 0)
                lab_row = summarize_lab(jobs["zeropp"][0], nodes, NODE, warmup)
                if blocking:
                    other = summarize_lab(jobs["zeropp_blocking"][0], nodes, NODE, warmup)
                    compared[f"step_ms_blocking_{mbit}"] = round(other["step_ms"], 1)
                    compared[f"blocking_over_overlap_{mbit}"] = round(
                        other["step_ms"] / lab_row["step_ms"], 4
                    )
                rows[mbit] = {
                    "step_ms": lab_row["step_ms"],
                    "link_bytes": lab_row["link_bytes_per_step"],
                    "cpu_floor_ms": cpu_floor_ms(lab_row["cpu_s_per_step"]),
                    "forward_link_bytes": lab_row["forward_link_bytes_per_step"],
                }
                loads[str(mbit)] = [round(before, 2), round(os.getloadavg()[0], 2)]
                print(
                    f"# zeropp {mbit} Mbit/s: {lab_row['step_ms']:.0f} ms/step, "
                    f"{lab_row['link_bytes_per_step'] / 1e6:.2f} MB/step/node",
                    file=sys.stderr,
                    flush=True,
                )
        # once more after the rates: load from other work drifts during the run, and the
        # limit takes the mean of the loopback steps before and after
        loopback_each.append(loopback())
    loopback_ms = statistics.fmean(loopback_each)
    return {
        "benchmark": "zeropp_limit",
        "loopback_step_ms_each": [round(t, 1) for t in loopback_each],
        "loopback_cpu_floor_ms_each": loopback_floor,
        "world": WORLD,
        "node_size": NODE,
        "steps": steps,
        "warmup": warmup,
        "rates_mbit": rates,
        "load": load,
        "load_per_rate": loads,
        "loopback_forward_ms_each": [round(t, 1) for t in loopback_forward],
        **limit_keys(loopback_ms, rows, formula, statistics.fmean(loopback_forward)),
        **compared,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="150; 12 with --limit")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(DEFAULT_MODES),
        help="fp32 always runs (the baseline); the others one part of ZeRO++ at a time",
    )
    parser.add_argument(
        "--limit",
        action="store_true",
        help="in the cluster lab (root): the loopback step and each rate's step and link "
        "bytes, zeropp_over_limit_<rate> (see the module doc)",
    )
    parser.add_argument(
        "--rates",
        type=int,
        nargs="+",
        default=None,
        help=f"link rates in Mbit/s for --limit (default {' '.join(map(str, LIMIT_RATES_MBIT))})",
    )
    parser.add_argument("--warmup", type=int, default=2, help="--limit: steps left out")
    parser.add_argument(
        "--blocking",
        action="store_true",
        help="--limit: also train --no-comm-overlap beside it in each rate's job "
        "(blocking_over_overlap_<rate>)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="--limit: per lab job, s")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="--limit: run the lab jobs at this niceness (e.g. -10 on a shared machine; root)",
    )
    args = parser.parse_args(argv)
    for flag in ("rates", "blocking"):
        if getattr(args, flag) not in (None, False) and not args.limit:
            parser.error(f"argument --{flag}: only with --limit")
    rates = list(args.rates or LIMIT_RATES_MBIT)
    if any(r <= 0 for r in rates):
        parser.error(f"argument --rates: rates must be positive Mbit/s, got {rates}")
    steps = args.steps or (12 if args.limit else 150)
    if args.limit and steps < args.warmup + 2:
        parser.error(
            f"argument --steps: --limit needs at least --warmup + 2 = {args.warmup + 2} steps, "
            f"got {steps}"
        )
    if args.limit:
        if args.nice:
            os.nice(args.nice)  # the lab's processes inherit it
        base = TrainConfig(verbose=False, log_every=10**9)
        summary = measure_limit(base, rates, steps, args.warmup, args.timeout, args.blocking)
        print(json.dumps(summary), flush=True)
        return summary
    modes = ("fp32", *(m for m in args.modes if m != "fp32"))
    base = TrainConfig(steps=steps, verbose=False, log_every=10**9)
    summary = summarize(run(base, args.seeds, modes), base)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    teardown_on_termination()  # SIGTERM tears the lab down, as Ctrl-C does
    main()
