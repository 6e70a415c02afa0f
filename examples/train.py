"""Train a small byte-level LM on CPython's standard library with fsdp-ext.

    python examples/train.py --nproc-per-node 2 --out runs/demo      # launches torchrun itself
    torchrun --nproc-per-node 2 examples/train.py --out runs/demo      # or under your own torchrun

With --nproc-per-node the arguments are checked before any worker starts, so a bad one costs
one line instead of a launcher traceback. Without either, it runs as a single process.
Every step's global batch is a pure function of (seed, step), so a resumed run sees exactly
the data the straight run would have seen.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.data import get_batch, load_corpus, unigram_entropy
from examples.model import Block, ModelConfig, Transformer
from fsdp_ext import (
    CommHandle,
    GranularityPolicy,
    LoCoConfig,
    ParallelDims,
    PipelineState,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    apply_expert_parallel,
    build_pipeline,
    clip_grad_norm_,
    pipeline_step,
    reduce_pipeline_loss,
    register_comm_hook,
    remove_checkpoint,
    shard_moe_model,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WRAP_POLICIES = {"granularity": GranularityPolicy(), "block": {Block}}
# gradient reduce-scatter: stock fp32, 4-bit without error feedback (qgZ), 4-bit LoCo
COMMS = {"default": None, "q4": LoCoConfig(error_feedback=False), "loco": LoCoConfig()}
# What a checkpoint's keys and shapes depend on, as the flag that sets each.
MODEL_FLAGS = {
    "dim": "--dim",
    "n_layers": "--n-layers",
    "n_heads": "--n-heads",
    "hidden_dim": "--hidden-dim",
    "num_experts": "--num-experts",
    "max_seq_len": "--seq-len",
}
RUN_RECORD = "run.json"


@dataclass
class TrainConfig:
    device: str = "cpu"
    steps: int = 250
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    model: ModelConfig = field(default_factory=ModelConfig)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ep: int = 1  # expert-parallel degree: experts split over this many ranks
    pp: int = 1  # pipeline stages (1F1B schedule); ep and FSDP run inside each stage
    microbatches: int = 4  # per step, under --pp > 1
    param_dtype: str = "fp32"
    wrap: str = "granularity"  # dense FSDP units: a key of WRAP_POLICIES
    comm: str = "loco"
    intra_node_size: int | None = None  # set: LoCo emulates nodes of this many ranks
    log_every: int = 25
    val_batches: int = 8
    ckpt_every: int = 0
    keep: int = 3  # complete checkpoints kept on disk (older ones are removed)
    resume: bool = False
    stop_after: int = 0  # stop this run after so many steps (0: run to `steps`)
    nproc_per_node: int | None = None  # set: launch torchrun with this many ranks
    out: str = "runs/train"
    seed: int = 0
    verbose: bool = True

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.out) / "checkpoints"


class _OneLineErrors(argparse.ArgumentParser):
    """Bad arguments give one line on stderr, not a usage block or a traceback."""

    def error(self, message: str):
        # Under torchrun every rank parses the same arguments; one of them speaks.
        quiet = os.environ.get("RANK", "0") != "0"
        self.exit(2, None if quiet else f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    m = d.model
    p = _OneLineErrors(prog="train.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--nproc-per-node",
        type=_positive_int,
        default=None,
        help="launch this many ranks on this machine through torchrun",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    p.add_argument("--steps", type=_positive_int, default=d.steps)
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="global")
    p.add_argument("--seq-len", type=_positive_int, default=d.seq_len)
    p.add_argument("--dim", type=_positive_int, default=m.dim)
    p.add_argument("--n-layers", type=_positive_int, default=m.n_layers)
    p.add_argument("--n-heads", type=_positive_int, default=m.n_heads)
    p.add_argument("--hidden-dim", type=_positive_int, default=m.hidden_dim)
    p.add_argument("--num-experts", type=int, default=m.num_experts, help="0: dense feed-forward")
    p.add_argument("--ep", type=_positive_int, default=d.ep, help="expert-parallel degree")
    p.add_argument("--pp", type=_positive_int, default=d.pp, help="pipeline-parallel degree")
    p.add_argument("--microbatches", type=_positive_int, default=d.microbatches, help="under --pp")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default=d.param_dtype)
    p.add_argument("--wrap", choices=sorted(WRAP_POLICIES), default=d.wrap, help="FSDP units")
    p.add_argument(
        "--comm", choices=list(COMMS), default=d.comm, help="gradient reduce-scatter codec"
    )
    p.add_argument(
        "--intra-node-size",
        type=_positive_int,
        default=d.intra_node_size,
        help="ranks per node for LoCo's hierarchical mode (e.g. 2 on 4 ranks emulates 2 nodes)",
    )
    p.add_argument("--log-every", type=_positive_int, default=d.log_every)
    p.add_argument("--val-batches", type=_positive_int, default=d.val_batches)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="0 disables")
    p.add_argument("--keep", type=_positive_int, default=d.keep, help="keep the last N checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--stop-after",
        type=int,
        default=d.stop_after,
        help="end this run early (schedule unchanged)",
    )
    p.add_argument("--out", default=d.out)
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> TrainConfig:
    """Parse and validate everything that can be checked before joining the process group."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.nproc_per_node is not None:
        if "RANK" in os.environ:
            parser.error("argument --nproc-per-node: not allowed under torchrun, which sets it")
        world_size = a.nproc_per_node
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda was asked for but no CUDA device is available")
    if a.batch_size % world_size:
        parser.error(
            f"argument --batch-size: {a.batch_size} is not divisible by the world size {world_size}"
        )
    if a.dim % a.n_heads:
        parser.error(f"argument --n-heads: {a.n_heads} does not divide --dim {a.dim}")
    if a.num_experts < 0:
        parser.error(f"argument --num-experts: must be >= 0, got {a.num_experts}")
    if a.ep > 1 and (a.num_experts < 1 or a.num_experts % a.ep):
        parser.error(f"argument --ep: {a.ep} does not divide --num-experts {a.num_experts}")
    try:
        ParallelDims(world_size, ep=a.ep, pp=a.pp)
    except ValueError as exc:
        parser.error(f"argument --{'pp' if 'pp' in str(exc) else 'ep'}: {exc}")
    if a.pp > 1 and a.batch_size % (world_size // a.pp * a.microbatches):
        parser.error(
            f"argument --microbatches: --batch-size {a.batch_size} must split into "
            f"{world_size // a.pp} data-parallel ranks x {a.microbatches} microbatches"
        )
    if a.pp > a.n_layers:
        parser.error(f"argument --pp: {a.pp} stages need --n-layers >= {a.pp}, got {a.n_layers}")
    model = ModelConfig(
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        hidden_dim=a.hidden_dim,
        max_seq_len=a.seq_len,
        num_experts=a.num_experts,
    )
    cfg = TrainConfig(
        device=a.device,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        model=model,
        lr=a.lr,
        ep=a.ep,
        pp=a.pp,
        microbatches=a.microbatches,
        warmup_steps=a.warmup_steps,
        param_dtype=a.param_dtype,
        wrap=a.wrap,
        comm=a.comm,
        intra_node_size=a.intra_node_size,
        log_every=a.log_every,
        val_batches=a.val_batches,
        ckpt_every=a.ckpt_every,
        keep=a.keep,
        resume=a.resume,
        stop_after=a.stop_after,
        nproc_per_node=a.nproc_per_node,
        out=a.out,
        seed=a.seed,
    )
    if cfg.resume and latest_checkpoint(cfg.checkpoint_root) is None:
        parser.error(f"argument --resume: no complete checkpoint under {cfg.checkpoint_root}")
    if cfg.resume:
        _check_resumable(parser, cfg, world_size)
    if not cfg.resume and any(cfg.checkpoint_root.glob("step-*")):
        # A fresh run must not mix its checkpoints with an older run's, nor overwrite them.
        parser.error(
            f"argument --out: {cfg.checkpoint_root} holds checkpoints of an earlier run; "
            "pass --resume to continue it, or choose another --out"
        )
    return cfg


def run_record(cfg: TrainConfig, world_size: int) -> dict:
    """What a resume must keep: the model's shape, the codec and, with LoCo, the ranks."""
    return {"model": asdict(cfg.model), "comm": cfg.comm, "world_size": world_size, "pp": cfg.pp}


def _check_resumable(parser: argparse.ArgumentParser, cfg: TrainConfig, world_size: int) -> None:
    """Refuse, in one line, a resume whose checkpoint cannot load into this run."""
    path = cfg.checkpoint_root / RUN_RECORD
    if not path.is_file():
        return
    started = json.loads(path.read_text())
    now = run_record(cfg, world_size)
    for key, flag in MODEL_FLAGS.items():
        if started["model"][key] != now["model"][key]:
            parser.error(
                f"argument {flag}: the run in {cfg.out} was started with {flag} "
                f"{started['model'][key]}, got {now['model'][key]}; its checkpoints only "
                "load into the same model"
            )
    if started["comm"] != now["comm"]:
        parser.error(
            f"argument --comm: the run in {cfg.out} was started with --comm "
            f"{started['comm']}, got {now['comm']}; its checkpoints hold that codec's state"
        )
    if started.get("pp", 1) != now["pp"]:
        parser.error(
            f"argument --pp: the run in {cfg.out} was started with --pp {started.get('pp', 1)}, "
            f"got {now['pp']}; resume at the same pp degree"
        )
    if COMMS[now["comm"]] is not None and started["world_size"] != world_size:
        parser.error(
            f"argument --nproc-per-node: the run in {cfg.out} was started with world size "
            f"{started['world_size']}, got {world_size}; --comm {now['comm']} keeps an "
            "error buffer per rank, so resume on as many ranks"
        )


def shard_model(model: Transformer, cfg: TrainConfig, dims: ParallelDims) -> Transformer:
    """Experts over ep, one FSDP unit per expert group, the --wrap policy's units, the root."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32
    )
    apply_expert_parallel(model, dims)
    return shard_moe_model(
        model, dims, auto_wrap_policy=WRAP_POLICIES[cfg.wrap], mp_policy=mp_policy
    )


def attach_comm(model: Transformer, cfg: TrainConfig) -> CommHandle | None:
    """Compressed gradient reduce-scatter on every FSDP unit (none for `--comm default`)."""
    config = COMMS[cfg.comm]
    if config is None:
        return None
    if cfg.intra_node_size is not None:  # full precision inside a node, 4-bit across nodes
        config = replace(config, intra_node_size=cfg.intra_node_size)
    return register_comm_hook(model, config)


def lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


class TrainState(Stateful):
    """Everything a resumed run needs: model, optimizer, schedule and the step counter."""

    def __init__(self, model, optimizer, scheduler):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.step = 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]


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


class PipelineTrainState(TrainState):
    """TrainState of this rank's pipeline stages: fqn-keyed model and flattened optimizer."""

    def __init__(self, stages, optimizer, scheduler):
        super().__init__(None, optimizer, scheduler)
        self.parts = PipelineState([s.submod for s in stages], [optimizer])

    def state_dict(self) -> dict:
        return {
            "parts": self.parts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.parts.load_state_dict(state["parts"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]


def build_pipelined(model: Transformer, cfg: TrainConfig, dims: ParallelDims):
    """1F1B over --pp stages; inside each: experts over --ep, FSDP over dp, --comm per unit."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32
    )
    return build_pipeline(
        model,
        dims,
        schedule="1F1B",
        n_microbatches=cfg.microbatches,
        loss_fn=lm_loss,
        auto_wrap_policy=WRAP_POLICIES[cfg.wrap],
        comm=COMMS[cfg.comm],
        mp_policy=mp_policy,
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def latest_checkpoint(root: Path) -> Path | None:
    """A save publishes a link to its complete version directory: a step-* with .metadata."""
    done = sorted(p for p in root.glob("step-*") if (p / ".metadata").is_file())
    return done[-1] if done else None


def save_checkpoint(app_state: dict, cfg: TrainConfig, step: int) -> None:
    """Spread writes over every rank, checksum every file, publish atomically, keep --keep."""
    dcp.save(
        app_state,
        storage_writer=SpreadFileSystemWriter(checkpoint_path(cfg.checkpoint_root, step)),
        planner=SpreadSavePlanner(),
    )
    if dist.get_rank() == 0:
        done = sorted(p for p in cfg.checkpoint_root.glob("step-*") if (p / ".metadata").is_file())
        for old in done[: -cfg.keep]:
            remove_checkpoint(old)  # the link, then its version directory


def load_checkpoint(app_state: dict, path: Path) -> None:
    """Verified load: sizes and checksums checked, no pickle executed."""
    reader = VerifiedFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    # RNG streams of ranks the saving run did not have stay as seeded (only a resume on
    # more ranks without LoCo gets here)
    rng_key = f"rng.{app_state['rng'].key}.cpu"
    state = app_state if rng_key in saved else {k: v for k, v in app_state.items() if k != "rng"}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())


def evaluate(model, data: torch.Tensor, cfg: TrainConfig, device: torch.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = cfg.batch_size // world
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad():
        for i in range(cfg.val_batches):
            x, y = get_batch(
                data, seed=cfg.seed + 1, step=i, batch_size=cfg.batch_size, seq_len=cfg.seq_len
            )
            x, y = (t[rank * local : (rank + 1) * local].to(device) for t in (x, y))
            total += F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    model.train()
    dist.all_reduce(total)
    return float(total) / (cfg.val_batches * world)


def evaluate_pipelined(schedule, stages, dims, data, cfg: TrainConfig) -> float:
    local = cfg.batch_size // dims.dp
    rows = slice(dims.dp_flat_mesh.get_local_rank() * local, None)
    total = 0.0
    for stage in stages:
        stage.submod.eval()
    with torch.no_grad():
        for i in range(cfg.val_batches):
            x, y = get_batch(
                data, seed=cfg.seed + 1, step=i, batch_size=cfg.batch_size, seq_len=cfg.seq_len
            )
            losses = pipeline_step(
                schedule, stages, x[rows][:local], y[rows][:local], forward_only=True
            )
            total += reduce_pipeline_loss(losses, stages, dims)
    for stage in stages:
        stage.submod.train()
    return total / cfg.val_batches


def train(cfg: TrainConfig) -> dict:
    """Train inside an initialised process group; return the per-step losses and summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else None
    device = device or torch.device("cpu")
    log = print if cfg.verbose and rank == 0 else _silent
    corpus = load_corpus()

    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model).to(device)
    dims = ParallelDims(world, ep=cfg.ep, pp=cfg.pp)
    dims.build_mesh(device.type)
    if cfg.pp > 1:
        schedule, stages = build_pipelined(model, cfg, dims)
        comm = stages[0].comm_handle
        params = [p for s in stages for p in s.submod.parameters()]
    else:
        shard_model(model, cfg, dims)
        comm = attach_comm(model, cfg)
        params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if cfg.pp > 1:
        state = PipelineTrainState(stages, optimizer, scheduler)
    else:
        state = TrainState(model, optimizer, scheduler)
    # LoCo's error buffers are checkpointed with the rest, so a resume is exact; the data
    # position is the step (batches are a pure function of seed and step)
    app_state = {"train": state, "rng": RNGState(device)}
    if comm is not None:
        app_state["comm"] = comm
    if cfg.resume:
        path = latest_checkpoint(cfg.checkpoint_root)
        if path is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {cfg.checkpoint_root}")
        load_checkpoint(app_state, path)
        log(f"resumed from {path} at step {state.step}")
    elif cfg.ckpt_every and rank == 0:
        cfg.checkpoint_root.mkdir(parents=True, exist_ok=True)
        record = run_record(cfg, world)
        (cfg.checkpoint_root / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")

    local = cfg.batch_size // dims.dp
    dp_rank = dims.dp_flat_mesh.get_local_rank() if dims.dp > 1 else 0
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses, step_ms = [], []
    start_step = state.step
    end_step = min(cfg.steps, start_step + cfg.stop_after) if cfg.stop_after else cfg.steps
    while state.step < end_step:
        t0 = time.perf_counter()
        x, y = get_batch(
            corpus.train,
            seed=cfg.seed,
            step=state.step,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        x, y = (t[dp_rank * local : (dp_rank + 1) * local].to(device) for t in (x, y))
        if cfg.pp > 1:
            microbatch_losses = pipeline_step(schedule, stages, x, y)
            losses.append(reduce_pipeline_loss(microbatch_losses, stages, dims))
        else:
            loss = lm_loss(model(x), y)
            loss.backward()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            losses.append(float(global_loss) / world)
        clip_grad_norm_(params, cfg.grad_clip, pp_mesh=dims.pp_mesh if cfg.pp > 1 else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        state.step += 1
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if state.step % cfg.log_every == 0 or state.step == end_step:
            ms = statistics.median(step_ms[-cfg.log_every :])
            log(
                f"step {state.step:5d} | loss {losses[-1]:.4f} | "
                f"{tokens_per_step / ms * 1e3:8.0f} tok/s | {ms:7.1f} ms/step"
            )
        if cfg.ckpt_every and state.step % cfg.ckpt_every == 0:
            save_checkpoint(app_state, cfg, state.step)

    if cfg.pp > 1:
        val_loss = evaluate_pipelined(schedule, stages, dims, corpus.val, cfg)
    else:
        val_loss = evaluate(model, corpus.val, cfg, device)
    entropy = unigram_entropy(corpus.train)
    median_ms = statistics.median(step_ms) if step_ms else float("nan")
    log(f"validation loss {val_loss:.4f} nats | unigram entropy of the bytes {entropy:.4f} nats")
    return {
        "start_step": start_step,
        "steps": state.step,
        "losses": losses,
        "val_loss": val_loss,
        "unigram_entropy": entropy,
        "step_ms": median_ms,
        "tokens_per_s": tokens_per_step / median_ms * 1e3,
        "world_size": world,
        "comm_stats": None if comm is None else asdict(comm.stats),
    }


def _silent(*_args, **_kwargs) -> None:
    pass


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
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def launch(argv: list[str], nproc_per_node: int) -> None:
    """Re-run this script under torchrun, without the launcher flag."""
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--nproc-per-node"):
            skip = arg == "--nproc-per-node"
            continue
        rest.append(arg)
    torchrun(["--standalone", f"--nproc-per-node={nproc_per_node}", __file__, *rest])


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.nproc_per_node is not None:
        launch(argv, cfg.nproc_per_node)
        return None
    init_distributed(cfg)
    try:
        t0 = time.perf_counter()
        summary = train(cfg)
        wall_s = time.perf_counter() - t0
        if dist.get_rank() == 0:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            plot_losses(
                summary["losses"],
                summary["start_step"],
                out / "loss.png",
                summary["unigram_entropy"],
            )
            result = {
                "train": "byte-lm",
                "world_size": summary["world_size"],
                "steps": summary["steps"],
                "final_loss": round(summary["losses"][-1], 4) if summary["losses"] else None,
                "val_loss": round(summary["val_loss"], 4),
                "unigram_entropy": round(summary["unigram_entropy"], 4),
                "tokens_per_s": round(summary["tokens_per_s"]),
                "step_ms": round(summary["step_ms"], 1),
                "wall_s": round(wall_s, 1),
                "config": {
                    k: v for k, v in asdict(cfg).items() if k not in ("verbose", "nproc_per_node")
                },
            }
            print(json.dumps(result), flush=True)
        return summary
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
