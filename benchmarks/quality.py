"""Benchmark: does compressed communication cost training quality? Paired, so it can fail.

    python benchmarks/quality.py --quick     # smoke: 1 seed, 3 steps, a tiny model (seconds)
    python benchmarks/quality.py             # 5 seeds x 300 steps, the figures in docs/comm.md

For every seed, each mode trains the example LM (``examples.train.train``) from the same
initial weights on the same batches (both are pure functions of the seed), on 2 gloo ranks:
stock fp32, q4 (4-bit, no error feedback), LoCo (4-bit with error feedback) and ZeRO++
(LoCo + int8 weights + node-local copies, 2 "nodes" of one rank), and ``auto`` when
``examples/train.py`` offers ``--comm auto``. Two metrics per run: the mean training loss
over the last 50 steps (the same 50 batches for every mode of a seed) and the validation
loss over ``--val-batches`` batches of the held-out files. Each compressed mode is compared
with stock **of the same seed**: the paired difference, in % of stock, then its mean and
standard error over the seeds. The seed-to-seed spread of the loss itself (0.1 nats) cancels
in the pairs; what is left is how far one run's trajectory drifts from its twin's.

A second regime, low LR with large groups (lr ``--lowlr``, group size ``--lowlr-group``), is
where plain 4-bit measurably degrades (``docs/comm.md``); there LoCo should be no worse
than q4, ``loco_minus_q4_pct_lowlr`` <= 0.

The last line printed is one JSON object; its last keys are ``gap_<mode>_pct`` and
``gap_<mode>_se`` (validation loss) for each compressed mode, ``loco_minus_q4_pct`` /
``loco_minus_q4_se``, and the same for the low-LR regime with the suffix ``_lowlr``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.config import comm_choices  # noqa: E402  (the --comm values train.py offers)
from examples.model import ModelConfig  # noqa: E402
from examples.train import TrainConfig, train  # noqa: E402
from fsdp_ext.testing import run_distributed  # noqa: E402

WORLD = 2
TAIL = 50  # steps of the training-loss metric
MACHINE = "2-core CPU shared with other jobs, gloo"
MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=192, num_experts=4, moe_hidden_dim=96)
TINY = ModelConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=32, num_experts=2, moe_hidden_dim=16)


def modes(base: TrainConfig) -> dict[str, TrainConfig]:
    """Every mode's settings at ``base``'s LR and codec group size."""
    out = {
        "stock": replace(base, comm="stock"),
        "q4": replace(base, comm="q4"),
        "loco": replace(base, comm="loco"),
        "zeropp": replace(base, comm="loco", zeropp=True, intra_node_size=1),
    }
    if "auto" in comm_choices():  # the hook for --comm auto
        out["auto"] = replace(base, comm="auto")
    return out


def lowlr_modes(base: TrainConfig, lr: float, group: int) -> dict[str, TrainConfig]:
    low = replace(base, lr=lr, comm_group_size=group)
    return {
        "stock": replace(low, comm="stock"),
        "q4": replace(low, comm="q4"),
        "loco": replace(low, comm="loco"),
    }


def _seed_rank(runs: dict[str, TrainConfig], tail: int) -> dict[str, dict]:
    """One rank: every run of one seed in turn, in this process (each builds its model anew
    from the seed)."""
    out = {}
    for name, cfg in runs.items():
        t0 = time.perf_counter()
        summary = train(cfg)
        out[name] = {
            "train_tail": statistics.mean(summary["losses"][-tail:]),
            "val": summary["val_loss"],
            "wall_s": time.perf_counter() - t0,
        }
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (nan for one value)."""
    mean = statistics.mean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se


def paired_pct(results: list[dict], mode: str, metric: str, base: str = "stock") -> list[float]:
    """Per seed: 100 * (mode - base) / stock, the stock run of the same seed."""
    return [100 * (r[mode][metric] - r[base][metric]) / r["stock"][metric] for r in results]


def _num(x: float, digits: int = 3) -> float | None:
    return None if math.isnan(x) else round(x, digits)


def summarize(main: list[dict], low: list[dict], compressed: list[str]) -> dict:
    """Paired gaps to stock (both metrics), LoCo - q4, the targets; gap keys last."""
    detail, tail_keys = {}, {}
    for regime, results, names, suffix in (
        ("main", main, compressed, ""),
        ("lowlr", low, ["q4", "loco"], "_lowlr"),
    ):
        if not results:
            continue
        rows = {}
        for metric in ("val", "train_tail"):
            for mode in names:
                m, se = mean_se(paired_pct(results, mode, metric))
                rows[f"gap_{mode}_{metric}"] = [_num(m), _num(se)]
            m, se = mean_se(paired_pct(results, "loco", metric, base="q4"))
            rows[f"loco_minus_q4_{metric}"] = [_num(m), _num(se)]
        rows["per_seed_val"] = {
            mode: [round(r[mode]["val"], 4) for r in results] for mode in results[0]
        }
        detail[regime] = rows
        if suffix:
            m, se = mean_se(paired_pct(results, "q4", "val"))
            tail_keys["q4_degrades_lowlr"] = bool(m > 2 * se) if len(results) > 1 else None
            tail_keys[f"gap_q4_pct{suffix}"], tail_keys[f"gap_q4_se{suffix}"] = _num(m), _num(se)
            m, se = mean_se(paired_pct(results, "loco", "val", base="q4"))
            tail_keys["loco_le_q4_lowlr"] = bool(m <= 0)
            tail_keys[f"loco_minus_q4_pct{suffix}"] = _num(m)
            tail_keys[f"loco_minus_q4_se{suffix}"] = _num(se)
        else:
            for mode in names:
                m, se = mean_se(paired_pct(results, mode, "val"))
                ok = abs(m) <= 1 or (not math.isnan(se) and abs(m) <= 2 * se)
                tail_keys[f"within_target_{mode}"] = ok
                tail_keys[f"gap_{mode}_pct"], tail_keys[f"gap_{mode}_se"] = _num(m), _num(se)
            m, se = mean_se(paired_pct(results, "loco", "val", base="q4"))
            tail_keys["loco_minus_q4_pct"], tail_keys["loco_minus_q4_se"] = _num(m), _num(se)
    # the documented keys come last, the verdicts just before them
    verdicts = {k: v for k, v in tail_keys.items() if not k.startswith(("gap_", "loco_minus"))}
    gaps = {k: v for k, v in tail_keys.items() if k not in verdicts}
    return {"detail": detail, **verdicts, **gaps}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke: 1 seed, 3 steps, tiny model")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (5)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (300)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR of the main regime (1e-3)")
    p.add_argument("--lowlr", type=float, default=3e-4, help="peak LR of the low-LR regime")
    p.add_argument("--lowlr-group", type=int, default=4096, help="codec group size there")
    p.add_argument("--val-batches", type=int, default=24, help="validation batches (24)")
    p.add_argument("--no-lowlr", action="store_true", help="skip the low-LR regime")
    p.add_argument("--save", default=None, help="write each seed's results here as it ends")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.val_batches = 1, 3, 1
    for flag, value in (("--seeds", a.seeds), ("--steps", a.steps)):
        if value < 1:
            raise SystemExit(f"quality.py: {flag} must be >= 1, got {value}")
    tail = min(TAIL, a.steps)
    base = TrainConfig(
        steps=a.steps,
        batch_size=4 if a.quick else 8,
        seq_len=16 if a.quick else 32,
        model=replace(TINY if a.quick else MODEL, max_seq_len=16 if a.quick else 32),
        warmup_steps=1 if a.quick else 20,
        lr=a.lr,
        val_batches=a.val_batches,
        verbose=False,
        log_every=10**9,
        out="unused",
    )
    main_modes = modes(base)
    low_modes = {} if a.no_lowlr else lowlr_modes(base, a.lowlr, a.lowlr_group)
    t_start = time.perf_counter()
    main_results, low_results = [], []
    for seed in range(a.seeds):
        runs = {m: replace(c, seed=seed) for m, c in main_modes.items()}
        runs.update({f"lowlr_{m}": replace(c, seed=seed) for m, c in low_modes.items()})
        t0 = time.perf_counter()
        out = run_distributed(_seed_rank, WORLD, runs, tail, timeout=7200)[0]
        main_results.append({m: out[m] for m in main_modes})
        if low_modes:
            low_results.append({m: out[f"lowlr_{m}"] for m in low_modes})
        if a.save:  # a long run leaves its finished seeds behind
            Path(a.save).write_text(json.dumps({"main": main_results, "lowlr": low_results}))
        line = " ".join(f"{m} {r['val']:.4f}" for m, r in out.items())
        print(f"seed {seed} ({time.perf_counter() - t0:.0f} s) val: {line}", flush=True)
    compressed = [m for m in main_modes if m != "stock"]
    result = {
        "bench": "quality",
        "machine": MACHINE,
        "smoke": a.quick,
        "world_size": WORLD,
        "seeds": a.seeds,
        "steps": a.steps,
        "tail_steps": tail,
        "val_batches": a.val_batches,
        "lr": a.lr,
        "lowlr": None if a.no_lowlr else a.lowlr,
        "lowlr_group": None if a.no_lowlr else a.lowlr_group,
        "modes": list(main_modes),
        "wall_s": round(time.perf_counter() - t_start),
        **summarize(main_results, low_results, compressed),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
