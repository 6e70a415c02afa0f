"""How long a checkpoint save stops training: stock DCP, torch-checkpointing and ours, side by side.

    python benchmarks/checkpoint_stall.py [--quick] [--world 2] [--plot docs/checkpoint_stall.png]
    python benchmarks/checkpoint_stall.py --lab [--storage sshfs|s3] [--lab-link 200]   # root

The main job's model (examples/model.py, MoE blocks, stock fp32 gradient comms), FSDP over
``--world`` gloo ranks (examples/train.py's ``parallelize``) and AdamW, trained on the main
job's data, saves its model and optimizer state (``ModelOptimizerState``: fqn-keyed,
flattened) every ``--every`` steps into a fresh directory under ``--dir`` (default: a temp
dir on the local disk), through each writer in turn:

  stock_sync            dcp.save + FileSystemWriter (the stock synchronous save)
  stock_async_thread    dcp.async_save, AsyncCheckpointerType.THREAD, DefaultStager (reused
                        buffers, pinned on CUDA), on a gloo process group of its own, as
                        torchtitan does
  stock_async_process   dcp.async_save, AsyncCheckpointerType.PROCESS, DefaultStager with
                        shared memory (the daemon process gets the buffers without a copy)
  torch_checkpointing   torch-checkpointing 0.1.1's CheckpointManager (async staging in a
                        thread, shared-memory buffers, a writer process per rank;
                        ``optimizer.step()`` under ``manager.lock()`` as its docs say)
  ours_sync             fsdp_ext.Checkpointer.save(step)
  ours_async            fsdp_ext.Checkpointer.save(step, blocking=False), overlap_staging=True
                        as train.py sets it (the next ``optimizer.step()`` waits for the
                        copy of its tensors)

Each writer runs in fresh rank processes (plain subprocesses with env:// rendezvous, so a
writer's memory high-water mark never pollutes another's, and DCP's process mode and
torch-checkpointing may spawn their own processes). Every asynchronous writer first waits
for its previous save, as each library requires. Per save (median over the run's saves):

  blocked_ms            from the save call to training resuming, the slowest rank (with
                        torch-checkpointing, plus the wait of ``manager.lock()`` at the next
                        optimizer step, which is where its staging blocks training; with
                        ours async, plus the next step's wait for the copy, ``step_wait``)
  background_s          from training resuming to the checkpoint being durable (the future /
                        background thread done); 0 for the synchronous writers
  step_slowdown         rank 0's median step time (forward, backward, clip, optimizer; the
                        save itself excluded) over steps that ran while a write was in flight,
                        over its median over the steps between the saves that overlapped no
                        save at all (the same minutes of the same run: the clean phase before
                        the first save is reported apart, step_ms_clean_phase); null for the
                        synchronous writers (no step overlaps their write)
  step_ms_lost_per_save what the overlapped steps lost in all, per save: the sum over the
                        steps during a write of their time over that median step, over the
                        number of saves (a write spread thinner slows each step less, not
                        the steps in all)
  staging_over_state    the peak RSS growth that saving caused, over the state's bytes: read
                        from outside in /proc/PID/status. After warm-up the parent resets each
                        rank's VmHWM (clear_refs 5), the ranks train ``clean`` steps without a
                        save (their training peak), then save; the growth is VmHWM at the end
                        minus VmHWM after the clean steps, summed over ranks, over the state's
                        bytes summed over ranks. Helper processes (DCP's checkpoint daemon,
                        torch-checkpointing's writers) are reported apart, as their own VmHWM
                        (an interpreter with torch, plus what they map). For ours also from
                        ``Checkpointer.stats.staging_bytes``. On S3, each writer's client is
                        made before the reset (``open_storage``): a library, not staging.

In the cluster lab (``--lab``, root; ``python -m fsdp_ext.lab``, docs/cluster.md) each writer
runs as a job of its own on ``--world`` emulated nodes of one rank each, the links between nodes
capped at ``--lab-fabric`` Mbit/s, each node's link to the storage node at ``--lab-link``
Mbit/s, the storage node's servers at nice ``--lab-storage-nice`` (19: a storage machine of
its own, which takes no CPU the ranks could use; 0: an even share of the ranks' cores),
the checkpoints on the lab's shared sshfs directory or (``--storage s3``) its S3 server
(SeaweedFS; ours through the blob layer, stock DCP through s3fs's ``FsspecWriter``, which
``--s3fs-path`` provides; torch-checkpointing writes to local files only and is
skipped). The ranks read their own /proc (no parent on their host) and rank 0 prints each
writer's row; the JSON adds ``lab`` (storage, link rates, bytes each node sent to storage).

The last line is one JSON object: ``<metric>_<writer>`` for the six writers and for
``stock_async`` (the better of its two modes by blocked_ms), the ratios
``blocked_ours_async_over_stock_async`` and ``blocked_ours_async_over_stock_sync``, the
targets of issue #40, the load average, and each writer's per-save figures. torch-checkpointing
is optional (``pip install torch-checkpointing``): without it that writer is skipped, with the
reason in ``skipped``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WRITERS = (
    "stock_sync",
    "stock_async_thread",
    "stock_async_process",
    "torch_checkpointing",
    "ours_sync",
    "ours_async",
)
SYNC_WRITERS = ("stock_sync", "ours_sync")
STOCK_ASYNC_MODES = ("stock_async_thread", "stock_async_process")
REPORTED = ("stock_sync", "stock_async", "torch_checkpointing", "ours_sync", "ours_async")
METRICS = (
    "blocked_ms",
    "background_s",
    "step_slowdown",
    "step_ms_lost_per_save",
    "staging_over_state",
)
TARGETS = {
    "blocked_ours_async_over_stock_async": 0.5,  # at most
    "blocked_ours_async_over_stock_sync": 0.1,  # at most
    "step_slowdown_ours_async": 1.10,  # at most
    "staging_over_state_ours_async": 1.1,  # at most
}
TAG = "@stall "  # a protocol line between a rank and the parent
MB = 1 << 20

# model and run sizes: (dim, n_layers, n_heads, num_experts, batch_size, seq_len, every,
# saves, clean steps, warm-up steps). As many clean steps as timed ones: the MoE step's
# transient memory varies with the routing, and a short clean phase misses its peak, which the
# saves' phase then reads as saving's growth (1.18x the state with 6 clean steps, 0.74x with
# 30, the same code, 10:18-10:24 UTC)
FULL = dict(dim=512, n_layers=6, n_heads=8, num_experts=8, batch_size=2, seq_len=32)
FULL |= dict(every=6, saves=5, clean=30, warmup=3)
QUICK = dict(dim=64, n_layers=2, n_heads=2, num_experts=2, batch_size=2, seq_len=32)
QUICK |= dict(every=2, saves=2, clean=2, warmup=1)


def torch_checkpointing_missing() -> str | None:
    """Why torch-checkpointing's writer cannot run here (None: it can)."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as exc:
        return f"torch-checkpointing is not installed ({exc}); pip install torch-checkpointing"
    return None


# ---------------------------------------------------------------- the rank side: the writers


class _Saver:
    """One writer: ``save(step)`` blocks as that writer blocks training; ``records`` has, per
    save, the perf_counter times of the call, of training resuming and of the write being
    durable (set later, from the writer's own completion)."""

    def __init__(self, root: Path):
        self.root = root
        self.records: list[dict] = []

    def record(self, step: int, call: float) -> dict:
        rec = {"step": step, "call": call, "ret": time.perf_counter(), "done": None, "lock": 0.0}
        self.records.append(rec)
        return rec

    def optimizer_step(self, optimizer) -> float:
        """Run ``optimizer.step()``; return the seconds it waited for the save (if any)."""
        optimizer.step()
        return 0.0

    def finish(self) -> None:
        """Wait until every save is durable."""

    def close(self) -> None:
        pass

    def staging_bytes(self) -> int | None:
        return None


def stock_writer(root: str, step: int):
    """Stock DCP's writer for ``root/step-N``: ``FileSystemWriter`` on a directory, or on S3
    (``s3://``) ``FsspecWriter`` through s3fs, ``sync_files=False`` (an S3 file has no
    descriptor: its fsync falls back to ``os.sync()`` of the host; a finished put is
    durable), as ``benchmarks/checkpoint.py --lab --storage s3`` runs it."""
    import torch.distributed.checkpoint as dcp

    location = f"{root}/step-{step}"
    if not root.startswith("s3://"):
        return dcp.FileSystemWriter(location)
    from fsdp_ext.testing import fsspec_writer_and_reader

    fsspec_writer, _ = fsspec_writer_and_reader()
    return fsspec_writer(location, sync_files=False, endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def open_storage(writer: str, root: str) -> None:
    """On S3, make the writer's storage client and send it one request (a listing of the
    location) before the memory readings start: a long run makes it once, and its RSS is
    not staging (boto3's S3 client alone is about 26 MB here, 0.2x this run's state per
    rank). Stock's s3fs filesystem is cached by its arguments, so its writer reuses it."""
    if not root.startswith("s3://"):
        return
    if writer.startswith("stock"):
        import fsspec

        fs = fsspec.filesystem("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        fs.ls(root[len("s3://") :].split("/", 1)[0])
    else:
        from fsdp_ext.checkpoint import blob_store_for

        blob_store_for(root).list("")


class StockSync(_Saver):
    def __init__(self, root, state):
        super().__init__(root)
        self.state = state

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        call = time.perf_counter()
        dcp.save(self.state, storage_writer=stock_writer(self.root, step))
        rec = self.record(step, call)
        rec["done"] = rec["ret"]


def _when_done(future, rec: dict) -> None:
    future.add_done_callback(lambda _f: rec.__setitem__("done", time.perf_counter()))


class StockAsync(_Saver):
    """``dcp.async_save`` with torch's ``DefaultStager``: buffers allocated at the first save
    and reused (pinned on CUDA; in shared memory for the process mode), staging blocking
    (``use_async_staging=False``: the state must not change under the copy)."""

    def __init__(self, root, state, mode: str):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        super().__init__(root)
        self.state = state
        self.kind = (
            AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        )
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=mode == "process",
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        # thread mode: the save's collectives on a group of their own, never the training's
        self.group = dist.new_group(backend="gloo") if mode == "thread" else None
        self.future = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        call = time.perf_counter()
        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(
            self.state,
            storage_writer=stock_writer(self.root, step),
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
            process_group=self.group,
        )
        _when_done(self.future, self.record(step, call))

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()

    def close(self) -> None:
        self.stager.close()


class TorchCheckpointing(_Saver):
    """torch-checkpointing's ``CheckpointManager`` with its async defaults (staging in a thread
    into shared-memory buffers, a writer process per rank). On CUDA with a resharder, so that
    its checkpoint, like DCP's, loads at another sharding; on CPU without one (each rank's
    shards in its own file, loadable at the same sharding only), because 0.1.1 gathers the
    resharding metadata through CUDA tensors (``metadata_manager.py``: ``device="cuda"``).
    Buffered writes (``use_direct_io=False``): its default O_DIRECT stream fails on ext4 with
    EINVAL at the unaligned tail of ``torch.save``'s output. It never calls fsync, so its
    "done" means handed to the page cache, where stock DCP and ours have fsynced."""

    def __init__(self, root, state):
        import torch
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        super().__init__(root)
        self.state = state
        resharder = DefaultResharder() if torch.cuda.is_available() else None
        config = CheckpointManager.Config(
            items={"model": ItemSpec(resharder=resharder)},
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            # its writer process imports torch: slow on a loaded machine
            save=AsyncCheckpointSaverConfig(
                process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600)
            ),
        )
        self.manager = CheckpointManager(config)
        self.future = None

    def save(self, step: int) -> None:
        call = time.perf_counter()
        payload = {"model": self.state["model"].state_dict()}
        self.future = self.manager.save(f"{self.root}/step-{step}", payload)
        _when_done(self.future, self.record(step, call))

    def optimizer_step(self, optimizer) -> float:
        t0 = time.perf_counter()
        with self.manager.lock():
            waited = time.perf_counter() - t0
            optimizer.step()
        if self.records and self.records[-1]["done"] is None:
            self.records[-1]["lock"] += waited  # its staging held training up here
        return waited

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()

    def close(self) -> None:
        self.manager.close()


class Ours(_Saver):
    def __init__(self, root, model, optimizer, blocking: bool):
        from fsdp_ext import Checkpointer

        super().__init__(root)
        self.blocking = blocking
        self.ckpt = Checkpointer(  # as train.py makes it: its loop writes through the optimizer
            root, model=model, optimizer=optimizer, keep=None, overlap_staging=True
        )

    def save(self, step: int) -> None:
        call = time.perf_counter()
        self.ckpt.save(step, blocking=self.blocking)
        rec = self.record(step, call)
        rec["phases"] = self.ckpt.stats.phases_s[-1]  # where the blocked time went
        if self.blocking:
            rec["done"] = rec["ret"]

    def optimizer_step(self, optimizer) -> float:
        """The step waits for the background copy of the tensors it writes (the save's
        ``step_wait`` phase, counted in its blocked time)."""
        phases = self.records[-1]["phases"] if self.records else {}
        before = phases.get("step_wait", 0.0)
        optimizer.step()
        waited = phases.get("step_wait", 0.0) - before
        if self.records:
            self.records[-1]["lock"] += waited
        return waited

    def finish(self) -> None:
        self.ckpt.wait()
        # the thread's own clock, from just before training resumed; its last entries are
        # the saves not yet marked done
        pending = [rec for rec in self.records if rec["done"] is None]
        seconds = self.ckpt.stats.background_s[len(self.ckpt.stats.background_s) - len(pending) :]
        for rec, background in zip(pending, seconds, strict=True):
            rec["done"] = rec["ret"] + background

    def close(self) -> None:
        self.ckpt.close()

    def staging_bytes(self) -> int:
        return self.ckpt.stats.staging_bytes


def make_saver(writer: str, root: str, model, optimizer) -> _Saver:
    from fsdp_ext.job import ModelOptimizerState

    state = {"model": ModelOptimizerState(model, optimizer)}  # what Checkpointer saves
    if writer == "stock_sync":
        return StockSync(root, state)
    if writer in STOCK_ASYNC_MODES:
        return StockAsync(root, state, writer.rsplit("_", 1)[1])
    if writer == "torch_checkpointing":
        return TorchCheckpointing(root, state)
    if writer in ("ours_sync", "ours_async"):
        return Ours(root, model, optimizer, blocking=writer == "ours_sync")
    raise ValueError(f"writer must be one of {list(WRITERS)}, got {writer!r}")


def state_bytes(model, optimizer) -> int:
    """This rank's bytes of the saved state (local shards of the model and optimizer)."""
    import torch
    from torch.distributed.tensor import DTensor

    from fsdp_ext.job import ModelOptimizerState

    total = 0
    for value in ModelOptimizerState(model, optimizer).state_dict().values():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def _say(word: str, payload: dict | None = None) -> None:
    print(TAG + word + ("" if payload is None else " " + json.dumps(payload)), flush=True)


def _hold(word: str) -> None:
    """Say ``word`` to the parent and wait until it answers (it reads /proc meanwhile)."""
    _say(word)
    line = sys.stdin.readline().strip()
    if line != "go":
        raise RuntimeError(f"expected 'go' from the parent after {word!r}, got {line!r}")


class _SelfMeasured:
    """In the lab (no parent on this machine reads /proc for the rank): the same memory
    readings, taken by the rank itself at the same points (``/proc/self``)."""

    def __init__(self) -> None:
        self.base_rss = self.clean_hwm = 0

    def hold(self, word: str) -> None:
        if word == "ready":
            self.base_rss = proc_status(os.getpid())["VmRSS"]
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        elif word == "clean":
            self.clean_hwm = proc_status(os.getpid())["VmHWM"]

    def finish(self, writer: str, timeline: dict) -> None:
        """Gather every rank's timeline and readings on rank 0, which prints the writer's
        row as one JSON line (what the parent reads back from the job's output)."""
        import torch.distributed as dist

        mine = {
            "timeline": timeline,
            "base_rss": self.base_rss,
            "clean_hwm": self.clean_hwm,
            "end_hwm": proc_status(os.getpid())["VmHWM"],
            "helpers": [proc_status(p).get("VmHWM", 0) for p in descendants(os.getpid())],
        }
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is not None:
            run = {"timelines": [g["timeline"] for g in gathered]}
            run |= {k: [g[k] for g in gathered] for k in ("base_rss", "clean_hwm", "end_hwm")}
            run["helpers"] = [g["helpers"] for g in gathered]
            print(json.dumps({"writer": writer, "row": summarize_writer(writer, run)}), flush=True)


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save through ``args.worker``, report its timeline to the parent
    (or, in the lab, ``--lab-worker``: measure itself, rank 0 prints the writer's row)."""
    import torch
    import torch.distributed as dist

    from examples.data import get_batch
    from examples.model import ModelConfig
    from examples.startup import cached_corpus
    from examples.train import TrainConfig, parallelize
    from fsdp_ext import ParallelDims, clip_grad_norm_

    with contextlib.suppress(OSError, AttributeError):  # die with the parent (Linux)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if args.lab_worker and args.storage == "s3" and args.worker.startswith("stock"):
        from benchmarks.checkpoint import use_s3fs

        use_s3fs(args.s3fs_path)  # before anything imports botocore
    inside = _SelfMeasured() if args.lab_worker else None
    hold = _hold if inside is None else inside.hold
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(
        model=ModelConfig(
            dim=args.dim,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            num_experts=args.num_experts,
            max_seq_len=args.seq_len,
        ),
        comm="stock",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    torch.manual_seed(cfg.seed)
    from examples.model import Transformer

    model = Transformer(cfg.model)
    dims = ParallelDims(world)
    dims.build_mesh("cpu")
    par = parallelize(model, cfg, dims)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = cached_corpus()
    local = cfg.batch_size // world

    def batch(step: int):
        x, y = get_batch(
            corpus.train, seed=cfg.seed, step=step, batch_size=cfg.batch_size, seq_len=cfg.seq_len
        )
        return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]

    saver: _Saver | None = None
    steps: list[dict] = []
    step = 0

    def train_step(phase: str) -> None:
        nonlocal step
        x, y = batch(step)
        t0 = time.perf_counter()
        loss = par.train_step(x, y)
        clip_grad_norm_(params, 1.0)
        waited = saver.optimizer_step(optimizer) if saver is not None else optimizer.step()
        waited = waited or 0.0
        optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        steps.append({"start": t0, "end": t1, "s": t1 - t0 - waited, "phase": phase})
        step += 1
        if not torch.isfinite(torch.tensor(loss)):
            raise RuntimeError(f"loss {loss} at step {step}")

    for _ in range(args.warmup):  # the optimizer's state exists after the first
        train_step("warmup")
    nbytes = state_bytes(model, optimizer)
    open_storage(args.worker, args.dir)
    dist.barrier()
    hold("ready")  # the parent resets VmHWM
    for _ in range(args.clean):
        train_step("clean")
    hold("clean")  # the parent reads the training's own peak
    # An untimed first save, waited for: it starts the writers' helper processes (DCP's
    # daemon, torch-checkpointing's writer: an interpreter importing torch) and allocates the
    # staging buffers, which a long run pays once. Its blocked time is reported apart.
    saver = make_saver(args.worker, args.dir, model, optimizer)
    saver.save(step)
    saver.finish()
    first = saver.records.pop()
    dist.barrier()
    for _ in range(args.saves):
        for _ in range(args.every):
            train_step("run")
        saver.save(step)
    for _ in range(args.every):  # the last write overlaps these
        train_step("run")
    saver.finish()
    dist.barrier()
    timeline = {
        "rank": rank,
        "state_bytes": nbytes,
        "staging_bytes": saver.staging_bytes(),
        "steps": steps,
        "saves": saver.records,
        "first_save": first,
    }
    if inside is not None:
        inside.finish(args.worker, timeline)
        line = "exit"
    else:
        _say("done", timeline)
        line = sys.stdin.readline().strip()  # the parent reads VmHWM first
    saver.close()
    dist.barrier()
    dist.destroy_process_group()
    if line != "exit":
        raise RuntimeError(f"expected 'exit' from the parent, got {line!r}")


# ---------------------------------------------------------------- the parent side


def proc_status(pid: int) -> dict[str, int]:
    """The ``kB`` fields of /proc/PID/status, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Rank:
    """A rank process whose protocol lines arrive on a queue (other output goes to stderr)."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                self.lines.put(line[len(TAG) :].rstrip("\n"))
            else:
                sys.stderr.write(line)
        self.lines.put(None)

    def expect(self, word: str, deadline: float) -> dict | None:
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = "<timed out>"
        if line is None or line.split(" ", 1)[0] != word:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-4000:]
            raise RuntimeError(f"rank said {line!r}, expected {word!r}; its stderr:\n{tail}")
        rest = line[len(word) :].strip()
        return json.loads(rest) if rest else None

    def send(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        self.log.close()


def run_writer(writer: str, sizes: dict, args: argparse.Namespace, root: Path) -> dict:
    """One writer in fresh rank processes; its timelines and the memory read from outside."""
    out = root / writer
    out.mkdir(parents=True)
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", writer, "--dir", str(out)]
    argv += ["--threads", str(args.threads)]
    for key, value in sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    ranks = []
    deadline = time.monotonic() + args.timeout
    try:
        for rank in range(args.world):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(args.world),
                "LOCAL_WORLD_SIZE": str(args.world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONWARNINGS": "ignore",
            }
            ranks.append(_Rank(argv, env, root / f"{writer}.rank{rank}.log"))
        for r in ranks:
            r.expect("ready", deadline)
        base_rss = []
        for r in ranks:
            base_rss.append(proc_status(r.proc.pid)["VmRSS"])
            Path(f"/proc/{r.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        for r in ranks:
            r.send("go")
        for r in ranks:
            r.expect("clean", deadline)
        clean_hwm = [proc_status(r.proc.pid)["VmHWM"] for r in ranks]
        for r in ranks:
            r.send("go")
        timelines = [r.expect("done", deadline) for r in ranks]
        end_hwm = [proc_status(r.proc.pid)["VmHWM"] for r in ranks]
        helpers = [
            [proc_status(pid).get("VmHWM", 0) for pid in descendants(r.proc.pid)] for r in ranks
        ]
        for r in ranks:
            r.send("exit")
        for r in ranks:
            rc = r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"{writer}: a rank exited with {rc}; see {r.log.name}")
    finally:
        for r in ranks:
            r.stop()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "timelines": timelines,
        "base_rss": base_rss,
        "clean_hwm": clean_hwm,
        "end_hwm": end_hwm,
        "helpers": helpers,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarize_writer(writer: str, run: dict) -> dict:
    """Per-save figures (slowest rank per save), their medians, and the memory ratios."""
    timelines = run["timelines"]
    n = len(timelines[0]["saves"])
    blocked = [
        max(t["saves"][i]["ret"] - t["saves"][i]["call"] + t["saves"][i]["lock"] for t in timelines)
        for i in range(n)
    ]
    background = [
        max(t["saves"][i]["done"] - t["saves"][i]["ret"] for t in timelines) for i in range(n)
    ]
    rank0 = timelines[0]
    windows = [(s["call"], s["done"]) for s in rank0["saves"]]
    writing = [(s["ret"], s["done"]) for s in rank0["saves"] if s["done"] > s["ret"]]
    measured = [s for s in rank0["steps"] if s["phase"] != "warmup"]

    def overlaps(step: dict, spans: list[tuple[float, float]]) -> bool:
        return any(step["start"] < end and step["end"] > start for start, end in spans)

    # the control is the timed part's own steps that overlap no save: this machine's speed
    # drifts by 10-15 % within minutes (one run's clean phase 900 ms a step, its timed
    # part's steps without a write 1060), so the clean phase before the first save would
    # count the drift as the write's
    free = [s for s in measured if not overlaps(s, windows)]
    clean = [s["s"] for s in free if s["phase"] == "run"] or [s["s"] for s in free]
    clean_phase = [s["s"] for s in measured if s["phase"] == "clean"]
    during = [s["s"] for s in measured if overlaps(s, writing)]
    slowdown = lost = None
    if writer not in SYNC_WRITERS and during and clean:
        base = _median(clean)
        slowdown = _median(during) / base
        # what the saves cost the steps in all, whatever the number of steps it is spread on
        lost = sum(d - base for d in during) / len(rank0["saves"])
    state = sum(t["state_bytes"] for t in timelines)
    growth = sum(e - c for e, c in zip(run["end_hwm"], run["clean_hwm"], strict=True))
    train_peak = sum(c - b for c, b in zip(run["clean_hwm"], run["base_rss"], strict=True))
    firsts = [t["first_save"] for t in timelines]
    row = {
        "blocked_ms": _round(_median(blocked) * 1e3, 1),
        "first_save_blocked_ms": round(max(f["ret"] - f["call"] for f in firsts) * 1e3, 1),
        "background_s": _round(_median(background)),
        "step_slowdown": _round(slowdown),
        "step_ms_lost_per_save": _round(None if lost is None else lost * 1e3, 1),
        "staging_over_state": _round(growth / state),
        "blocked_ms_per_save": [round(b * 1e3, 1) for b in blocked],
        "background_s_per_save": [round(b, 3) for b in background],
        "step_ms_clean": _round(_median(clean) * 1e3 if clean else None, 1),
        "step_ms_clean_phase": _round(_median(clean_phase) * 1e3 if clean_phase else None, 1),
        "step_ms_during_write": _round(_median(during) * 1e3 if during else None, 1),
        "steps_clean": len(clean),
        "steps_during_write": len(during),
        "state_mb": round(state / MB, 1),
        "rss_growth_mb": round(growth / MB, 1),
        "train_peak_over_rss_mb": round(train_peak / MB, 1),
        "helper_processes_peak_mb": [round(sum(h) / MB, 1) for h in run["helpers"]],
    }
    if all("phases" in s for t in timelines for s in t["saves"]):  # ours: per phase, the
        names = timelines[0]["saves"][0]["phases"]  # slowest rank's, median over the saves
        row["blocked_ms_phases"] = {
            name: _round(
                _median([max(t["saves"][i]["phases"][name] for t in timelines) for i in range(n)])
                * 1e3,
                1,
            )
            for name in names
        }
    staged = [t["staging_bytes"] for t in timelines]
    if all(b is not None for b in staged):
        row["staging_bytes_over_state"] = _round(sum(staged) / state)
    return row


def summarize(rows: dict[str, dict], skipped: dict[str, str], meta: dict) -> dict:
    """The one JSON object: ``<metric>_<writer>``, the best stock async mode, the ratios."""
    out = {"benchmark": "checkpoint_stall", **meta}
    modes = {w: rows[w] for w in STOCK_ASYNC_MODES if w in rows}
    if modes:
        best = min(modes, key=lambda w: modes[w]["blocked_ms"])
        rows = {**rows, "stock_async": modes[best]}
        out["stock_async_mode"] = best.removeprefix("stock_async_")
    for writer in (*REPORTED, *STOCK_ASYNC_MODES):
        for metric in METRICS:
            out[f"{metric}_{writer}"] = rows.get(writer, {}).get(metric)
    if "ours_async" in rows:
        out["staging_bytes_over_state_ours_async"] = rows["ours_async"].get(
            "staging_bytes_over_state"
        )

    def ratio(a: str, b: str) -> float | None:
        x, y = out.get(f"blocked_ms_{a}"), out.get(f"blocked_ms_{b}")
        return None if x is None or not y else round(x / y, 3)

    out["blocked_ours_async_over_stock_async"] = ratio("ours_async", "stock_async")
    out["blocked_ours_async_over_stock_sync"] = ratio("ours_async", "stock_sync")
    out["targets"] = {key: f"<= {bound}" for key, bound in TARGETS.items()}
    out["targets_met"] = {
        key: None if out.get(key) is None else out[key] <= bound for key, bound in TARGETS.items()
    }
    out["fsynced"] = {w: w != "torch_checkpointing" for w in rows if w != "stock_async"}
    out["skipped"] = skipped
    out["writers"] = {w: r for w, r in rows.items() if w != "stock_async"}
    return out


# ---------------------------------------------------------------- the cluster lab


def lab_writers(writers: list[str], storage: str, s3fs_path: str | None) -> dict[str, str]:
    """The writers that cannot run on this storage, each with the reason."""
    skipped = {}
    for writer in writers:
        if storage == "s3" and writer == "torch_checkpointing":
            skipped[writer] = "torch-checkpointing 0.1.1 writes to a local filesystem only"
        elif storage == "s3" and writer.startswith("stock") and not s3fs_path:
            skipped[writer] = (
                "stock DCP on S3 needs s3fs (FsspecWriter), installed apart from this venv: "
                "pass --s3fs-path DIR or set FSDP_EXT_S3FS_PATH (see benchmarks/checkpoint.py)"
            )
    return skipped


def lab_worker_argv(writer: str, location: str, sizes: dict, args: argparse.Namespace) -> list:
    """What torchrun runs on every node for one writer (``--lab-worker``)."""
    argv = [str(Path(__file__).resolve()), "--worker", writer, "--lab-worker", "--dir", location]
    argv += ["--threads", str(args.threads), "--storage", args.storage]
    if args.s3fs_path:
        argv += ["--s3fs-path", args.s3fs_path]
    for key, value in sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def lab_main(args: argparse.Namespace, sizes: dict, writers: list[str], skipped: dict) -> dict:
    """Each writer in its own job on a lab of ``--world`` nodes (one rank each), every
    node's link to the storage capped at ``--lab-link`` Mbit/s (and the links between
    nodes at ``--lab-fabric``), the checkpoints on the lab's sshfs storage or its S3
    server; one JSON line, as without ``--lab``, plus what each node sent to the storage."""
    from fsdp_ext.lab import Cluster, unavailable_reason

    reason = unavailable_reason(storage=args.storage)
    if reason is not None:
        raise SystemExit(f"--lab: {reason}")
    if args.storage == "s3" and args.s3fs_path and any(w.startswith("stock") for w in writers):
        from benchmarks.checkpoint import check_s3fs

        check_s3fs(args.s3fs_path)
    for writer, why in lab_writers(writers, args.storage, args.s3fs_path).items():
        writers.remove(writer)
        skipped[writer] = why
    load_start = os.getloadavg()
    rows, storage_mb, job_s = {}, {}, {}
    with Cluster(
        nodes=args.world,
        ranks_per_node=1,
        link=f"{args.lab_fabric}mbit",
        storage_link=f"{args.lab_link}mbit",
        storage=args.storage,
        timeout=args.timeout,
        storage_nice=args.lab_storage_nice,
    ) as lab:
        if args.lab_echo:
            print(f"lab: {lab.describe()}", file=sys.stderr, flush=True)
        for writer in writers:
            location = f"{lab.storage_location}/stall-{writer}"
            if args.storage == "sshfs":
                Path(location).mkdir()  # the shared directory is this machine's disk
            argv = lab_worker_argv(writer, location, sizes, args)
            job = lab.run(argv, echo=sys.stderr if args.lab_echo else None)
            measured = job.last_json()
            if job.returncode != 0 or measured is None or measured.get("writer") != writer:
                skipped[writer] = (
                    f"its lab job failed (exit {job.returncode}, timed out {job.timed_out}): "
                    + " | ".join(job.output.strip().splitlines()[-6:])[-1500:]
                )
                print(f"{writer:>20}: {skipped[writer]}", file=sys.stderr, flush=True)
                continue
            rows[writer] = measured["row"]
            job_s[writer] = round(job.seconds, 1)
            # what each node sent over its storage link during the job
            storage_mb[writer] = [round(b.as_dict().get("storage_tx", 0) / MB, 1)
                                  for b in job.link_bytes]  # fmt: skip
            if args.storage == "sshfs":
                shutil.rmtree(location, ignore_errors=True)
            _progress(writer, rows[writer], f"({job.seconds:.0f} s)")
    meta = _meta(args, sizes, rows, load_start)
    meta["lab"] = {
        "storage": args.storage,
        "nodes": args.world,
        "ranks_per_node": 1,
        "storage_link_mbit": args.lab_link,
        "fabric_link_mbit": args.lab_fabric,
        "storage_nice": args.lab_storage_nice,
        "job_s": job_s,
        "storage_sent_mb_per_node": storage_mb,
    }
    summary = summarize(rows, skipped, meta)
    print(json.dumps(summary), flush=True)
    return summary


# ---------------------------------------------------------------- the plot


def plot(runs: dict[str, dict], summary: dict, path: Path) -> None:
    """Rank 0's wall time from one step's start to the next (the save's stall included) over
    the run, saves marked, background writes shaded: stock sync, stock async, ours async."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = "stock_async_" + summary.get("stock_async_mode", "thread")
    shown = [w for w in ("stock_sync", best, "ours_async") if w in runs]
    fig, axes = plt.subplots(len(shown), 1, figsize=(7.5, 2.2 * len(shown) + 0.6), sharex=True)
    axes = [axes] if len(shown) == 1 else list(axes)
    top = 0.0
    for ax, writer in zip(axes, shown, strict=True):
        t = runs[writer]["timelines"][0]
        steps = [s for s in t["steps"] if s["phase"] == "run"]  # from the first timed save on
        t0 = steps[0]["start"]
        xs = [(a["start"] - t0) for a in steps[:-1]]
        ys = [(b["start"] - a["start"]) * 1e3 for a, b in itertools.pairwise(steps)]
        top = max(top, *ys)
        ax.plot(xs, ys, ".-", ms=3, lw=0.8, label="step start to next step start")
        for i, s in enumerate(t["saves"]):
            ax.axvline(
                s["call"] - t0, color="red", lw=1, ls="--", label="save called" if i == 0 else None
            )
            if s["done"] > s["ret"]:
                ax.axvspan(
                    s["ret"] - t0,
                    s["done"] - t0,
                    color="orange",
                    alpha=0.25,
                    label="background write" if i == 0 else None,
                )
        row = summary["writers"][writer]
        title = f"{writer}: blocked {row['blocked_ms']:.0f} ms/save (median)"
        if row["step_slowdown"] is not None:
            title += f", steps during the write x{row['step_slowdown']:.2f}"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes:
        ax.set_ylim(0, top * 1.1)
    axes[-1].set_xlabel("seconds since the first step of the timed saves (rank 0)")
    fig.suptitle(
        f"{summary['world']} gloo ranks, {summary['state_mb']} MB of state, "
        f"load {summary['loadavg_start']:.1f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 saves")
    parser.add_argument("--world", type=int, default=2, help="training ranks (gloo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--writers", default=",".join(WRITERS), help=f"comma-separated, of {','.join(WRITERS)}"
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: temp)")
    parser.add_argument("--plot", type=Path, default=None, help="step-time PNG")
    parser.add_argument(
        "--raw", type=Path, default=None, help="write every rank's timeline here (JSON)"
    )
    parser.add_argument(
        "--replot", type=Path, default=None, help="draw --plot from a --raw file, run nothing"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per writer")
    for key, value in FULL.items():  # sizes: --quick's, or the full run's, unless given
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"({value})")
    parser.add_argument(
        "--lab",
        action="store_true",
        help="run in the cluster lab (root): --world nodes of one rank, the checkpoints on "
        "the lab's shared storage behind capped links",
    )
    parser.add_argument(
        "--storage",
        choices=("sshfs", "s3"),
        default=None,
        help="with --lab: what the lab's storage node serves (default sshfs); s3: SeaweedFS, "
        "stock DCP through s3fs (--s3fs-path)",
    )
    parser.add_argument(
        "--lab-link", type=int, default=200, help="with --lab: each node's storage link, Mbit/s"
    )
    parser.add_argument(
        "--lab-fabric", type=int, default=1000, help="with --lab: the links between nodes, Mbit/s"
    )
    parser.add_argument(
        "--lab-storage-nice",
        type=int,
        default=19,
        choices=range(20),
        metavar="0-19",
        help="with --lab: the storage node's servers' nice value; 19 (the default) stands for "
        "a storage machine of its own, 0 shares the ranks' cores evenly",
    )
    parser.add_argument("--lab-echo", action="store_true", help="with --lab: node 0's console")
    parser.add_argument(
        "--s3fs-path",
        default=os.environ.get("FSDP_EXT_S3FS_PATH") or None,
        help="with --storage s3: where s3fs, boto3 and botocore are installed apart from this "
        "venv, for the stock writers (default $FSDP_EXT_S3FS_PATH; without: they are skipped)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lab-worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The lab's options make sense together (parser.error, exit 2, otherwise); fills in
    ``--storage``'s default."""
    if args.plot is not None and args.plot.suffix != ".png":  # --plot "" would write ./.png
        parser.error(f"--plot: a .png file name (leave the flag out for none), got '{args.plot}'")
    if not args.lab and args.worker is None:
        given = [f"--{n.replace('_', '-')}" for n in ("storage", "lab_echo") if getattr(args, n)]
        defaults = (("lab_link", 200), ("lab_fabric", 1000), ("lab_storage_nice", 19))
        given += [f"--{n.replace('_', '-')}" for n, d in defaults if getattr(args, n) != d]
        if given:
            parser.error(f"{', '.join(given)}: only with --lab")
        return
    if args.worker is not None:
        return
    if args.dir is not None:
        parser.error("--dir: with --lab the checkpoints go to the lab's shared storage")
    if args.replot is not None:
        parser.error("--replot draws a --raw file; it runs nothing, in the lab or not")
    if args.plot is not None or args.raw is not None:
        parser.error("--plot and --raw are not kept with --lab (rank 0 reports the rows)")
    for name in ("lab_link", "lab_fabric"):
        if getattr(args, name) <= 0:
            parser.error(
                f"--{name.replace('_', '-')}: a rate in Mbit/s > 0, got {getattr(args, name)}"
            )
    if args.world < 1:
        parser.error(f"--world: at least one node, got {args.world}")
    args.storage = args.storage or "sshfs"


def _meta(args: argparse.Namespace, sizes: dict, rows: dict, load_start) -> dict:
    return {
        "quick": args.quick,
        "world": args.world,
        "threads_per_rank": args.threads,
        "cpus": os.cpu_count(),
        "sizes": sizes,
        "state_mb": next(iter(rows.values()))["state_mb"] if rows else None,
        "loadavg_start": round(load_start[0], 2),
        "loadavg_end": round(os.getloadavg()[0], 2),
    }


def _progress(writer: str, r: dict, tail: str) -> None:
    """One writer's line on stderr as its row lands (the JSON line comes at the end)."""
    phases = f" phases ms {r['blocked_ms_phases']}" if "blocked_ms_phases" in r else ""
    print(
        f"{writer:>20}: blocked {r['blocked_ms']} ms, background {r['background_s']} s, "
        f"step x{r['step_slowdown']}, {tail}{phases}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict | None:
    parser = _parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    defaults = QUICK if args.quick else FULL
    sizes = {
        k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()
    }
    if args.worker is not None:
        worker(argparse.Namespace(**{**vars(args), **sizes}))
        return None
    if args.replot is not None:
        raw = json.loads(args.replot.read_text())
        plot(raw["runs"], raw["summary"], args.plot)
        return raw["summary"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the ranks are stopped
    writers = [w.strip() for w in args.writers.split(",") if w.strip()]
    unknown = sorted(set(writers) - set(WRITERS))
    if unknown:
        raise SystemExit(f"--writers: unknown {unknown}; allowed: {list(WRITERS)}")
    skipped = {}
    reason = torch_checkpointing_missing()
    if reason is not None and "torch_checkpointing" in writers:
        writers.remove("torch_checkpointing")
        skipped["torch_checkpointing"] = reason
    if args.lab:
        return lab_main(args, sizes, writers, skipped)
    load_start = os.getloadavg()
    runs, rows = {}, {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt_stall_") as tmp:
        for writer in writers:
            began = time.perf_counter()
            runs[writer] = run_writer(writer, sizes, args, Path(tmp))
            rows[writer] = summarize_writer(writer, runs[writer])
            r = rows[writer]
            _progress(
                writer,
                r,
                f"staging/state {r['staging_over_state']} ({time.perf_counter() - began:.0f} s)",
            )
    meta = _meta(args, sizes, rows, load_start)
    summary = summarize(rows, skipped, meta)
    if args.raw is not None:
        args.raw.write_text(json.dumps({"summary": summary, "runs": runs}))
    if args.plot is not None and runs:
        plot(runs, summary, args.plot)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from fsdp_ext.lab import teardown_on_termination

    teardown_on_termination()  # SIGTERM tears a --lab run's lab down, as Ctrl-C does
    main()
