"""Benchmark: fp32 vs 4-bit (q4) vs 4-bit LoCo gradient reduce-scatter on the example LM.

    python benchmarks/comm.py --quick                 # 2 ranks, short runs: < 5 min
    python benchmarks/comm.py --plot-dir docs         # the full run behind docs/comm.md
    python benchmarks/comm.py --step-time             # step ms: stock / q4 / LoCo, 2 and 4 ranks

Three measurements, each on the example model (examples/train.py, CPython stdlib bytes):

1. **Gradient fidelity** (the primary, low-noise one). Every FSDP unit reduces each step's
   gradient three ways on the same input: exact fp32, q4 and LoCo (``comm_fidelity.py``).
   Training follows one method's output (the trajectory of q4, or of LoCo); we report the
   relative error and cosine of each step's gradient to the exact mean, and of the running
   sums over 50 and over all steps, which is what the optimizer integrates.
2. **A sweep** of the same over group sizes and world sizes, on the fp32 trajectory.
3. **Training loss**: every mode trains from the same seed on the same batches, at the
   default codec and in the degradation regime (a large ``group_size``); gaps to the fp32
   run of the same seed are averaged over seeds (mean and standard error). Wire bytes are
   measured: each rank wraps ``all_to_all_single`` and the stock reduce-scatter and counts
   the bytes of the tensors handed to them that are bound for another rank.

``--step-time`` measures time instead (loopback gloo, no capped link): on each world size, one
job builds the example model three times (same seed), with the stock fp32 reduce-scatter, q4
and LoCo, and trains them side by side for ``--step-time-steps`` steps, the modes rotated step
by step so that a loaded machine slows each alike; the codec kernels run on the given
backends (``cpu``, the default on CPU tensors, and ``reference``, the torch spec the library
ran before the fast CPU path). It reports each mode's median step ms, wall and process CPU
(the slowest rank's), and ``loco_step_overhead_vs_q4_max``, the largest ``loco / q4 - 1`` of
wall step times over the world sizes on the first backend; and, to isolate the hook from the
model, one ``LoCoReduceScatter`` call on a ``--hook-shard``-element shard per rank (2 ranks,
median ms of stock / q4 / LoCo).

The last line printed is one JSON object.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.comm_fidelity import (  # noqa: E402
    FidelityTracker,
    ShadowReduceScatter,
    mean_and_stderr,
)
from examples.data import get_batch, load_corpus  # noqa: E402
from examples.model import Transformer  # noqa: E402
from examples.train import TrainConfig, parallelize, train  # noqa: E402
from fsdp_ext import (  # noqa: E402
    CommConfig,
    LoCoConfig,
    LoCoReduceScatter,
    ParallelDims,
    Q4Config,
    clip_grad_norm_,
    enable,
)
from fsdp_ext.kernels.backend import use_backend  # noqa: E402
from fsdp_ext.testing import WireCounter, run_distributed  # noqa: E402

MODES = ("stock", "q4", "loco")


def gradient_bytes(wire: WireCounter) -> int:
    """What the gradient collectives sent to other ranks (the reduce-scatters, stock or
    LoCo's all-to-all)."""
    return wire.total("reduce_scatter", "all_to_all")


TAIL = 20  # the train loss reported is the mean of the last TAIL steps
MACHINE = "2-core CPU shared with other jobs, gloo"


def codecs(group_size: int = 128) -> dict[str, LoCoConfig]:
    """The two compressed modes at one group size: plain 4-bit (qgZ) and 4-bit LoCo."""
    return {
        "q4": Q4Config(group_size=group_size),
        "loco": LoCoConfig(group_size=group_size),
    }


def _with_codec(cfg: TrainConfig, config: LoCoConfig | Q4Config | None) -> TrainConfig:
    """``cfg`` whose flags put ``config`` on every unit: --comm (the codec's name) and
    --comm-group-size (None: --comm stock, FSDP's fp32 reduce-scatter)."""
    if config is None:
        return replace(cfg, comm="stock")
    return replace(cfg, comm=config.codec, comm_group_size=config.group_size)


def _run_mode(cfg: TrainConfig, config: LoCoConfig | None = None) -> dict:
    """One rank of one training run with ``config`` on every unit (None: stock fp32)."""
    with WireCounter() as wire:
        summary = train(_with_codec(cfg, config))
    return {
        "losses": summary["losses"],
        "val_loss": summary["val_loss"],
        "step_ms": summary["step_ms"],
        "wire_bytes_per_step": gradient_bytes(wire) / max(1, len(summary["losses"])),
        "comm_stats": summary["comm_stats"],
    }


def run(
    world: int,
    base: TrainConfig,
    seeds: list[int],
    configs: dict[str, LoCoConfig | None] | None = None,
) -> dict:
    """Train ``base`` once per mode and seed on ``world`` ranks: {mode: [result per seed]}.

    ``configs`` maps mode names to codecs (None: the stock fp32 reduce-scatter); by default
    the example's three modes at group size 128.
    """
    configs = configs if configs is not None else {"stock": None, **codecs()}
    runs = {mode: [] for mode in configs}
    for seed, mode in ((seed, mode) for seed in seeds for mode in configs):
        t0 = time.perf_counter()
        cfg = replace(base, comm="stock", seed=seed)
        result = run_distributed(_run_mode, world, cfg, configs[mode], timeout=3600)[0]
        result["wall_s"] = time.perf_counter() - t0
        runs[mode].append(result)
        print(
            f"world {world} seed {seed} {mode:10s} val {result['val_loss']:.4f} "
            f"train(last {TAIL}) {statistics.mean(result['losses'][-TAIL:]):.4f} "
            f"wire {result['wire_bytes_per_step'] / 1e6:.3f} MB/step "
            f"step {result['step_ms']:.0f} ms  ({result['wall_s']:.0f} s)",
            flush=True,
        )
    return runs


def _interleaved_rank(cfg: TrainConfig, configs: dict, backend: str) -> dict:
    """One rank: the example model once per mode (same seed), trained side by side, the modes
    rotated step by step, so a loaded machine slows every mode alike. Per mode: median wall
    and process-CPU ms of a step (forward, backward with its reduce-scatters, clip, AdamW)."""
    world = dist.get_world_size()
    corpus = load_corpus()
    runs = {}
    for mode, config in configs.items():
        torch.manual_seed(cfg.seed)
        dims = ParallelDims(world, ep=cfg.ep, pp=cfg.pp)
        dims.build_mesh("cpu")
        par = parallelize(Transformer(cfg.model), _with_codec(cfg, config), dims)
        params = [p for part in par.parts for p in part.parameters()]
        runs[mode] = (par, params, torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95)))
    local = cfg.batch_size // world
    rank = dist.get_rank()
    wall = {mode: [] for mode in configs}
    cpu = {mode: [] for mode in configs}
    modes = list(configs)
    with use_backend(backend):
        for step in range(cfg.steps):
            x, y = get_batch(
                corpus.train,
                seed=cfg.seed,
                step=step,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
            )
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            for mode in modes[step % len(modes) :] + modes[: step % len(modes)]:
                par, params, optimizer = runs[mode]
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                par.train_step(x, y)
                clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step >= 3:  # the first steps allocate error buffers and workspaces
                    wall[mode].append((time.perf_counter() - t0) * 1e3)
                    cpu[mode].append((time.process_time() - c0) * 1e3)
    return {
        mode: {
            "step_ms": round(statistics.median(wall[mode]), 1),
            "step_cpu_ms": round(statistics.median(cpu[mode]), 1),
        }
        for mode in configs
    }


def step_times(base: TrainConfig, worlds: list[int], backends: list[str]) -> dict:
    """Step ms of stock / q4 / LoCo per backend and world size, trained side by side."""
    configs = {"stock": None, **codecs()}
    out = {}
    for backend in backends:
        for world in worlds:
            ranks = run_distributed(_interleaved_rank, world, base, configs, backend, timeout=3600)
            # a step is as slow as its slowest rank
            per_mode = {
                mode: {k: max(r[mode][k] for r in ranks) for k in ("step_ms", "step_cpu_ms")}
                for mode in configs
            }
            out.setdefault(backend, {})[str(world)] = {
                **per_mode,
                "loco_vs_q4": round(per_mode["loco"]["step_ms"] / per_mode["q4"]["step_ms"], 4),
                "loco_vs_q4_cpu_time": round(
                    per_mode["loco"]["step_cpu_ms"] / per_mode["q4"]["step_cpu_ms"], 4
                ),
            }
            print(
                f"step time, {backend} codec, world {world}: "
                + "  ".join(
                    f"{m} {v['step_ms']:.1f} ms ({v['step_cpu_ms']:.1f} CPU)"
                    for m, v in per_mode.items()
                )
                + f"  loco/q4 {out[backend][str(world)]['loco_vs_q4']:.3f}",
                flush=True,
            )
    return out


def _hook_rank(shard: int, reps: int, backend: str) -> dict:
    """One rank: median ms of one reduce-scatter of ``shard`` elements per rank, stock (gloo's
    reduce-scatter), q4 and LoCo, alternated call by call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comms = {
        "q4": LoCoReduceScatter(codecs()["q4"]),
        "loco": LoCoReduceScatter(codecs()["loco"]),
    }
    x = torch.randn(world * shard, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(shard)
    times = {"stock": [], **{name: [] for name in comms}}
    kwargs = dict(group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    with use_backend(backend):
        for rep in range(reps + 2):
            for name in list(times)[:: 1 if rep % 2 else -1]:
                dist.barrier()
                t0 = time.perf_counter()
                if name == "stock":
                    dist.reduce_scatter_tensor(out, x, **kwargs)
                else:
                    comms[name](output_tensor=out, input_tensor=x, **kwargs)
                if rep >= 2:  # the first calls allocate the error buffers and workspaces
                    times[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}


def hook_times(shard: int, reps: int, backends: list[str]) -> dict:
    out = {}
    for backend in backends:
        out[backend] = run_distributed(_hook_rank, 2, shard, reps, backend)[0]
        print(
            f"one reduce-scatter of {shard} elements per rank, {backend} codec: "
            + "  ".join(f"{m} {ms:.2f} ms" for m, ms in out[backend].items()),
            flush=True,
        )
    return out


def _fidelity_rank(
    cfg: TrainConfig, configs: dict[str, LoCoConfig], deliver: str, window: int
) -> dict:
    """One rank of a training run whose units reduce every gradient exactly and with each
    codec of ``configs``; FSDP receives the ``deliver`` one."""
    tracker = FidelityTracker(tuple(configs), cfg.steps, window)

    def parallelize_with_shadows(model, c, dims):
        par = parallelize(model, replace(c, comm="stock"), dims)  # sharded, stock comms
        comms, units = {}, {}
        for name, config in configs.items():  # each registration replaces the previous one
            handle = enable(model, CommConfig(gradients=config))
            comms[name], units = handle.reduce_scatters, handle.units
        for fqn, m in units.items():
            shadow = {name: comms[name][fqn] for name in configs}
            m.set_custom_reduce_scatter(ShadowReduceScatter(shadow, deliver, tracker, fqn))
        return par

    summary = train(cfg, parallelize=parallelize_with_shadows)
    tracker.all_reduce()
    return {
        "deliver": deliver,
        "val_loss": summary["val_loss"],
        "losses": summary["losses"],
        "summary": {m: tracker.summary(m) for m in configs},
        "curves": {
            m: {kind: tracker.curves(m, kind) for kind in ("step", "cumulative", "window")}
            for m in configs
        },
    }


def fidelity(
    world: int, base: TrainConfig, group_size: int, deliver: str, window: int = 50
) -> dict:
    """Gradient fidelity of q4 and LoCo on the trajectory of ``deliver``."""
    t0 = time.perf_counter()
    out = run_distributed(
        _fidelity_rank, world, base, codecs(group_size), deliver, window, timeout=3600
    )[0]
    out["wall_s"] = time.perf_counter() - t0
    s = out["summary"]
    print(
        f"fidelity world {world} group {group_size} on the {deliver} trajectory: "
        + "  ".join(
            f"{m} step err {s[m]['step_rel_err']:.3f} cos {s[m]['step_cosine']:.4f} "
            f"sum{base.steps} err {s[m][f'running_sum_{base.steps}_rel_err']:.4f}"
            for m in s
        )
        + f"  ({out['wall_s']:.0f} s)",
        flush=True,
    )
    return out


def _mean(results: list[dict], key) -> float:
    return statistics.mean(key(r) for r in results)


def _gaps(runs: dict, mode: str, baseline: str = "stock") -> list[float]:
    """Relative validation-loss gap of ``mode`` to the fp32 run of the same seed."""
    return [
        (r["val_loss"] - b["val_loss"]) / b["val_loss"]
        for r, b in zip(runs[mode], runs[baseline], strict=True)
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
        "bytes_ratio_loco_vs_fp32": round(wire["loco"] / wire["stock"], 4),
        "val_loss_gap_loco": round(statistics.mean(_gaps(runs, "loco")), 4),
        "val_loss_gap_q4": round(statistics.mean(_gaps(runs, "q4")), 4),
        "val_loss_gap_loco_per_seed": [round(g, 4) for g in _gaps(runs, "loco")],
        "val_loss_gap_q4_per_seed": [round(g, 4) for g in _gaps(runs, "q4")],
    }


def _finite_or_none(x: float) -> float | None:
    """JSON has no NaN: a standard error of one seed is reported as null."""
    return None if math.isnan(x) else round(x, 5)


def regime_summary(runs: dict, q4: str, loco: str, config: dict) -> dict:
    """The regime's gaps to fp32, mean and standard error over seeds, and the verdict."""
    q4_gap, q4_se = mean_and_stderr(_gaps(runs, q4))
    loco_gap, loco_se = mean_and_stderr(_gaps(runs, loco))
    diff, diff_se = mean_and_stderr(
        [a - b for a, b in zip(_gaps(runs, loco), _gaps(runs, q4), strict=True)]
    )
    return {
        "config": config,
        "seeds": len(runs[q4]),
        "q4_gap": round(q4_gap, 5),
        "q4_gap_se": _finite_or_none(q4_se),
        "loco_gap": round(loco_gap, 5),
        "loco_gap_se": _finite_or_none(loco_se),
        # paired LoCo - q4 difference (same seed and batches), relative to fp32
        "loco_minus_q4": round(diff, 5),
        "loco_minus_q4_se": _finite_or_none(diff_se),
        "q4_gap_per_seed": [round(g, 5) for g in _gaps(runs, q4)],
        "loco_gap_per_seed": [round(g, 5) for g in _gaps(runs, loco)],
        # q4 degrades beyond its standard error, and LoCo keeps at most half of that gap
        # even when both are pushed by their standard errors the unfavourable way
        "q4_degrades": q4_gap > 2 * q4_se,
        "loco_gap_at_most_half_of_q4": loco_gap + loco_se <= 0.5 * (q4_gap - q4_se),
    }


def plot_losses(runs_by_world: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs_by_world), figsize=(6 * len(runs_by_world), 3.8))
    axes = [axes] if len(runs_by_world) == 1 else list(axes)
    for ax, (title, runs) in zip(axes, runs_by_world.items(), strict=True):
        for mode, style in zip(runs, ("-", "--", ":", "-.", (0, (1, 3))), strict=False):
            per_step = list(zip(*(r["losses"] for r in runs[mode]), strict=True))
            losses = [statistics.mean(step) for step in per_step]
            smooth = [statistics.mean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
            label = f"{mode} (val {_mean(runs[mode], lambda r: r['val_loss']):.3f})"
            ax.plot(range(1, len(losses) + 1), smooth, linestyle=style, label=label)
        seeds = len(next(iter(runs.values())))
        ax.set_title(f"{title}: train loss, mean of {seeds} seed(s), 10-step mean")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(by_deliver: dict, path: Path, title: str) -> None:
    """Per-step and running-sum error vs step: q4 on its trajectory, LoCo on its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    panels = (
        ("step", "error of each step's gradient"),
        ("window", "error of the running sum (50-step windows)"),
        ("cumulative", "error of the running sum since step 1"),
    )
    for ax, (kind, name) in zip(axes, panels, strict=True):
        for method, style in (("q4", "-"), ("loco", "-")):
            rel = by_deliver[method]["curves"][method][kind]["rel_err"]
            ax.plot(range(1, len(rel) + 1), rel, style, label=f"{method} (its own trajectory)")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("|delivered - exact| / |exact|")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs, 1 seed, no sweep (< 5 min); its loss gaps are smoke_* keys, not "
        "figures (benchmarks/quality.py measures them)",
    )
    p.add_argument("--steps", type=int, default=None, help="training runs (200; 20 --quick)")
    p.add_argument("--fidelity-steps", type=int, default=None, help="(200; 30 with --quick)")
    p.add_argument("--seeds", type=int, default=None, help="regime seeds 0..N-1 (3; 1 --quick)")
    p.add_argument(
        "--codec-seeds", type=int, default=1, help="seeds of the group-128 training runs (1)"
    )
    p.add_argument("--sweep-groups", default=None, help="comma-separated (128,1024,4096)")
    p.add_argument("--sweep-worlds", default="2,4", help="comma-separated (2,4)")
    p.add_argument("--sweep-steps", type=int, default=50, help="(50)")
    p.add_argument("--regime-group", type=int, default=4096, help="group_size of the regime")
    p.add_argument(
        "--regime-lr",
        type=float,
        default=3e-4,
        help="peak learning rate of the regime (3e-4, a tenth of the example's: a low-LR phase)",
    )
    p.add_argument(
        "--regime-only", action="store_true", help="only the regime's training runs and verdict"
    )
    p.add_argument(
        "--plot-dir", default=None, help="write comm_fidelity.png, comm_regime_loss.png here"
    )
    p.add_argument("--step-time", action="store_true", help="only step times of stock / q4 / LoCo")
    p.add_argument("--step-time-worlds", default="2,4", help="comma-separated (2,4)")
    p.add_argument("--step-time-steps", type=int, default=40, help="steps per mode (40)")
    p.add_argument(
        "--step-time-backends",
        default="cpu",
        help="codec backends, comma-separated: cpu (the default path), reference (cpu)",
    )
    p.add_argument("--hook-shard", type=int, default=262144, help="elements per rank (262144)")
    a = p.parse_args(argv)
    if a.step_time:
        return main_step_time(a)
    steps = a.steps or (20 if a.quick else 200)
    fid_steps = a.fidelity_steps or (30 if a.quick else 200)
    seeds = list(range(a.seeds or (1 if a.quick else 3)))
    codec_seeds = seeds[: max(1, a.codec_seeds)]
    sweep_groups = [
        int(g) for g in (a.sweep_groups or ("" if a.quick else "128,1024,4096")).split(",") if g
    ]
    sweep_worlds = [int(w) for w in a.sweep_worlds.split(",")]
    base = TrainConfig(steps=steps, verbose=False, log_every=10**9, out="unused", val_batches=32)
    t_start = time.perf_counter()
    q4_r, loco_r = f"q4_g{a.regime_group}", f"loco_g{a.regime_group}"
    regime_config = {
        "group_size": a.regime_group,
        "world_size": 2,
        "steps": steps,
        "lr": a.regime_lr,
    }

    def train_regime() -> dict:
        # 4-bit rounding zeroes a group's small components every step; at a low learning
        # rate the optimizer cannot outrun that, and error feedback is what sends them
        regime = codecs(a.regime_group)
        return run(
            2,
            replace(base, lr=a.regime_lr),
            seeds,
            {"stock": None, q4_r: regime["q4"], loco_r: regime["loco"]},
        )

    if a.regime_only:
        regime_runs = train_regime()
        result = {
            "bench": "comm",
            "machine": MACHINE,
            "steps": steps,
            "seeds": len(seeds),
            "degradation_regime": regime_summary(regime_runs, q4_r, loco_r, regime_config),
            "wall_s": round(time.perf_counter() - t_start),
        }
        print(json.dumps(result), flush=True)
        return result

    # 1. fidelity: group 128 on 2 ranks, on the trajectory of q4 and of LoCo
    fid_base = replace(base, steps=fid_steps)
    by_deliver = {m: fidelity(2, fid_base, 128, deliver=m) for m in ("q4", "loco")}
    head = {m: by_deliver[m]["summary"][m] for m in ("q4", "loco")}
    key = f"running_sum_{fid_steps}_rel_err"

    # 2. sweep on the fp32 trajectory: both codecs on the very same gradients
    sweep = []
    for world in sweep_worlds if sweep_groups else []:
        for group in sweep_groups:
            out = fidelity(world, replace(base, steps=a.sweep_steps), group, deliver="exact")
            row = {"world_size": world, "group_size": group}
            for method, metrics in out["summary"].items():
                row.update({f"{method}_{k}": round(v, 5) for k, v in metrics.items()})
            sweep.append(row)

    # 3. training loss in the regime, then the default codec against its own fp32 runs
    regime_runs = train_regime()
    at_128 = run(2, base, codec_seeds, {"stock": None, **codecs()})
    quality = summarize(at_128)
    if a.quick:  # one seed, a few steps: a smoke check, not a quality figure
        quality = {
            (f"smoke_{k}" if k.startswith("val_loss_gap") else k): v for k, v in quality.items()
        }
    result = {
        "bench": "comm",
        "machine": MACHINE,
        "steps": steps,
        "seeds": len(seeds),
        "world_size": 2,
        # paired gaps over 5 seeds and 300 steps, with standard errors: benchmarks/quality.py
        "quality_benchmark": "benchmarks/quality.py",
        **quality,
        "fidelity_steps": fid_steps,
        "running_sum_rel_err_q4": round(head["q4"][key], 5),
        "running_sum_rel_err_loco": round(head["loco"][key], 5),
        "running_sum_ratio_loco_vs_q4": round(head["loco"][key] / head["q4"][key], 4),
        "fidelity": {m: {k: round(v, 5) for k, v in head[m].items()} for m in head},
        "fidelity_shadow": {  # each codec measured on the other's trajectory
            m: {k: round(v, 5) for k, v in by_deliver[other]["summary"][m].items()}
            for m, other in (("q4", "loco"), ("loco", "q4"))
        },
        "sweep": sweep,
        "degradation_regime": regime_summary(regime_runs, q4_r, loco_r, regime_config),
        "wall_s": round(time.perf_counter() - t_start),
    }
    if a.plot_dir:
        out_dir = Path(a.plot_dir)
        plot_fidelity(
            by_deliver,
            out_dir / "comm_fidelity.png",
            f"group 128, 2 ranks, {fid_steps} steps of the example model",
        )
        plot_losses(
            {
                f"group {a.regime_group}, lr {a.regime_lr:g}": regime_runs,
                "group 128": at_128,
            },
            out_dir / "comm_regime_loss.png",
        )
    print(json.dumps(result), flush=True)
    return result


def main_step_time(a: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    backends = [b for b in a.step_time_backends.split(",") if b]
    worlds = [int(w) for w in a.step_time_worlds.split(",") if w]
    hooks = hook_times(a.hook_shard, 20, backends)
    base = TrainConfig(
        steps=a.step_time_steps, verbose=False, log_every=10**9, out="unused", val_batches=1
    )
    steps = step_times(base, worlds, backends)
    first = steps[backends[0]]
    result = {
        "bench": "comm_step_time",
        "machine": MACHINE,
        "link": "loopback (no cap)",
        "steps": a.step_time_steps,
        "hook_shard": a.hook_shard,
        "hook_ms": hooks,
        "step_time": steps,
        "loco_step_overhead_vs_q4_max": round(max(first[w]["loco_vs_q4"] for w in first) - 1, 4),
        "wall_s": round(time.perf_counter() - t_start),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
