"""Train a small byte-level LM on CPython's standard library with fsdp-ext.

    python examples/train.py --nproc-per-node 2 --out runs/demo      # launches torchrun itself
    torchrun --nproc-per-node 2 examples/train.py --out runs/demo      # or under your own torchrun

With --nproc-per-node the arguments are checked before any worker starts, so a bad one costs
one line instead of a launcher traceback. Without either, it runs as a single process.
Every step's global batch is a pure function of (seed, step), so a resumed run sees exactly
the data the straight run would have seen. The flags are the fields of `TrainConfig`
(examples/config.py); the model and the data live in examples/model.py and data.py.
"""

from __future__ import annotations

import json
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
        import fsdp_ext  # noqa: F401
    except KeyboardInterrupt:
        print("train.py: interrupted while importing torch", file=sys.stderr)
        sys.exit(130)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.config import (
    DTYPES,
    RUN_RECORD,
    WRAP_POLICIES,
    TrainConfig,
    check_world,
    comm_settings,
    decide_comm,
    parse_args,
    run_record,
)
from examples.data import get_batch, unigram_entropy
from examples.model import Transformer
from examples.recovery import ending, resume_step, snapshots
from examples.startup import StartupClock, cached_corpus
from fsdp_ext import (
    Checkpointer,
    CheckpointSpaceError,
    CommHandle,
    DirectoryFencedError,
    DirectoryOwnedError,
    ParallelDims,
    apply_expert_parallel,
    build_pipeline,
    clip_grad_norm_,
    node_local_reshard,
    pipeline_step,
    reduce_pipeline_loss,
    shard_moe_model,
)
from fsdp_ext.checkpoint import (
    LAUNCHER_PID_ENV,
    LEASE_ENV,
    RUN_ID_ENV,
    claim,
    exit_with_launcher,
)
from fsdp_ext.comm import enable

__all__ = [
    "WRAP_POLICIES",
    "Parallel",
    "TrainConfig",
    "attach_comm",
    "main",
    "parallelize",
    "parse_args",
    "shard_model",
    "train",
]


# ---------------------------------------------------------------- parallelism: the one seam


@dataclass
class Parallel:
    """What the training loop needs from the parallel layout, pipelined or not."""

    parts: list[nn.Module]  # this rank's model parts: the whole model, or its pp stages
    comm: CommHandle | None  # --comm/--qwz/--hpz's handle (None: all stock); LoCo's
    # error buffers are checkpointed
    train_step: Callable[[torch.Tensor, torch.Tensor], float]  # forward + backward: global loss
    eval_step: Callable[[torch.Tensor, torch.Tensor], float]  # forward only: global loss
    pp_mesh: DeviceMesh | None = None  # for the gradient norm over the stages


def parallelize(
    model: Transformer,
    cfg: TrainConfig,
    dims: ParallelDims,
    *,
    attach: Callable[[Transformer, TrainConfig], object] | None = None,
) -> Parallel:
    """Shard the model over the mesh: FSDP (+ experts over ep), pipelined under --pp > 1.
    ``attach`` puts the comms on the FSDP units (default :func:`attach_comm`, the flags'),
    the seam through which a benchmark installs its own codec."""
    if cfg.pp > 1:
        return pipelined(model, cfg, dims)
    return sharded(model, cfg, dims, attach=attach or attach_comm)


def _mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32)


def shard_model(model: Transformer, cfg: TrainConfig, dims: ParallelDims) -> Transformer:
    """Experts over ep, one FSDP unit per expert group, the --wrap policy's units, the root;
    under hpZ (the job's CommConfig) each unit keeps its post-forward copy inside the node."""
    apply_expert_parallel(model, dims)
    policy = WRAP_POLICIES[cfg.wrap]
    kwargs = {}
    comm = comm_settings(cfg, dims.world_size)
    if comm.hpz:
        kwargs["reshard_after_forward"] = node_local_reshard(dims.dp_mesh, comm.node_size)
    return shard_moe_model(
        model, dims, auto_wrap_policy=policy, mp_policy=_mp_policy(cfg), **kwargs
    )


def attach_comm(model: Transformer, cfg: TrainConfig) -> CommHandle | None:
    """--comm's codec, --qwz's int8 all-gather and --hpz's check on every FSDP unit, through
    one ``fsdp_ext.comm.enable``; None when all three are stock."""
    settings = comm_settings(cfg, dist.get_world_size())
    return enable(model, settings) if settings.enabled else None


def sharded(
    model: Transformer,
    cfg: TrainConfig,
    dims: ParallelDims,
    attach: Callable[[Transformer, TrainConfig], object] = attach_comm,
) -> Parallel:
    """FSDP over the whole model (experts over --ep), ``attach``'s comm (--comm) on every
    unit."""
    shard_model(model, cfg, dims)
    world = dist.get_world_size()

    def global_mean(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / world

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        return global_mean(loss)

    def eval_step(x: torch.Tensor, y: torch.Tensor) -> float:
        return global_mean(lm_loss(model(x), y))

    return Parallel([model], attach(model, cfg), train_step, eval_step)


def pipelined(model: Transformer, cfg: TrainConfig, dims: ParallelDims) -> Parallel:
    """1F1B over --pp stages; inside each: experts over --ep, FSDP over dp, --comm per unit."""
    schedule, stages = build_pipeline(
        model,
        dims,
        schedule="1F1B",
        n_microbatches=cfg.microbatches,
        loss_fn=lm_loss,
        auto_wrap_policy=WRAP_POLICIES[cfg.wrap],
        comm=comm_settings(cfg, dist.get_world_size()),
        mp_policy=_mp_policy(cfg),
    )

    def step(x: torch.Tensor, y: torch.Tensor, forward_only: bool = False) -> float:
        losses = pipeline_step(schedule, stages, x, y, forward_only=forward_only)
        return reduce_pipeline_loss(losses, stages, dims)

    return Parallel(
        [s.submod for s in stages],
        stages[0].comm_handle,
        step,
        lambda x, y: step(x, y, forward_only=True),
        dims.pp_mesh,
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


# ---------------------------------------------------------------- checkpoints


class RNGState(Stateful):
    """This rank's RNG streams, under a per-rank key (DCP keeps one copy of a shared key)."""

    def __init__(self, device: torch.device):
        self.key = f"rank{dist.get_rank()}"
        self.cuda = device.type == "cuda"

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.cuda:
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state[self.key]["cpu"])
        if self.cuda:
            torch.cuda.set_rng_state(state[self.key]["cuda"])


def checkpointer(cfg: TrainConfig, par: Parallel, optimizer, scheduler, device) -> Checkpointer:
    """Model parts and optimizer (fqn-keyed, flattened), the LR schedule, this rank's RNG
    streams and LoCo's error buffers, under --out/checkpoints, --keep of them; it owns the
    directory for this job's life (refusing a second live job) and resumes from the newest
    intact checkpoint. The data position is the step: batches are a pure function of it."""
    extra = {"scheduler": scheduler, "rng": RNGState(device)}
    if par.comm is not None and par.comm.gradient_config is not None:
        extra["comm"] = par.comm
    return Checkpointer(
        cfg.checkpoint_root,
        model=par.parts,
        optimizer=[optimizer] * len(par.parts),
        extra=extra,
        keep=cfg.keep,
        lease_s=cfg.lease,
    )


# ---------------------------------------------------------------- the training loop


def train(
    cfg: TrainConfig,
    clock: StartupClock | None = None,
    *,
    parallelize: Callable[..., Parallel] = parallelize,
) -> dict:
    """Train inside an initialised process group; return the per-step losses and summary.
    ``clock``: this worker's start, reported by rank 0 after the first step. ``parallelize``
    (default :func:`parallelize`) shards the model and returns its :class:`Parallel`: the
    seam through which a benchmark measures or swaps the comms."""
    clock = clock or StartupClock()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world(cfg, world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else None
    device = device or torch.device("cpu")
    log = print if cfg.verbose and rank == 0 else _silent

    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model).to(device)
    dims = ParallelDims(world, ep=cfg.ep, pp=cfg.pp)
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
    mode = cfg.resume_mode()
    ckpt = None
    if cfg.ckpt_every or mode == "always":
        ckpt = checkpointer(cfg, par, optimizer, scheduler, device)
    try:
        snaps = snapshots(cfg, ckpt, fresh=mode == "never")
        summary = _train_loop(
            cfg, par, params, optimizer, scheduler, (ckpt, snaps), mode, dims, device, log, clock
        )
        if snaps is not None:
            snaps.clear()  # the job is done: nothing of it stays in the nodes' RAM
        return summary
    finally:
        if ckpt is not None:
            ckpt.close()


def _train_loop(
    cfg, par, params, optimizer, scheduler, saving, mode, dims, device, log, clock
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt, snaps = saving  # disk checkpoints, in-memory snapshots (or None)
    corpus = cached_corpus()
    clock.mark("corpus")
    step = 0
    if mode == "always":
        step = resume_step(cfg, ckpt, snaps, log)
    elif ckpt is not None and rank == 0:
        record = run_record(cfg, world)
        (cfg.checkpoint_root / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    clock.mark("load")

    # each data-parallel rank trains on its slice of the global batch
    local = cfg.batch_size // dims.dp
    dp_rank = dims.dp_flat_mesh.get_local_rank() if dims.dp > 1 else 0

    def batch(data: torch.Tensor, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(data, seed=seed, step=step, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        return tuple(t[dp_rank * local : (dp_rank + 1) * local].to(device) for t in (x, y))

    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses, step_ms = [], []
    start_step = step
    end_step = min(cfg.steps, start_step + cfg.stop_after) if cfg.stop_after else cfg.steps
    while step < end_step:
        t0 = time.perf_counter()
        losses.append(par.train_step(*batch(corpus.train, cfg.seed, step)))
        clip_grad_norm_(params, cfg.grad_clip, pp_mesh=par.pp_mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        step_ms.append((time.perf_counter() - t0) * 1e3)
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
            ckpt.save(step, blocking=not cfg.async_save)
        if snaps is not None and step % cfg.snapshot_every == 0:
            snaps.save(step)

    for part in par.parts:
        part.eval()
    with torch.no_grad():
        val = [par.eval_step(*batch(corpus.val, cfg.seed + 1, i)) for i in range(cfg.val_batches)]
    for part in par.parts:
        part.train()
    val_loss = sum(val) / cfg.val_batches
    entropy = unigram_entropy(corpus.train)
    median_ms = statistics.median(step_ms) if step_ms else None
    gradients = None if par.comm is None or par.comm.gradient_config is None else par.comm
    log(f"validation loss {val_loss:.4f} nats | unigram entropy of the bytes {entropy:.4f} nats")
    return {
        "start_step": start_step,
        "steps": step,
        "losses": losses,
        "val_loss": val_loss,
        "unigram_entropy": entropy,
        "step_ms": median_ms,
        "tokens_per_s": tokens_per_step / median_ms * 1e3 if median_ms else None,
        "world_size": world,
        "comm_stats": None if gradients is None else asdict(gradients.stats),
        "weight_stats": None
        if par.comm is None or par.comm.weights is None
        else asdict(par.comm.weight_stats),
        "comm_auto": None if cfg.auto is None else cfg.auto.choice.name,
    }


def _silent(*_args, **_kwargs) -> None:
    pass


# ---------------------------------------------------------------- launch and report


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


def init_distributed(cfg: TrainConfig) -> None:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:  # launched by torchrun
        store, rank, world = next(dist.rendezvous("env://"))
        if _one_agent_sharing_its_store():
            # torchrun hands every restart attempt the store of the first, with no
            # per-attempt prefix: a restarted rank's gloo could read a dead rank's address
            # from it and fail in connectFullMesh ("Connection refused"). With one agent,
            # its restart count names the attempt on every rank; several nodes should run
            # with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a store per round), as the lab does.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"fsdp_ext/attempt-{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _one_agent_sharing_its_store() -> bool:
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("GROUP_WORLD_SIZE") == "1"
    )


FENCED = 3  # the exit status of a job that lost --out to another job
LAUNCHER_FLAGS = ("--nproc-per-node", "--max-restarts")  # torchrun's, not the workers'
NOT_RECORDED = ("verbose", "nproc_per_node", "max_restarts", "auto")  # not in the run's JSON line


def launch(argv: list[str], cfg: TrainConfig) -> None:
    """Re-run this script under torchrun, without the launcher flags."""
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for arg in argv:
        if skip or arg.startswith(LAUNCHER_FLAGS):
            skip = arg in LAUNCHER_FLAGS
            continue
        rest.append(arg)
    launcher = [f"--nproc-per-node={cfg.nproc_per_node}", f"--max-restarts={cfg.max_restarts}"]
    torchrun(["--standalone", *launcher, __file__, *rest])


def _rounded(value: float | None, digits: int | None = None) -> float | None:
    return None if value is None else round(value, digits)


def launch_owning(argv: list[str], cfg: TrainConfig) -> None:
    """Own --out's checkpoints for the whole job, torchrun's restarts included, then launch.

    The workers inherit the run id and this launcher's pid: they join its ownership, and
    die with it (fsdp_ext.exit_with_launcher)."""
    os.environ.setdefault(RUN_ID_ENV, f"train-{os.getpid()}-{time.time_ns():x}")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        owner = claim(cfg.checkpoint_root, lease_s=cfg.lease)
    except DirectoryOwnedError as exc:
        print(f"train.py: error: argument --out: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        launch(argv, cfg)
    except BaseException:
        lost = owner.fence.lost()
        if lost is None:
            raise
        print(f"train.py: error: argument --out: {lost}", file=sys.stderr, flush=True)
        sys.exit(FENCED)
    finally:
        owner.release()


def main(argv: list[str] | None = None, *, own_process_group: bool = True) -> dict | None:
    """Parse ``argv`` and train. ``own_process_group=False``: a caller that holds the
    default process group already (one job for several runs) keeps it, open."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    os.environ[LEASE_ENV] = repr(cfg.lease)  # the lease of this job's checkpoint locks too
    if cfg.nproc_per_node is not None:
        launch_owning(argv, cfg)
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
        except DirectoryOwnedError as exc:
            if dist.get_rank() == 0:
                print(f"train.py: error: argument --out: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        except DirectoryFencedError as exc:  # another job took --out over: stop, write nothing
            if dist.get_rank() == 0:
                print(f"train.py: error: argument --out: {exc}", file=sys.stderr, flush=True)
            sys.exit(FENCED)
        except CheckpointSpaceError as exc:
            if dist.get_rank() == 0:
                print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)
        wall_s = time.perf_counter() - t0
        if dist.get_rank() == 0:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            losses, entropy = summary["losses"], summary["unigram_entropy"]
            plot_losses(losses, summary["start_step"], out / "loss.png", entropy)
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
        return summary
    finally:
        if own_process_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    with ending():
        main()
