"""What rank 0 of train.py leaves behind: --out/loss.png and one JSON line on stdout."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

from examples.config import TrainConfig
from fsdp_ext.checkpoint import blob_store_for, is_object_store

__all__ = ["NOT_RECORDED", "plot_losses", "report"]

NOT_RECORDED = ("verbose", "nproc_per_node", "max_restarts", "auto")  # not in the run's JSON line


def plot_losses(losses: list[float], start_step: int, path: Path, entropy: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(start_step + 1, start_step + 1 + len(losses)), losses, label="train loss")
    ax.axhline(entropy, color="grey", linestyle="--", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rounded(value: float | None, digits: int | None = None) -> float | None:
    return None if value is None else round(value, digits)


def _write_plot(cfg: TrainConfig, summary: dict) -> None:
    losses, entropy = summary["losses"], summary["unigram_entropy"]
    if is_object_store(cfg.out):  # the plot goes beside the checkpoints, as an object
        plot = io.BytesIO()
        plot_losses(losses, summary["start_step"], plot, entropy)
        blob_store_for(cfg.out).put("loss.png", plot.getvalue())
    else:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        plot_losses(losses, summary["start_step"], out / "loss.png", entropy)


def report(cfg: TrainConfig, summary: dict, wall_s: float) -> None:
    """Write --out/loss.png (unless --no-plot) and print the run's one JSON line (the
    benchmarks read it)."""
    losses, entropy = summary["losses"], summary["unigram_entropy"]
    if not cfg.no_plot:
        _write_plot(cfg, summary)
    result = {
        "train": "byte-lm",
        "world_size": summary["world_size"],
        "steps": summary["steps"],
        "final_loss": _rounded(losses[-1], 4) if losses else None,
        "val_loss": _rounded(summary["val_loss"], 4),
        "unigram_entropy": _rounded(entropy, 4),
        "tokens_per_s": _rounded(summary["tokens_per_s"]),
        "step_ms": _rounded(summary["step_ms"], 1),
        "wall_s": _rounded(wall_s, 1),
        "comm_auto": summary["comm_auto"],
        "config": {k: v for k, v in asdict(cfg).items() if k not in NOT_RECORDED},
    }
    print(json.dumps(result), flush=True)
