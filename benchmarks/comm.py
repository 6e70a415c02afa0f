"""Benchmark: fp32 vs 4-bit vs 4-bit LoCo gradient reduce-scatter on the example LM.

    python benchmarks/comm.py --quick                 # 2 ranks, 1 seed, 120 steps: < 5 min
    python benchmarks/comm.py                         # 2 ranks, seeds 0-2, 300 steps
    python benchmarks/comm.py --worlds 4 --seeds 1    # 4 ranks

For each seed, every mode trains the example model from that seed on the same batches.
One run's validation loss moves by a few percent with the trajectory alone (the seed-to-seed
spread of the fp32 baseline is larger than the gaps measured), so the gaps are averaged over
seeds. Wire bytes are measured: each rank wraps ``all_to_all_single`` and the stock
reduce-scatter and counts the bytes of the tensors handed to them that are bound for another
rank. The last line printed is one JSON object.
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

import torch.distributed as dist  # noqa: E402

from examples.train import TrainConfig, train  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

MODES = ("default", "q4", "loco")
TAIL = 20  # the train loss reported is the mean of the last TAIL steps


class WireCounter:
    """Counts bytes bound for other ranks in the gradient collectives of this process."""

    NAMES = ("all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self):
        self.bytes = 0
        self._originals = {}
        self._inside = False  # a renamed collective may call its old name: count once

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self._originals[name], name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def _wrap(self, fn, name):
        def counted(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            tensor = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
            world = dist.get_world_size(kwargs.get("group"))
            self.bytes += tensor.numel() * tensor.element_size() * (world - 1) // world
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False

        counted.__name__ = name
        return counted


def _run_mode(cfg: TrainConfig) -> dict:
    with WireCounter() as wire:
        summary = train(cfg)
    return {
        "losses": summary["losses"],
        "val_loss": summary["val_loss"],
        "step_ms": summary["step_ms"],
        "wire_bytes_per_step": wire.bytes / max(1, len(summary["losses"])),
        "comm_stats": summary["comm_stats"],
    }


def run(world: int, base: TrainConfig, seeds: list[int]) -> dict:
    """Train ``base`` once per mode and seed on ``world`` ranks: {mode: [result per seed]}."""
    runs = {mode: [] for mode in MODES}
    for seed, mode in ((seed, mode) for seed in seeds for mode in MODES):
        t0 = time.perf_counter()
        cfg = replace(base, comm=mode, seed=seed)
        result = run_distributed(_run_mode, world, cfg, timeout=1800)[0]
        result["wall_s"] = time.perf_counter() - t0
        runs[mode].append(result)
        print(
            f"world {world} seed {seed} {mode:8s} val {result['val_loss']:.4f} "
            f"train(last {TAIL}) {statistics.mean(result['losses'][-TAIL:]):.4f} "
            f"wire {result['wire_bytes_per_step'] / 1e6:.3f} MB/step "
            f"step {result['step_ms']:.0f} ms  ({result['wall_s']:.0f} s)",
            flush=True,
        )
    return runs


def _mean(results: list[dict], key) -> float:
    return statistics.mean(key(r) for r in results)


def _gaps(runs: dict, mode: str) -> list[float]:
    """Relative validation-loss gap of ``mode`` to the fp32 run of the same seed."""
    return [
        (r["val_loss"] - b["val_loss"]) / b["val_loss"]
        for r, b in zip(runs[mode], runs["default"], strict=True)
    ]


def summarize(runs: dict) -> dict:
    out = {
        mode: {
            "val_loss": round(_mean(rs, lambda r: r["val_loss"]), 4),
            "val_loss_per_seed": [round(r["val_loss"], 4) for r in rs],
            "train_loss_last20": round(
                _mean(rs, lambda r: statistics.mean(r["losses"][-TAIL:])), 4
            ),
            "wire_bytes_per_step": round(_mean(rs, lambda r: r["wire_bytes_per_step"])),
            "step_ms": round(statistics.median(r["step_ms"] for r in rs), 1),
        }
        for mode, rs in runs.items()
    }
    wire = {mode: out[mode]["wire_bytes_per_step"] for mode in runs}
    return {
        "runs": out,
        "bytes_ratio_loco_vs_fp32": round(wire["loco"] / wire["default"], 4),
        "val_loss_gap_loco": round(statistics.mean(_gaps(runs, "loco")), 4),
        "val_loss_gap_q4": round(statistics.mean(_gaps(runs, "q4")), 4),
        "val_loss_gap_loco_per_seed": [round(g, 4) for g in _gaps(runs, "loco")],
        "val_loss_gap_q4_per_seed": [round(g, 4) for g in _gaps(runs, "q4")],
    }


def plot(runs_by_world: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs_by_world), figsize=(6 * len(runs_by_world), 3.8))
    axes = [axes] if len(runs_by_world) == 1 else list(axes)
    for ax, (world, runs) in zip(axes, runs_by_world.items(), strict=True):
        for mode, style in zip(MODES, ("-", "--", ":"), strict=True):
            per_step = list(zip(*(r["losses"] for r in runs[mode]), strict=True))
            losses = [statistics.mean(step) for step in per_step]
            smooth = [statistics.mean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
            label = f"{mode} (val {_mean(runs[mode], lambda r: r['val_loss']):.3f})"
            ax.plot(range(1, len(losses) + 1), smooth, style, label=label)
        seeds = len(runs["default"])
        ax.set_title(f"{world} ranks: train loss, mean of {seeds} seed(s), 10-step mean")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 ranks, fewer steps (< 5 min)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--worlds", default=None, help="comma-separated rank counts")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (3; 1 with --quick)")
    p.add_argument("--plot", default=None, help="write the loss curves here (PNG)")
    a = p.parse_args(argv)
    steps = a.steps or (120 if a.quick else 300)
    worlds = [int(w) for w in (a.worlds or "2").split(",")]
    seeds = list(range(a.seeds or (1 if a.quick else 3)))
    base = TrainConfig(steps=steps, verbose=False, log_every=10**9, out="unused")
    runs_by_world = {world: run(world, base, seeds) for world in worlds}
    if a.plot:
        plot(runs_by_world, Path(a.plot))
    result = {"bench": "comm", "steps": steps, "seeds": len(seeds), "machine": "2-core CPU, gloo"}
    first = summarize(runs_by_world[worlds[0]])
    result.update(world_size=worlds[0], **first)
    for world in worlds[1:]:
        result[f"world_{world}"] = summarize(runs_by_world[world])
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
