"""Train a small byte-level LM on CPython's standard library with fsdp-ext.

    python examples/train.py --nproc-per-node 2 --out runs/demo      # launches torchrun itself
    torchrun --nproc-per-node 2 examples/train.py --out runs/demo      # or under your own torchrun

Read top to bottom: the model is sharded (``parallelize``), trained (``train``), checkpointed
(``checkpointer``). Launching lives in examples/launch.py, the report in report.py, resuming
in recovery.py; the flags are the fields of ``TrainConfig`` (examples/config.py). Every step's
global batch is a pure function of (seed, step), so a resumed run sees exactly the data the
straight run would have seen.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:  # importing torch takes seconds: a Ctrl-C meanwhile is one line and status 130
        import fsdp_ext
    except KeyboardInterrupt:
        print("train.py: interrupted while importing torch", file=sys.stderr)
        sys.exit(130)

import torch
import torch.distributed as dist

import fsdp_ext
from examples.config import (
    WRAP_POLICIES,
    TrainConfig,
    check_world,
    decide_comm,
    parse_args,
    run_record,
)
from examples.data import get_batch, unigram_entropy
from examples.launch import FENCED, init_distributed, launch_owning
from examples.model import Transformer
from examples.parallel import Parallel, parallelize, shard_model
from examples.recovery import RNGState, ending, resume_step, snapshots
from examples.report import report
from examples.startup import StartupClock, cached_corpus
from fsdp_ext.checkpoint import LEASE_ENV
from fsdp_ext.job import exit_with_launcher

__all__ = ["FENCED", "WRAP_POLICIES", "Parallel", "TrainConfig", "main", "parallelize"]
__all__ += ["parse_args", "shard_model", "train"]


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


# ---------------------------------------------------------------- checkpoints


def checkpointer(
    cfg: TrainConfig, par: Parallel, optimizer, scheduler, device
) -> fsdp_ext.Checkpointer:
    """Model parts and optimizer (fqn-keyed, flattened), the LR schedule, this rank's RNG
    streams and the gradient codec's error buffers, under --out/checkpoints, --keep of them;
    it owns the directory for this job's life (refusing a second live job) and resumes from
    the newest intact checkpoint. The data position is the step: batches are a pure function
    of it."""
    extra = {"scheduler": scheduler, "rng": RNGState(device)}
    if par.comm is not None and par.comm.gradient_config is not None:
        extra["comm"] = par.comm
    optimizers = [optimizer] * len(par.parts)
    return fsdp_ext.Checkpointer(
        cfg.checkpoint_root, model=par.parts, optimizer=optimizers, extra=extra, keep=cfg.keep,
        lease_s=cfg.lease,
        overlap_staging=True,  # this loop writes parameters only through the optimizer
    )  # fmt: skip


# ---------------------------------------------------------------- the training loop


@dataclass
class Run:
    """One job's training state, as the loop reads it."""

    cfg: TrainConfig
    par: Parallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dims: fsdp_ext.ParallelDims
    device: torch.device
    log: Callable[..., None]
    ckpt: fsdp_ext.Checkpointer | None = None
    snaps: object | None = None  # in-memory snapshots (--snapshot-every), or None

    def batch(self, data: torch.Tensor, seed: int, step: int) -> tuple[torch.Tensor, ...]:
        """This data-parallel rank's slice of the global batch of ``step``."""
        cfg, dims = self.cfg, self.dims
        local = cfg.batch_size // dims.dp
        at = (dims.dp_flat_mesh.get_local_rank() if dims.dp > 1 else 0) * local
        x, y = get_batch(data, seed=seed, step=step, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        return x[at : at + local].to(self.device), y[at : at + local].to(self.device)


def train(
    cfg: TrainConfig,
    clock: StartupClock | None = None,
    *,
    parallelize: Callable[..., Parallel] = parallelize,
) -> dict:
    """Train inside an initialised process group; return the per-step losses and summary.
    ``clock``: this worker's start, reported by rank 0 after the first step; ``parallelize``
    (default :func:`parallelize`) shards the model and returns its :class:`Parallel`."""
    clock = clock or StartupClock()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world(cfg, world)
    cuda = cfg.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model).to(device)
    dims = fsdp_ext.ParallelDims(world, ep=cfg.ep, pp=cfg.pp)
    dims.build_mesh(device.type)
    cfg = decide_comm(cfg, model, world)  # --comm auto: measured, decided on rank 0
    if cfg.auto is not None and rank == 0 and (cfg.explain or cfg.verbose):
        print(cfg.auto.explain() if cfg.explain else cfg.auto.summary(), flush=True)
    par = parallelize(model, cfg, dims)
    params = [p for part in par.parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    clock.mark("model")
    log = print if cfg.verbose and rank == 0 else _silent
    run = Run(cfg, par, optimizer, scheduler, dims, device, log)
    mode = cfg.resume_mode()
    if cfg.ckpt_every or mode == "always":
        run.ckpt = checkpointer(cfg, par, optimizer, scheduler, device)
    try:
        run.snaps = snapshots(cfg, run.ckpt, fresh=mode == "never")
        summary = _train_loop(run, mode, clock)
        if run.snaps is not None:
            run.snaps.clear()  # the job is done: nothing of it stays in the nodes' RAM
        return summary
    finally:
        if run.ckpt is not None:
            run.ckpt.close()


def _train_loop(run: Run, mode: str, clock: StartupClock) -> dict:
    cfg, par, log = run.cfg, run.par, run.log
    params = [p for part in par.parts for p in part.parameters()]
    corpus = cached_corpus()
    clock.mark("corpus")
    step = 0
    if mode == "always":
        step = resume_step(cfg, run.ckpt, run.snaps, log)
    elif run.ckpt is not None and dist.get_rank() == 0:
        record = run_record(cfg, dist.get_world_size())
        cfg.write_run_record(record)
    clock.mark("load")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses, step_ms = [], []
    start_step = step
    end_step = min(cfg.steps, start_step + cfg.stop_after) if cfg.stop_after else cfg.steps
    every = cfg.straggler_every
    watch = fsdp_ext.StragglerWatch(every=every) if every else None
    while step < end_step:
        t0 = time.perf_counter()
        if watch is not None:
            watch.begin()
        losses.append(par.train_step(*run.batch(corpus.train, cfg.seed, step)))
        fsdp_ext.clip_grad_norm_(params, cfg.grad_clip, pp_mesh=par.pp_mesh)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        step += 1
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if watch is not None and (straggler := watch.end(step)) is not None:
            log(straggler)
        if not clock.reported:
            clock.mark("first step")
            clock.reported = True
            log(clock.line())
        if step % cfg.log_every == 0 or step == end_step:
            ms = statistics.median(step_ms[-cfg.log_every :])
            log(
                f"step {step:5d} | loss {losses[-1]:.4f} | "
                f"{tokens_per_step / ms * 1e3:8.0f} tok/s | {ms:7.1f} ms/step"
            )
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            run.ckpt.save(step, blocking=not cfg.async_save)
        if run.snaps is not None and step % cfg.snapshot_every == 0:
            run.snaps.save(step)
    val_loss = _validate(run, corpus.val)
    entropy = unigram_entropy(corpus.train)
    median_ms = statistics.median(step_ms) if step_ms else None
    gradients = par.comm is not None and par.comm.gradient_config is not None
    weights = par.comm is not None and par.comm.weights is not None
    log(f"validation loss {val_loss:.4f} nats | unigram entropy of the bytes {entropy:.4f} nats")
    return {
        "start_step": start_step,
        "steps": step,
        "losses": losses,
        "val_loss": val_loss,
        "unigram_entropy": entropy,
        "step_ms": median_ms,
        "tokens_per_s": tokens_per_step / median_ms * 1e3 if median_ms else None,
        "world_size": dist.get_world_size(),
        "comm_stats": asdict(par.comm.stats) if gradients else None,
        "weight_stats": asdict(par.comm.weight_stats) if weights else None,
        "comm_auto": None if cfg.auto is None else cfg.auto.choice.name,
    }


def _validate(run: Run, data: torch.Tensor) -> float:
    """Mean loss of --val-batches validation batches, in eval mode."""
    for part in run.par.parts:
        part.eval()
    with torch.no_grad():
        val = [
            run.par.eval_step(*run.batch(data, run.cfg.seed + 1, i))
            for i in range(run.cfg.val_batches)
        ]
    for part in run.par.parts:
        part.train()
    return sum(val) / run.cfg.val_batches


def _silent(*_args, **_kwargs) -> None:
    pass


# ---------------------------------------------------------------- the program


def main(argv: list[str] | None = None, *, own_process_group: bool = True) -> dict | None:
    """Parse ``argv`` and train. ``own_process_group=False``: a caller that holds the
    default process group already (one job for several runs) keeps it, open."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    os.environ[LEASE_ENV] = repr(cfg.lease)  # the lease of this job's checkpoint locks too
    if cfg.nproc_per_node is not None:
        launch_owning(argv, cfg, __file__)
        return None
    exit_with_launcher()  # under torchrun: an orphan never keeps training
    clock = StartupClock()
    clock.mark("interpreter+imports")
    if own_process_group:
        init_distributed(cfg)
    clock.mark("process group")
    try:
        t0 = time.perf_counter()
        try:
            summary = train(cfg, clock)
        except fsdp_ext.DirectoryOwnedError as exc:
            _fail(f"argument --out: {exc}", 2)
        except (
            fsdp_ext.DirectoryFencedError
        ) as exc:  # another job took --out over: stop, write nothing
            _fail(f"argument --out: {exc}", FENCED)
        except fsdp_ext.CheckpointSpaceError as exc:
            _fail(str(exc), 1)
        except fsdp_ext.checkpoint.BlobAccessError as exc:  # the S3 server died mid-run
            _fail(f"argument --out: {exc}", 1)
        if dist.get_rank() == 0:
            report(cfg, summary, time.perf_counter() - t0)
        return summary
    finally:
        if own_process_group:
            dist.destroy_process_group()


def _fail(message: str, status: int) -> None:
    """One line from rank 0, then every rank exits with ``status``."""
    if dist.get_rank() == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    with ending():
        main()
