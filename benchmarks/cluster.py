"""Training steps of the main job in the cluster lab: step time behind capped links.

The main job (examples/train.py, its default model) runs under torchrun on emulated nodes
(fsdp_ext.lab: network namespaces, tbf-capped veth links, c10d rendezvous) for each link
rate and configuration:

  stock_fp32   stock FSDP2, fp32 parameters, fp32 gradient reduce-scatter
  stock_bf16   stock FSDP2, bf16 parameters, fp32 reduce
  q4           4-bit reduce-scatter without error feedback (--comm q4)
  loco_flat    4-bit LoCo (--comm loco)
  loco_hier    4-bit LoCo across nodes, full precision inside a node (hierarchical)
  zeropp       the ZeRO++ stack (--zeropp), included when examples/train.py accepts it
  auto         --comm auto: measures the links and codecs at startup and picks (docs/comm.md)

Per layout (nodes x ranks per node), rate and configuration: step ms (median after the
warm-up steps, from an optimizer post-step hook on rank 0), link bytes per step and node
(the kernel's interface counters, read inside each node), the same split by collective kind
(all-gather, reduce-scatter/all-to-all, other: wrapped collectives, a model of gloo's
algorithms checked against the counter), CommStats' 4-bit bytes against the counter, and
the validation loss. A one-node run of every configuration (all ranks on one loopback)
gives this machine's compute time per step, for the calibration in docs/cluster.md.

All configurations of one rate run in one torchrun job (same processes, same lab), built
side by side and trained one step each in turn, the order rotated step by step, so load
from other work on the machine slows every configuration alike (benchmarks/comm.py
--step-time does the same). --sequential runs them one after another instead, the order
rotated from rate to rate, and with --repeats each runs again later in the job and the
fastest repeat is kept. Per layout and rate, auto_over_best_<layout>_<rate> is auto's step
time over the best fixed configuration's, auto_choice_<layout>_<rate> what it chose.

    python benchmarks/cluster.py --quick     # 2x2 at 50/200/1000 Mbit/s, 3x2 at 100 (< 10 min)
    python benchmarks/cluster.py             # 2x2, 3x2 and 4x1 at 50/100/200/400/1000 Mbit/s

Needs root and the lab's packages (make lab); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import itertools

from examples.config import build_parser
from fsdp_ext.lab import Cluster, LabUnavailable, teardown_on_termination, unavailable_reason

RANK_PROGRAM = Path(__file__).resolve().parent / "cluster_rank.py"
RECORD_TAG = "CLUSTER_RECORD "
NODE_SIZE = "{node_size}"  # replaced by "auto" when train.py takes it, else the number
# name -> examples/train.py flags. Adding a configuration is one line; one whose flags
# train.py does not accept (yet) is left out, and the JSON says so.
CONFIGS = {
    "stock_fp32": ["--comm", "stock", "--param-dtype", "fp32"],
    "stock_bf16": ["--comm", "stock", "--param-dtype", "bf16"],
    "q4": ["--comm", "q4"],
    "loco_flat": ["--comm", "loco"],
    "loco_hier": ["--comm", "loco", "--intra-node-size", NODE_SIZE],
    "zeropp": ["--zeropp"],
    "auto": ["--comm", "auto"],
}
HIERARCHICAL = {"loco_hier"}  # pointless with one rank per node (same as flat)
FP32_COMPUTE = ("stock_fp32", "q4", "loco_flat", "loco_hier")  # same model compute, fp32
KINDS = ("all_gather", "reduce_scatter", "other")
RATES_MBIT = [50, 100, 200, 400, 1000]
QUICK_PLAN = {"2x2": [50, 200, 1000], "3x2": [100]}
FULL_PLAN = {"2x2": RATES_MBIT, "3x2": RATES_MBIT, "4x1": RATES_MBIT}
# A real cluster the calibration compares with: 8 x H100 per node (bf16 dense peak), an 8B
# model at 40 % MFU, 16k tokens per GPU and step, sharded over all GPUs like the lab's job.
REFERENCE = {
    "gpus_per_node": 8,
    "gpu_flops": 989e12,
    "mfu": 0.4,
    "params": 8e9,
    "tokens_per_gpu": 16384,
}
MACHINE = "2 CPU cores, gloo over veth"
BATCH = 16  # examples/train.py's default global batch


# ------------------------------------------------------------------ configurations
def train_accepts(flags: list[str]) -> bool:
    """Whether examples/train.py parses ``flags`` (quietly: its errors go to stderr)."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(flags)
        except SystemExit:
            return False
    return True


def resolve_configs(names: list[str], ranks_per_node: int) -> tuple[dict, list[str]]:
    """(name -> flags) for this layout, and the names train.py cannot run yet."""
    node_size = "auto" if train_accepts(["--intra-node-size", "auto"]) else str(ranks_per_node)
    configs, missing = {}, []
    for name in names:
        if name in HIERARCHICAL and ranks_per_node == 1:
            continue
        flags = [node_size if f == NODE_SIZE else f for f in CONFIGS[name]]
        if train_accepts(flags):
            configs[name] = flags
        else:
            missing.append(name)
    return configs, missing


def batch_for(world: int) -> list[str]:
    """train.py's global batch of 16 sequences, or the next multiple of a world size that
    does not divide it (18 on 3 x 2 ranks: 3 per rank against 4 on 2 x 2)."""
    return [] if BATCH % world == 0 else ["--batch-size", str(-(-BATCH // world) * world)]


# ------------------------------------------------------------------ one job
def run_job(
    lab: Cluster,
    configs: dict,
    common: list[str],
    timeout: float,
    repeats: int,
    shift: int,
    rotate: bool = True,
) -> dict[str, list[list[dict]]]:
    """Every configuration in one torchrun job; returns name -> one list of rank records per
    run. ``rotate``: all built side by side and trained a step each in turn (the order
    rotated step by step: load drift hits every configuration alike); else one after
    another, ``repeats`` times, the order rotated by ``shift`` and again on each repeat."""
    names = list(configs)
    runs = []
    for repeat in range(1 if rotate else repeats):
        k = (shift + repeat) % len(names)
        runs += [[name, configs[name]] for name in names[k:] + names[:k]]
    spec = json.dumps({"common": common, "runs": runs, "rotate": rotate})
    result = lab.run([str(RANK_PROGRAM), spec], timeout=timeout)
    if result.returncode != 0:
        tails = [e[-1500:] for e in result.rank_stderr if e.strip()]
        raise RuntimeError(
            f"lab job failed (status {result.returncode}, timed out: {result.timed_out}):\n"
            + (result.output[-1500:] or "")
            + "\n".join(tails)
        )
    by_run: dict[int, list[dict]] = {}
    for out in result.rank_stdout:
        for line in out.splitlines():
            if line.startswith(RECORD_TAG):
                record = json.loads(line[len(RECORD_TAG) :])
                by_run.setdefault(record["run"], []).append(record)
    records: dict[str, list[list[dict]]] = {name: [] for name in names}
    for index in sorted(by_run):
        records[runs[index][0]].append(by_run[index])
    return records


def fastest(summaries: list[dict]) -> dict:
    """The repeat with the lowest median step time (other jobs on the machine only ever add
    time), with every repeat's median beside it."""
    best = dict(min(summaries, key=lambda s: s["step_ms"]))
    best["step_ms_repeats"] = [round(s["step_ms"], 1) for s in summaries]
    return best


def step_intervals_ms(steps: list[dict], warmup: int) -> list[float]:
    """Durations of the steps after the first ``warmup`` (from post-step timestamps)."""
    times = [s["t"] for s in steps[warmup:]]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


def forward_intervals_ms(steps: list[dict], warmup: int) -> list[float]:
    """The forwards' durations in the steps of :func:`step_intervals_ms` (cumulative
    ``fwd_t``: from the step's start to the model's forward returning)."""
    times = [s["fwd_t"] for s in steps[warmup:]]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


def summarize(records: list[dict], nodes: int, ranks_per_node: int, warmup: int) -> dict:
    """Step ms, link bytes per step and node (counter and model by kind), losses."""
    by_rank = sorted(records, key=lambda r: r["rank"])
    steps = by_rank[0]["steps"]
    first, last = warmup, len(steps) - 1
    if last - first < 1:
        raise ValueError(f"need more steps than warm-up + 1, got {len(steps)} steps")
    span = last - first
    intervals = step_intervals_ms(steps, warmup)
    counter, model = [], []
    for node in range(nodes):
        mine = [r for r in by_rank if r["node"] == node]
        lead = next(r for r in mine if r["steps"][0]["link"] is not None)
        a, b = lead["steps"][first]["link"], lead["steps"][last]["link"]
        counter.append((b["tx"] - a["tx"]) / span)
        model.append(
            {
                kind: sum(
                    r["steps"][last]["cross"][kind] - r["steps"][first]["cross"][kind] for r in mine
                )
                / span
                for kind in KINDS
            }
        )
    total_model = [sum(m.values()) for m in model]
    out = {
        "step_ms": statistics.median(intervals),
        "step_ms_each": intervals,
        "train_step_ms": by_rank[0]["train_step_ms"],
        # every rank's CPU seconds per step, summed: over the machine's cores, the step's
        # floor when the cores are what limits it (ranks, gloo threads, the link's kernel work)
        "cpu_s_per_step": sum(r["steps"][last]["cpu"] - r["steps"][first]["cpu"] for r in by_rank)
        / span,
        "link_bytes_per_step": statistics.mean(counter),
        "link_bytes_per_step_by_node": counter,
        "model_bytes_per_step": {k: statistics.mean(m[k] for m in model) for k in KINDS},
        "model_vs_counter_rel_err": max(
            abs(c - m) / c for c, m in zip(counter, total_model, strict=True)
        ),
        "val_loss": by_rank[0]["val_loss"],
        "final_loss": by_rank[0]["final_loss"],
        "comm_auto": by_rank[0].get("comm_auto"),
        "comm_auto_probe_s": by_rank[0].get("comm_auto_probe_s"),
    }
    if "fwd_t" in steps[-1]:  # the forward's share, where the rank program recorded it
        out["forward_ms"] = statistics.median(forward_intervals_ms(steps, warmup))
        leads = [r for r in by_rank if r["steps"][-1].get("fwd_tx") is not None]
        out["forward_link_bytes_per_step"] = statistics.mean(
            (r["steps"][last]["fwd_tx"] - r["steps"][first]["fwd_tx"]) / span for r in leads
        )
    stats = [r["comm_stats"] for r in by_rank]
    if stats[0] is not None:
        out["commstats_vs_counter_rel_err"] = commstats_error(
            by_rank, nodes, ranks_per_node, model, counter, len(steps)
        )
    return out


def commstats_error(by_rank, nodes, ranks_per_node, model, counter, total_steps) -> float:
    """The link counter against a prediction whose reduce-scatter part is CommStats'.

    CommStats counts the 4-bit payload a rank sends (to every peer in flat mode, to its
    counterparts on other nodes in hierarchical mode); the all-gather and other parts come
    from the wrapped collectives. Max over nodes of |counter - predicted| / counter.
    """
    world = nodes * ranks_per_node
    errors = []
    for node in range(nodes):
        mine = [r for r in by_rank if r["node"] == node]
        payload = 0.0
        for r in mine:
            stats = r["comm_stats"]
            sent = stats["bytes_sent"] / total_steps
            hierarchical = stats["intra_node_bytes"] > 0
            payload += sent if hierarchical else sent * (world - ranks_per_node) / (world - 1)
        predicted = model[node]["all_gather"] + model[node]["other"] + payload
        errors.append(abs(counter[node] - predicted) / counter[node])
    return max(errors)


# ------------------------------------------------------------------ calibration
def reference_bytes_per_s(param_bytes: float) -> float:
    """Link bytes per second one reference node needs to keep comm equal to compute time.

    Stock FSDP over NCCL rings: each node's link carries about the whole model per
    all-gather (forward and backward, in the parameter dtype) and per reduce-scatter (fp32).
    """
    ref = REFERENCE
    step_s = 6 * ref["params"] * ref["tokens_per_gpu"] / (ref["gpu_flops"] * ref["mfu"])
    node_bytes = ref["params"] * (2 * param_bytes + 4)
    return node_bytes / step_s


def calibration(compute_ms: float, link_bytes: float, rates: list[int]) -> dict:
    """Comm-to-compute ratio per lab rate, and the reference node link with the same ratio."""
    lab_rate = link_bytes / (compute_ms / 1e3)  # bytes/s the lab job needs for ratio 1
    ref_rate = reference_bytes_per_s(4)
    out = {}
    for mbit in rates:
        ratio = link_bytes * 8 / (mbit * 1e6) / (compute_ms / 1e3)
        out[str(mbit)] = {
            "comm_to_compute": round(ratio, 3),
            "equivalent_node_gbit": round(mbit * 1e6 * ref_rate / lab_rate / 1e9),
        }
    return out


def auto_keys(rows: list[dict], paired: bool = True) -> dict:
    """Per layout and rate: ``auto``'s step time over the best fixed configuration's (the
    one with the lowest median step), its choice, and which fixed configuration was best.
    The ratio is the median of the step-by-step ratios: under rotation, step i of every
    configuration ran in the same round, so load that drifts between rounds cancels."""
    out = {}
    for layout, mbit in dict.fromkeys((r["layout"], r["rate_mbit"]) for r in rows):
        here = [r for r in rows if r["layout"] == layout and r["rate_mbit"] == mbit]
        auto = next((r for r in here if r["config"] == "auto"), None)
        fixed = [r for r in here if r["config"] != "auto"]
        if auto is None or not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_ms"])
        mine, theirs = auto.get("step_ms_each", []), best.get("step_ms_each", [])
        if paired and mine and len(mine) == len(theirs):
            ratio = statistics.median(x / y for x, y in zip(mine, theirs, strict=True))
        else:  # --sequential: no rounds to pair
            ratio = auto["step_ms"] / best["step_ms"]
        out[f"auto_over_best_{layout}_{mbit}"] = round(ratio, 4)
        out[f"auto_over_best_medians_{layout}_{mbit}"] = round(auto["step_ms"] / best["step_ms"], 4)
        out[f"auto_choice_{layout}_{mbit}"] = auto["comm_auto"]
        if auto.get("comm_auto_probe_s") is not None:
            out[f"auto_probe_s_{layout}_{mbit}"] = round(auto["comm_auto_probe_s"], 2)
        out[f"best_fixed_{layout}_{mbit}"] = best["config"]
    ratios = [v for k, v in out.items() if k.startswith("auto_over_best_") and "medians" not in k]
    if ratios:
        out["auto_over_best_max"] = max(ratios)
    return out


# ------------------------------------------------------------------ output
def print_table(rows: list[dict], compute: dict) -> None:
    head = (
        f"{'layout':6} {'config':11} {'Mbit/s':>6} {'step ms':>8} {'1-node ms':>9} "
        f"{'link MB/step':>12} {'AG':>6} {'RS/A2A':>6} {'other':>6} {'model err':>9} "
        f"{'stats err':>9} {'val loss':>8}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        m = row["model_bytes_per_step"]
        stats_err = row.get("commstats_vs_counter_rel_err")
        print(
            f"{row['layout']:6} {row['config']:11} {row['rate_mbit']:>6} "
            f"{row['step_ms']:8.0f} {compute.get(row['config'], float('nan')):9.0f} "
            f"{row['link_bytes_per_step'] / 1e6:12.2f} {m['all_gather'] / 1e6:6.2f} "
            f"{m['reduce_scatter'] / 1e6:6.2f} {m['other'] / 1e6:6.3f} "
            f"{row['model_vs_counter_rel_err'] * 100:8.2f}% "
            + (f"{stats_err * 100:8.2f}% " if stats_err is not None else f"{'-':>9} ")
            + f"{row['val_loss']:8.4f}"
        )


def plot(rows: list[dict], compute: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(1, len(layouts) + 1, figsize=(5 * (len(layouts) + 1), 4))
    for ax, layout in zip(axes, layouts, strict=False):
        for config in dict.fromkeys(r["config"] for r in rows if r["layout"] == layout):
            mine = sorted(
                (r for r in rows if r["layout"] == layout and r["config"] == config),
                key=lambda r: r["rate_mbit"],
            )
            x, y = [r["rate_mbit"] for r in mine], [r["step_ms"] for r in mine]
            color = f"C{list(CONFIGS).index(config) % 10}"  # the same in every panel
            ax.plot(x, y, "o-", color=color, label=config)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate per node, each way (Mbit/s)")
        ax.set_ylabel("step time (ms, median)")
        ax.set_title(f"{layout} (nodes x ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    main = [r for r in rows if r["layout"] == layouts[0]]
    configs = list(dict.fromkeys(r["config"] for r in main))
    bottom = [0.0] * len(configs)
    for kind, label in zip(
        KINDS, ("all-gather", "reduce-scatter / all-to-all", "other"), strict=True
    ):
        values = [
            next(r for r in main if r["config"] == c)["model_bytes_per_step"][kind] / 1e6
            for c in configs
        ]
        ax.bar(configs, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    counter = [
        next(r for r in main if r["config"] == c)["link_bytes_per_step"] / 1e6 for c in configs
    ]
    ax.plot(configs, counter, "k_", markersize=30, label="interface counter")
    ax.set_ylabel("MB per step and node on the link")
    ax.set_title(f"{layouts[0]}: link bytes by collective")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main
def parse_plan(text: str) -> dict[str, list[int]]:
    """Layouts and their rates: ``"2x2:50,200 4x1:200"`` -> ``{"2x2": [50, 200], "4x1": [200]}``."""
    plan = {}
    for part in text.split():
        layout, _, rates = part.partition(":")
        nodes, _, rpn = layout.partition("x")
        if not (nodes.isdigit() and rpn.isdigit() and rates):
            raise argparse.ArgumentTypeError(f"a plan entry is NODESxRANKS:RATE,... got {part!r}")
        plan[layout] = [int(r) for r in rates.split(",")]
    return plan


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2x2 at 50/200/1000, 3x2 at 100")
    p.add_argument("--plan", type=parse_plan, default=None, help='e.g. "2x2:50,200 4x1:200"')
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    p.add_argument("--steps", type=int, default=None, help="per run (12; 6 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out (2; 1 --quick)")
    p.add_argument("--val-batches", type=int, default=None, help="(4; 1 with --quick)")
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per configuration, fastest kept (2; 1)"
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run the configurations one after another (with --repeats) instead of in "
        "step-by-step rotation",
    )
    p.add_argument("--timeout", type=float, default=1800, help="per lab job, seconds")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the jobs at this niceness (e.g. -10 on a machine other work shares; root)",
    )
    p.add_argument("--plot", default="docs/cluster_step_time.png", help="'' for none")
    a = p.parse_args(argv)
    unknown = sorted(set(a.configs.split(",")) - set(CONFIGS))
    if unknown:
        p.error(f"argument --configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    reason = unavailable_reason(storage=False)
    if reason is not None:
        raise LabUnavailable(reason)
    if a.nice:
        os.nice(a.nice)  # the lab's processes inherit it
    plan = a.plan or (QUICK_PLAN if a.quick else FULL_PLAN)
    steps = a.steps or (6 if a.quick else 12)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    val_batches = a.val_batches or (1 if a.quick else 4)
    repeats = 1 if not a.sequential else a.repeats or (1 if a.quick else 2)
    names = a.configs.split(",")
    t_start = time.perf_counter()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    # train.py's --out (its loss plots); removed at the end, or at exit after an error
    scratch = tempfile.TemporaryDirectory(prefix="cluster-bench-")
    out_dir = Path(scratch.name)
    common = [
        "--steps",
        str(steps),
        "--val-batches",
        str(val_batches),
        "--log-every",
        str(10**6),
        "--out",
        str(out_dir),
    ]

    rows, missing_all = [], set()
    loads: dict[str, list[float]] = {}  # 1-minute load average before and after each job
    compute: dict[str, float] = {}
    for index, (layout, rates) in enumerate(plan.items()):
        nodes, rpn = (int(x) for x in layout.split("x"))
        configs, missing = resolve_configs(names, rpn)
        missing_all.update(missing)
        layout_common = common + batch_for(nodes * rpn)
        if index == 0:  # compute time: every rank on one node, no link at all
            with Cluster(1, nodes * rpn, "1gbit", storage=False, timeout=a.timeout) as lab:
                # the calibration's compute time: never fewer than two repeats
                records = run_job(
                    lab, configs, layout_common, a.timeout, max(2, repeats), 0, not a.sequential
                )
            for name, runs in records.items():
                compute[name] = min(
                    statistics.median(
                        step_intervals_ms(min(recs, key=lambda r: r["rank"])["steps"], warmup)
                    )
                    for recs in runs
                )
        with Cluster(nodes, rpn, f"{rates[0]}mbit", storage=False, timeout=a.timeout) as lab:
            for shift, mbit in enumerate(rates, start=1):
                lab.set_link(f"{mbit}mbit")
                load_before = os.getloadavg()[0]
                records = run_job(
                    lab, configs, layout_common, a.timeout, repeats, shift, not a.sequential
                )
                loads[f"{layout}_{mbit}"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                for name, runs in records.items():
                    row = {"layout": layout, "config": name, "rate_mbit": mbit}
                    row.update(fastest([summarize(r, nodes, rpn, warmup) for r in runs]))
                    rows.append(row)
                    print(
                        f"# {layout} {name} {mbit} Mbit/s: {row['step_ms']:.0f} ms/step",
                        file=sys.stderr,
                        flush=True,
                    )

    scratch.cleanup()
    print_table(rows, compute)
    main_layout = next(iter(plan))
    main_rows = [r for r in rows if r["layout"] == main_layout]
    rates = sorted({r["rate_mbit"] for r in main_rows})
    step_ms = {}
    for r in main_rows:
        step_ms.setdefault(r["config"], {})[str(r["rate_mbit"])] = round(r["step_ms"], 1)

    def ms(config: str, mbit: int) -> float | None:
        return step_ms.get(config, {}).get(str(mbit))

    # This machine's compute time of one step of the fp32 model: the fastest one-node step
    # of the configurations that compute in fp32 (the codecs only add to it), so a burst of
    # other work during one of them does not set the calibration
    fp32_compute = [compute[c] for c in FP32_COMPUTE if c in compute]
    compute_fp32 = round(min(fp32_compute), 1) if fp32_compute else None

    def ratio(numerator: str, denominator: str, mbit: int) -> float | None:
        """Step time of one configuration over another's (None where either did not run)."""
        a, b = ms(numerator, mbit), ms(denominator, mbit)
        return round(a / b, 4) if a and b else None

    def vs_best_stock(config: str, mbit: int) -> float | None:
        """Step time of ``config`` over the faster stock configuration's (fp32 or bf16)."""
        stock = [t for t in (ms("stock_fp32", mbit), ms("stock_bf16", mbit)) if t]
        return round(ms(config, mbit) / min(stock), 4) if stock and ms(config, mbit) else None

    def val_gap(config: str) -> float | None:
        """Relative validation-loss gap of ``config`` to stock fp32 at the slowest rate."""
        loss = {r["config"]: r["val_loss"] for r in main_rows if r["rate_mbit"] == slowest}
        if config not in loss or "stock_fp32" not in loss:
            return None
        return round(loss[config] / loss["stock_fp32"] - 1, 4)

    slowest, fastest_rate = rates[0], rates[-1]
    zeropp_slow = vs_best_stock("zeropp", slowest)
    result = {
        "bench": "cluster",
        "machine": MACHINE,
        "load": load,
        "layout": main_layout,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "nice": a.nice,
        "rates_mbit": rates,
        "step_ms": step_ms,
        "speedup_loco_vs_stock_fp32_at_slowest": ratio("stock_fp32", "loco_flat", slowest),
        "speedup_loco_hier_vs_stock_fp32_at_slowest": ratio("stock_fp32", "loco_hier", slowest),
        "speedup_zeropp_vs_stock_fp32_at_slowest": ratio("stock_fp32", "zeropp", slowest),
        "speedup_zeropp_vs_best_stock_at_slowest": (
            round(1 / zeropp_slow, 4) if zeropp_slow else None
        ),
        "zeropp_vs_stock_at_fastest": vs_best_stock("zeropp", fastest_rate),
        "val_loss_gap_zeropp_vs_stock_fp32": val_gap("zeropp"),
        "loco_step_overhead_vs_q4_max": max(
            (
                round(ratio("loco_flat", "q4", r) - 1, 4)
                for r in rates
                if ratio("loco_flat", "q4", r)
            ),
            default=None,
        ),
        "link_bytes_vs_commstats_max_rel_err": round(
            max(
                (
                    r["commstats_vs_counter_rel_err"]
                    for r in rows
                    if "commstats_vs_counter_rel_err" in r
                ),
                default=float("nan"),
            ),
            4,
        ),
        "link_bytes_vs_model_max_rel_err": round(
            max(r["model_vs_counter_rel_err"] for r in rows), 4
        ),
        "link_mb_per_step": {
            r["config"]: round(r["link_bytes_per_step"] / 1e6, 3)
            for r in main_rows
            if r["rate_mbit"] == slowest
        },
        "val_loss": {
            r["config"]: round(r["val_loss"], 4) for r in main_rows if r["rate_mbit"] == slowest
        },
        "compute_ms_per_step": {k: round(v, 1) for k, v in compute.items()},
        "compute_ms_fp32_model": compute_fp32,
        "calibration": (
            calibration(
                compute_fp32,
                next(r for r in main_rows if r["config"] == "stock_fp32")["link_bytes_per_step"],
                rates,
            )
            if compute_fp32 and any(r["config"] == "stock_fp32" for r in main_rows)
            else None
        ),
        "reference_cluster": REFERENCE,
        "configs_not_in_train_py": sorted(missing_all),
        "other_layouts": {
            layout: {
                r["config"]: {
                    str(x["rate_mbit"]): round(x["step_ms"], 1)
                    for x in rows
                    if x["layout"] == layout and x["config"] == r["config"]
                }
                for r in rows
                if r["layout"] == layout
            }
            for layout in plan
            if layout != main_layout
        },
        "wall_s": round(time.perf_counter() - t_start),
        "rotate": not a.sequential,
        "load_per_job": loads,
        **auto_keys(rows, paired=not a.sequential),
    }
    if a.plot:
        plot(rows, compute, Path(a.plot))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    teardown_on_termination()  # SIGTERM tears the lab down, as Ctrl-C does
    main()
