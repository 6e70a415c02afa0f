"""The main job's settings: one dataclass whose fields are its command-line flags.

A field with a help text is a flag (`batch_size` is `--batch-size`; the model's flags come
from `ModelConfig` in examples/model.py). `build_parser` makes the flags from the fields and
`parse_args` turns them back into a `TrainConfig`. Checks that need only the settings run in
`TrainConfig.__post_init__`; those that need the world size in `check_world`, and those that
read the output directory in `check_run_dir`. Each failure is a `ConfigError` naming the
flag, which the command line prints as one line (exit code 2) before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from examples.model import Block, ModelConfig
from fsdp_ext import (
    AutoDecision,
    CommConfig,
    GranularityPolicy,
    auto_config,
    plan_units,
    unit_sizes,
)
from fsdp_ext.checkpoint import (
    BEATS_PER_LEASE,
    MIN_LEASE_S,
    BlobError,
    blob_store_for,
    check_lease,
    checkpoint_steps,
    is_object_store,
    step_name,
)
from fsdp_ext.comm import STOCK, gradient_names, preset, weight_names
from fsdp_ext.job import published_steps

__all__ = [
    "AUTO",
    "DTYPES",
    "RESUME_MODES",
    "RUN_RECORD",
    "WRAP_POLICIES",
    "ConfigError",
    "TrainConfig",
    "build_parser",
    "check_run_dir",
    "check_world",
    "comm_choices",
    "comm_settings",
    "decide_comm",
    "parse_args",
    "run_record",
    "weights_name",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WRAP_POLICIES = {"granularity": GranularityPolicy(), "block": {Block}}
AUTO = "auto"  # --comm auto: measured at startup, see decide_comm
QWZ = "int8"  # --qwz's weight codec (forward only: --qwz-forward-only)


def comm_choices() -> tuple[str, ...]:
    """--comm's choices: the gradient names of fsdp_ext.comm (stock and every registered
    codec, read when the flags are built, so a codec registered before is one), and auto."""
    return (*gradient_names(), AUTO)


RUN_RECORD = "run.json"  # what a run's checkpoints are bound to (see run_record)
RESUME_MODES = ("auto", "always", "never")


class ConfigError(ValueError):
    """A bad setting, with the flag that sets it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


def _node_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {text!r}") from None


def _arg(default: Any, help: str, **metadata: Any) -> Any:
    """A field offered as a flag: its help text, bounds (`low`: least value, `above`: what
    it must exceed) and argparse settings (`type`, `choices`)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class TrainConfig:
    nproc_per_node: int | None = _arg(
        None, "launch this many ranks on this machine through torchrun", low=1, type=int
    )
    max_restarts: int = _arg(
        0,
        "with --nproc-per-node: torchrun restarts the workers up to N times after a failure "
        "(they resume from the newest intact checkpoint under --out)",
        low=0,
    )
    device: str = _arg(
        "cpu", "cpu (gloo) or cuda (nccl, one GPU per rank)", choices=("cpu", "cuda")
    )
    steps: int = _arg(250, "optimizer steps of the whole run; the LR schedule spans them", low=1)
    batch_size: int = _arg(
        16, "global batch in sequences, split over the data-parallel ranks", low=1
    )
    seq_len: int = _arg(128, "bytes per sequence", low=1)
    model: ModelConfig = field(default_factory=ModelConfig)  # its flags come in here
    ep: int = _arg(1, "expert-parallel degree: experts split over this many ranks", low=1)
    pp: int = _arg(1, "pipeline stages (1F1B); experts and FSDP run inside each stage", low=1)
    microbatches: int = _arg(4, "microbatches per step, under --pp > 1", low=1)
    lr: float = _arg(3e-3, "peak learning rate (AdamW)", above=0.0)
    min_lr_ratio: float = 0.1
    warmup_steps: int = _arg(20, "linear warm-up steps before the cosine decay", low=0)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    param_dtype: str = _arg(
        "fp32", "dtype of gathered parameters (gradients reduce in fp32)", choices=tuple(DTYPES)
    )
    wrap: str = _arg(
        "granularity",
        "dense FSDP units: GranularityPolicy() or one per Block",
        choices=tuple(WRAP_POLICIES),
    )
    comm: str = _arg(
        "loco",
        "gradient reduce-scatter: stock (fp32), a codec of fsdp_ext.comm (q4: 4-bit absmax, "
        "loco: 4-bit with LoCo error feedback, or one registered); 'auto' measures the links "
        "and codecs at startup and picks gradients, --qwz and --hpz (those given win)",
        choices=comm_choices,
    )
    explain: bool = _arg(
        False, "with --comm auto: print the measurements and each candidate's predicted ms"
    )
    comm_group_size: int = _arg(
        128, "values per scale of --comm's codec (the sizes it takes: 32-4096 for q4 / loco)"
    )
    intra_node_size: int | str | None = _arg(
        None,
        "ranks per node for the 4-bit codecs (full precision inside a node, 4-bit across "
        "nodes) and --hpz ('auto': the launcher's LOCAL_WORLD_SIZE; 2 on 4 ranks emulates "
        "2 nodes)",
        type=_node_size,
    )
    qwz: bool = _arg(
        False, "ZeRO++ qwZ: all-gather the weights as block-wise int8 (the shards stay exact)"
    )
    qwz_group_size: int = _arg(
        256, "values per fp32 scale of --qwz's int8 weights (a power of two, 32-4096)"
    )
    qwz_forward_only: bool = _arg(
        False, "--qwz on the forward all-gathers only; backward gathers full precision"
    )
    hpz: bool = _arg(
        False,
        "ZeRO++ hpZ: each unit keeps its post-forward copy inside the node, so backward "
        "all-gathers never leave it (node size: --intra-node-size, else the launcher's)",
    )
    zeropp: bool = _arg(False, "the ZeRO++ stack: --comm loco --intra-node-size auto --qwz --hpz")
    no_comm_overlap: bool = _arg(
        False,
        "each compressed collective blocks where FSDP calls it: no --qwz gather started a unit "
        "ahead, no gradient exchange left running behind the unit before (the same bits)",
    )
    log_every: int = _arg(25, "steps between progress lines", low=1)
    no_plot: bool = _arg(
        False, "do not draw --out/loss.png (matplotlib costs about 1.3 s of CPU at the end)"
    )
    val_batches: int = _arg(8, "validation batches at the end of the run", low=1)
    ckpt_every: int = _arg(0, "save a checkpoint every N steps (0: never)", low=0)
    keep: int = _arg(3, "complete checkpoints kept on disk, the newest", low=1)
    async_save: bool = _arg(
        True,
        "save in the background (--no-async-save: inside the step): a save holds training "
        "only to build the state dict and copy what the next step does not wait for into host "
        "buffers (as many bytes as the state, reused from save to save); the parameters' and "
        "optimizer's copy, the write, the commit and the prune overlap training. A failure "
        "during a write falls back to the checkpoint before it: the same wall-clock time lost "
        "as a failure during a synchronous save, but up to one more interval of steps",
    )
    snapshot_every: int = _arg(
        0,
        "every N steps, keep a snapshot of each rank's shards in its node's RAM (/dev/shm) "
        "and a copy on the next node; a restart loads the freshest intact one, else the "
        "disk checkpoint (0: never; needs --ckpt-every)",
        low=0,
    )
    resume: str = _arg(
        "auto",
        "continue the run in --out from its newest intact checkpoint: 'auto' when this job "
        "saves checkpoints (--ckpt-every) and some exist, else start; 'always' (plain "
        "--resume) or fail; 'never' (a fresh run, refused if --out holds checkpoints). A "
        "torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) always resumes",
        choices=RESUME_MODES,
        nargs="?",
        const="always",
    )
    lease: float = _arg(
        60.0,
        "seconds without a heartbeat change, as another job's own clock sees it, after "
        f"which a job on another host that owned --out counts as dead and is taken over "
        f"(at least {MIN_LEASE_S:g}: {BEATS_PER_LEASE} heartbeats)",
    )
    straggler_every: int = _arg(
        0,
        "every N steps, name a rank whose own work per step (the time it ran or waited for a "
        "CPU, not for the others) is 1.5x the median rank's, in one line (0: never)",
        low=0,
    )
    stop_after: int = _arg(
        0, "end this run after N steps, schedule unchanged (0: run to --steps)", low=0
    )
    out: str = _arg(
        "runs/train",
        "output directory: checkpoints/, loss.png; or an object store, s3://BUCKET/PREFIX "
        "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID... or AWS_PROFILE)",
    )
    seed: int = _arg(0, "seed of the initial weights and of the batch order")
    verbose: bool = True
    auto: AutoDecision | None = None  # --comm auto's decision, set by decide_comm

    @property
    def on_object_store(self) -> bool:
        return is_object_store(self.out)

    @property
    def checkpoint_root(self) -> Path | str:
        if self.on_object_store:
            return f"{self.out.rstrip('/')}/checkpoints"
        return Path(self.out) / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path | str:
        if self.on_object_store:
            return f"{self.checkpoint_root}/step-{step}"
        return self.checkpoint_root / step_name(step)

    def latest_step(self) -> int | None:
        """The newest checkpoint's step: published in the catalog (s3://), or complete."""
        if self.on_object_store:
            steps = published_steps(self.checkpoint_root)
            return steps[-1] if steps else None
        latest = self.latest_checkpoint()
        return None if latest is None else int(latest.name.removeprefix("step-"))

    def read_run_record(self) -> dict | None:
        if self.on_object_store:
            store = blob_store_for(self.checkpoint_root)
            if store.head(RUN_RECORD) is None:
                return None
            return json.loads(store.get(RUN_RECORD))
        path = self.checkpoint_root / RUN_RECORD
        return json.loads(path.read_text()) if path.is_file() else None

    def write_run_record(self, record: dict) -> None:
        text = json.dumps(record, indent=1) + "\n"
        if self.on_object_store:
            blob_store_for(self.checkpoint_root).put(RUN_RECORD, text.encode())
        else:
            (self.checkpoint_root / RUN_RECORD).write_text(text)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint by step number (a step-* with .metadata); which
        one verifies is the resume's choice (fsdp_ext.latest_intact). POSIX --out only."""
        if self.on_object_store:
            return None
        done = [p for _s, p in checkpoint_steps(self.checkpoint_root)]
        done = [p for p in done if (p / ".metadata").is_file()]
        return done[-1] if done else None

    def resume_mode(self) -> str:
        """'always', 'never', or 'auto' resolved: what this start does."""
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            return "always" if self.latest_step() is not None else "never"
        if self.resume != "auto":
            return self.resume
        if self.ckpt_every and self.latest_step() is not None:
            return "always"
        return "never"

    def __post_init__(self) -> None:
        if isinstance(self.resume, bool):  # the older bool flag
            self.resume = "always" if self.resume else "never"
        for owner, f in _flag_fields():
            value = getattr(self.model if owner is ModelConfig else self, f.name)
            low, above = f.metadata.get("low"), f.metadata.get("above")
            choices = _choices(f)
            if choices is not None and value not in choices:
                raise ConfigError(_flag(f.name), f"must be one of {list(choices)}, got {value!r}")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if low is not None and value < low:
                allowed = "a positive integer" if low == 1 else f">= {low}"
                raise ConfigError(_flag(f.name), f"must be {allowed}, got {value}")
            if above is not None and value <= above:
                raise ConfigError(_flag(f.name), f"must be > {above:g}, got {value}")
        m = self.model
        if m.dim % m.n_heads:
            raise ConfigError("--n-heads", f"{m.n_heads} does not divide --dim {m.dim}")
        if 0 < m.num_experts < m.top_k:
            raise ConfigError(
                "--num-experts",
                f"{m.num_experts} is fewer than the --top-k {m.top_k} experts each token is "
                f"routed to; use 0 (a dense feed-forward) or at least {m.top_k}",
            )
        if self.seq_len > m.max_seq_len:
            raise ConfigError(
                "--seq-len", f"{self.seq_len} exceeds the model's max_seq_len {m.max_seq_len}"
            )
        if self.ep > 1 and (m.num_experts < 1 or m.num_experts % self.ep):
            raise ConfigError("--ep", f"{self.ep} does not divide --num-experts {m.num_experts}")
        if self.pp > m.n_layers:
            raise ConfigError(
                "--pp", f"{self.pp} stages need --n-layers >= {self.pp}, got {m.n_layers}"
            )
        if self.pp > 1 and self.microbatches < self.pp:
            raise ConfigError(
                "--microbatches",
                f"1F1B over --pp {self.pp} stages needs at least {self.pp} microbatches per "
                f"step, got {self.microbatches}",
            )
        self._check_zeropp()
        if self.snapshot_every and not self.ckpt_every:
            raise ConfigError(
                "--snapshot-every",
                "needs --ckpt-every N (disk checkpoints stay the source of truth; a snapshot "
                "only saves the steps since the last one)",
            )
        if self.snapshot_every and self.pp > 1:
            raise ConfigError("--snapshot-every", "not under --pp > 1; use --ckpt-every alone")
        k = self.intra_node_size
        if k is not None and k != "auto" and (not isinstance(k, int) or k < 1):
            raise ConfigError("--intra-node-size", f"must be an int >= 1 or 'auto', got {k!r}")
        if k is not None and self.comm == STOCK and not self.hpz:
            raise ConfigError(
                "--intra-node-size",
                "only the gradient codecs and --hpz work by node; --comm stock sends full "
                "precision everywhere: drop --intra-node-size, or pass --comm q4, --comm loco "
                "or --hpz",
            )
        if self.explain and self.comm != AUTO:
            raise ConfigError("--explain", f"only with --comm auto, got --comm {self.comm}")
        if self.comm == AUTO and self.pp > 1:
            raise ConfigError(
                "--comm",
                "auto is not under --pp (the pipeline builds its own units); pick one of "
                f"{', '.join(gradient_names())}",
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", "cuda was asked for but no CUDA device is available")

    def _check_zeropp(self) -> None:
        """--zeropp turns on its parts; the parts refuse what they cannot run under."""
        if self.zeropp:
            if self.comm != "loco":
                raise ConfigError(
                    "--zeropp", f"it is --comm loco --qwz --hpz; drop --comm {self.comm}"
                )
            self.qwz = self.hpz = True
            if self.intra_node_size is None:
                self.intra_node_size = "auto"
        if self.hpz and self.ep > 1:
            raise ConfigError(
                "--hpz",
                f"torch cannot reshard expert-parallel experts (--ep {self.ep}) to a node; "
                "use --ep 1 or drop --hpz",
            )
        # the codecs own their limits: building their options checks them
        if self.comm != AUTO:
            try:
                preset(self.comm, group_size=self.comm_group_size)
            except ValueError as exc:
                raise ConfigError("--comm-group-size", str(exc)) from None
        try:
            preset(QWZ, "weights", group_size=self.qwz_group_size)
        except ValueError as exc:
            raise ConfigError("--qwz-group-size", str(exc)) from None


def _choices(f: Field) -> tuple | None:
    """A flag's choices (a callable is read now: --comm's come from the codec registry)."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def _flag_fields() -> list[tuple[type, Field]]:
    """(owner, field) of every flag, in --help order: the model's flags where `model` sits."""
    out = []
    for f in fields(TrainConfig):
        if f.name == "model":
            out += [(ModelConfig, g) for g in fields(ModelConfig) if "help" in g.metadata]
        elif "help" in f.metadata:
            out.append((TrainConfig, f))
    return out


def _flag(name: str) -> str:
    """The flag that sets a field (the model's max_seq_len follows --seq-len)."""
    return "--seq-len" if name == "max_seq_len" else "--" + name.replace("_", "-")


class _OneLineErrors(argparse.ArgumentParser):
    """Bad arguments give one line on stderr, not a usage block or a traceback."""

    def error(self, message: str):
        # Under torchrun every rank parses the same arguments; one of them speaks.
        quiet = os.environ.get("RANK", "0") != "0"
        self.exit(2, None if quiet else f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """One flag per field that has a help text, with its default shown."""
    parser = _OneLineErrors(
        prog="train.py",
        description="Train a small byte-level LM on CPython's standard library with fsdp-ext.",
    )
    model_flags = parser.add_argument_group("model (examples/model.py)")
    for owner, f in _flag_fields():
        default = f.default
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if isinstance(default, bool):  # a switch on by default can be turned off: --no-...
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
            kwargs["help"] = f.metadata["help"]
        else:
            kwargs["type"] = f.metadata.get("type", type(default))
            if "choices" in f.metadata:
                kwargs["choices"] = _choices(f)
            if "nargs" in f.metadata:
                kwargs["nargs"], kwargs["const"] = f.metadata["nargs"], f.metadata["const"]
            shown = "off" if default is None else default
            kwargs["help"] = f"{f.metadata['help']} (default: {shown})"
            kwargs["metavar"] = None if "choices" in f.metadata else f.name.upper()
        (model_flags if owner is ModelConfig else parser).add_argument(_flag(f.name), **kwargs)
    return parser


def _config_from(args: argparse.Namespace) -> TrainConfig:
    model = {f.name: getattr(args, f.name) for o, f in _flag_fields() if o is ModelConfig}
    train = {f.name: getattr(args, f.name) for o, f in _flag_fields() if o is TrainConfig}
    return TrainConfig(model=ModelConfig(max_seq_len=args.seq_len, **model), **train)


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> TrainConfig:
    """Parse and check everything that can be checked before joining the process group."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = _config_from(args)
        if cfg.nproc_per_node is not None:
            if "RANK" in os.environ:
                raise ConfigError("--nproc-per-node", "not allowed under torchrun, which sets it")
            world_size = cfg.nproc_per_node
        elif cfg.max_restarts:
            where = "torchrun's own --max-restarts" if "RANK" in os.environ else "--nproc-per-node"
            raise ConfigError("--max-restarts", f"only with our launcher; pass {where}")
        try:
            check_lease(cfg.lease, "--lease")
        except ValueError as exc:
            raise ConfigError("--lease", str(exc).removeprefix("--lease ")) from None
        check_out(cfg)
        check_world(cfg, world_size)
        check_run_dir(cfg, world_size)
    except ConfigError as exc:
        parser.error(f"argument {exc.flag}: {exc.message}")
    return cfg


def node_size(cfg: TrainConfig, world_size: int) -> int | None:
    """Ranks per node of --intra-node-size (under --hpz 'auto' by default); 'auto' reads the
    launcher's LOCAL_WORLD_SIZE (our own launch is one node; a single process is a node of
    one)."""
    if cfg.auto is not None:
        return cfg.auto.layout.node_size
    k = cfg.intra_node_size
    if k is None and (cfg.hpz or cfg.comm == AUTO):
        k = "auto"
    if k != "auto":
        return k
    if cfg.nproc_per_node is not None and "RANK" not in os.environ:
        return cfg.nproc_per_node
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """The degrees, the batch split and the node size against the world size."""
    w, pp, b = world_size, cfg.pp, cfg.batch_size
    if w % pp:
        raise ConfigError("--pp", f"{pp} does not divide the world size {w}")
    dp = w // pp
    if b % dp:
        ranks = f"the world size {w}" if pp == 1 else f"the {dp} data-parallel ranks ({w} / --pp)"
        raise ConfigError("--batch-size", f"{b} is not divisible by {ranks}")
    if dp % cfg.ep:
        raise ConfigError(
            "--ep",
            f"ep={cfg.ep} must divide dp_shard={dp} (experts are split over ranks that also "
            "shard the dense model)",
        )
    if pp > 1 and b % (dp * cfg.microbatches):
        raise ConfigError(
            "--microbatches",
            f"--batch-size {b} must split into {dp} data-parallel ranks x "
            f"{cfg.microbatches} microbatches",
        )
    k = node_size(cfg, w)
    if k is not None and w % k:
        raise ConfigError("--intra-node-size", f"{k} does not divide the world size {w}")
    if k is not None and dp % k and k % dp:
        raise ConfigError(
            "--intra-node-size",
            f"nodes of {k} ranks cut the {dp}-rank data-parallel groups of --pp {pp} "
            f"unevenly; pick a divisor or a multiple of {dp}",
        )


def weights_name(cfg: TrainConfig) -> str:
    """--qwz and --qwz-forward-only as a weights name of fsdp_ext.comm."""
    if not cfg.qwz:
        return STOCK
    name = QWZ + ("_forward" if cfg.qwz_forward_only else "")
    assert name in weight_names(), name
    return name


def comm_settings(cfg: TrainConfig, world_size: int) -> CommConfig:
    """The one ``CommConfig`` of this job, which everything downstream reads (sharding for
    hpZ, ``fsdp_ext.comm.enable``, the pipeline): under --comm auto, its decision as it
    stands; else --comm at --comm-group-size (hierarchical under --intra-node-size), --qwz
    and --hpz."""
    if cfg.comm == AUTO:
        return replace(_decided(cfg).comm_config(), overlap=not cfg.no_comm_overlap)
    k = node_size(cfg, world_size)
    gradients = preset(cfg.comm, group_size=cfg.comm_group_size)
    return CommConfig(
        gradients=gradients,
        weights=preset(weights_name(cfg), "weights", group_size=cfg.qwz_group_size),
        hpz=cfg.hpz,
        hierarchical=gradients is not None and cfg.intra_node_size is not None,
        node_size="auto" if k is None else k,
        overlap=not cfg.no_comm_overlap,
    )


def _decided(cfg: TrainConfig) -> AutoDecision:
    if cfg.auto is None:
        raise RuntimeError("--comm auto: call decide_comm(cfg, model, world_size) first")
    return cfg.auto


def decide_comm(cfg: TrainConfig, model: torch.nn.Module, world_size: int) -> TrainConfig:
    """--comm auto: measure the links and codecs, decide on rank 0, broadcast (collective:
    every rank calls it, before sharding, since hpZ is a sharding choice). --qwz,
    --qwz-forward-only and --hpz fix their part; the rest is chosen. Returns the settings
    with the decision in them (unchanged for another --comm); the flags stay as given, and
    ``comm_settings`` hands the decision's ``CommConfig`` on."""
    if cfg.comm != AUTO:
        return cfg
    k = node_size(cfg, world_size)
    if cfg.hpz and k in (1, world_size):
        raise ConfigError(
            "--hpz",
            "needs ranks on more than one node and nodes of more than one rank; nodes here "
            f"hold {k} of {world_size} ranks",
        )
    fixed: dict = {}
    if cfg.qwz:
        fixed["weights"] = weights_name(cfg)
    if cfg.hpz:
        fixed["hpz"] = True
    elif cfg.ep > 1:  # torch cannot reshard expert-parallel experts to a node
        fixed["hpz"] = False
    fixed.update(_decided_before(cfg))
    plan = plan_units(model, WRAP_POLICIES[cfg.wrap])
    decision = auto_config(
        unit_sizes(model, [u.members for u in plan.units if u.fqn]),
        node_size=k,
        param_dtype=DTYPES[cfg.param_dtype],
        weight_group_size=cfg.qwz_group_size,
        **fixed,
    )
    return replace(cfg, auto=decision)


def _decided_before(cfg: TrainConfig) -> dict:
    """On --resume, the choice --comm auto made when the run started (its run record): the
    checkpoints hold that codec's state, so the resumed run keeps it, measured or not."""
    record = None if cfg.resume_mode() == "never" else cfg.read_run_record()
    return (record or {}).get("comm_auto") or {}


def run_record(cfg: TrainConfig, world_size: int) -> dict:
    """What a resume must keep (the model's shape, the codec, the pp degree; under --comm
    auto, what it chose), and the world the run started on (for the record: a resume may run
    on another)."""
    return {
        "model": asdict(cfg.model),
        "comm": cfg.comm,
        "world_size": world_size,
        "pp": cfg.pp,
        "intra_node_size": node_size(cfg, world_size),
        "comm_auto": None if cfg.auto is None else asdict(cfg.auto.choice),
    }


def check_out(cfg: TrainConfig) -> None:
    """--out must be a directory this job can write (or one it can make), checked before
    any worker starts: a file there, or a read-only mount, is one line, not a traceback. An
    object store is asked once: a missing bucket, refused credentials or an endpoint that
    does not answer is one line naming the location and the cause."""
    if cfg.on_object_store:
        try:
            blob_store_for(cfg.checkpoint_root).head("catalog.json")
        except (BlobError, ValueError) as exc:
            raise ConfigError("--out", str(exc)) from None
        return
    out = Path(cfg.out)
    for path in (out, cfg.checkpoint_root):
        if path.exists() and not path.is_dir():
            raise ConfigError("--out", f"{path} is a file, not a directory; choose another --out")
    existing = next(p for p in (cfg.checkpoint_root, *cfg.checkpoint_root.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only(existing) else "is not writable"
        raise ConfigError("--out", f"{existing} {why}; choose another --out")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def check_run_dir(cfg: TrainConfig, world_size: int) -> None:
    """A fresh run needs an --out without checkpoints; a resume one it can continue."""
    root = cfg.checkpoint_root
    if cfg.resume_mode() == "never":
        published = cfg.latest_step() is not None if cfg.on_object_store else checkpoint_steps(root)
        if published:  # never mix two runs' checkpoints, nor overwrite them
            raise ConfigError(
                "--out",
                f"{root} holds checkpoints of an earlier run; pass --resume to continue it "
                "(or --resume auto with --ckpt-every), or choose another --out",
            )
        return
    step = cfg.latest_step()
    if step is None:
        raise ConfigError("--resume", f"no complete checkpoint under {root}")
    if step >= cfg.steps:
        raise ConfigError(
            "--resume",
            f"the run in {cfg.out} is finished: its latest checkpoint is step {step} of "
            f"--steps {cfg.steps}; pass a larger --steps to train on",
        )
    record = cfg.read_run_record()
    if record is not None:
        _check_record(cfg, record, world_size)


def _check_record(cfg: TrainConfig, started: dict, world_size: int) -> None:
    """Refuse a resume whose checkpoint cannot load into this run, naming a flag that both
    launchers accept (the world size is not one of them: a resume may change it)."""
    now = run_record(cfg, world_size)
    was = f"the run in {cfg.out} was started with"
    for key, value in now["model"].items():
        if started["model"].get(key, value) != value:
            raise ConfigError(
                _flag(key),
                f"{was} {_flag(key)} {started['model'][key]}, got {value}; its checkpoints "
                "only load into the same model",
            )
    if started["comm"] != now["comm"]:
        raise ConfigError(
            "--comm",
            f"{was} --comm {started['comm']}, got {now['comm']}; its checkpoints hold that "
            "codec's state",
        )
    if started.get("pp", 1) != now["pp"]:
        raise ConfigError(
            "--pp",
            f"{was} --pp {started.get('pp', 1)}, got {now['pp']}; resume at the same pp degree",
        )
    # another world size or node size continues: DCP reshards the parameters and the
    # optimizer, the batches are a function of (seed, step), and the codec's error buffers,
    # which are per rank, start again from zero (train.py says so once)
