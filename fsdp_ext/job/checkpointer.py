"""A training loop's checkpoints in two lines: ``ckpt.save(step)`` and ``ckpt.resume()``.

``Checkpointer`` composes the rest of this package, as torchtitan's ``CheckpointManager``
and accelerate's ``save_state`` do for theirs: it owns the output directory for the job's
life (``ownership.py``), saves the model and optimizer through DCP's state-dict helpers
plus any ``Stateful`` extras (the LoCo ``CommHandle``, a scheduler, RNG streams) with
``SpreadFileSystemWriter`` under ``root/step-N``, keeps the newest ``keep`` intact ones
(pruned through ``remove_checkpoint``, never a checkpoint being read or one found
corrupt), and resumes from the newest checkpoint that verifies (``resume.py``)::

    ckpt = fsdp_ext.Checkpointer("runs/a/checkpoints", model=model, optimizer=opt,
                                 extra={"loco": handle})
    for step in range(ckpt.resume(), steps):
        ...
        ckpt.save(step + 1, blocking=False)  # staged to host memory, written in the background
    ckpt.close()  # waits for the last background write

A save with ``blocking=False`` copies the state into host buffers it keeps from save to save
(``staging.py``), then writes them through the same writer, planner and commit protocol in a
background thread. The parameters and the optimizer state are copied in that thread too,
while the next step's forward and backward run; the next ``optimizer.step()`` waits for the
copy. The thread's collectives (the ownership check's broadcast, DCP's planning and commit)
run on a process group of their own: ``save`` itself runs no collective, and nothing of the
save touches the training's group. The thread, its copy and its write, runs at nice 19, so
it takes the cycles a step leaves, not the step's (``background_nice``; the step never had to
wait for the copy at nice 19 in the benchmark's runs). From ``save`` to the end of its
write, automatic garbage collection is paused and the GIL's switch interval is 0.5 ms, then
both are left as the caller had them (``_StepFirst`` says why). The next save waits for the
previous write (and says how long), never drops one; ``close()`` waits for the last.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from fsdp_ext._torch import dtensor_local_tensor, optimizer_runs_step_hooks
from fsdp_ext.checkpoint.blob import BlobAccessError
from fsdp_ext.checkpoint.fence import DirectoryFencedError, Fence
from fsdp_ext.checkpoint.location import blob_store_for, is_object_store
from fsdp_ext.checkpoint.lock import check_lease
from fsdp_ext.checkpoint.manifest import CheckpointBusyError, CheckpointSpaceError
from fsdp_ext.checkpoint.planner import SpreadSavePlanner
from fsdp_ext.checkpoint.steps import checkpoint_steps, step_name
from fsdp_ext.checkpoint.storage import CheckpointStorage
from fsdp_ext.checkpoint.versions import remove_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter
from fsdp_ext.job import blob_run
from fsdp_ext.job.blob_ownership import claim_blob
from fsdp_ext.job.ownership import DirectoryOwnedError, Ownership, claim
from fsdp_ext.job.resume import load_intact, set_aside, skipped_checkpoints
from fsdp_ext.job.staging import StagingBuffers

__all__ = ["Checkpointer", "ModelOptimizerState"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelOptimizerState(Stateful):
    """Model parts (one module, or this rank's pipeline stages) and their optimizers as one
    DCP ``Stateful``, fqn-keyed and flattened, so any sharding or world size loads it."""

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ):
        self.parts = [model] if isinstance(model, nn.Module) else list(model)
        if optimizer is None:
            self.optimizers = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = [optimizer]
        else:
            self.optimizers = list(optimizer)
        if self.optimizers and len(self.optimizers) != len(self.parts):
            raise ValueError(
                f"optimizer: one per model part ({len(self.parts)}), got {len(self.optimizers)}"
            )

    def state_dict(self) -> dict[str, Any]:
        """The model's entries, then the optimizer's (each part's model, then its optimizer's,
        through one ``get_state_dict`` call: its checks of the model run once, not twice,
        which is a quarter of the time on a 6-block MoE, 9.4 against 7.0 ms)."""
        state: dict[str, Any] = {}
        optims: dict[str, Any] = {}
        for i, part in enumerate(self.parts):
            if i < len(self.optimizers):
                model_sd, optim_sd = get_state_dict(part, self.optimizers[i], options=_FLAT)
                state.update(model_sd)
                optims.update(optim_sd)
            else:
                state.update(get_model_state_dict(part))
        state.update(optims)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in state_dict.items() if k in keys})
        for part, opt in zip(self.parts, self.optimizers, strict=False):  # none, or one each
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=_FLAT)


def _out_of_space(exc: BaseException) -> CheckpointSpaceError | None:
    """The disk-full error a rank's save failed with, which names the path and free bytes."""
    causes = exc.failures.values() if isinstance(exc, CheckpointException) else [exc]
    for cause in causes:
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, CheckpointSpaceError):
            return cause
    return None


def _leader() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _agree(error: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Rank 0's error string on every rank (so every rank fails alike, before training)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return error


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory ``tensor`` (a DTensor: its local shard) lives in."""
    if isinstance(tensor, DTensor):
        tensor = dtensor_local_tensor(tensor)
    return tensor.untyped_storage().data_ptr()


def _lower_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (Linux sets it per thread; threads it
    starts inherit it). Where the training's own threads use every core, as on a CPU-bound
    host, whatever the write runs comes out of the step; at nice 19 the scheduler gives the
    write the cycles the step leaves (waiting on a collective), not the step's. Not
    ``SCHED_IDLE``: a thread that may be parked for long while it holds the GIL stalls the
    step instead (measured: the write took 5x as long and the step slowed more)."""
    if nice == 0:
        return
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the default priority
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


BACKGROUND_SWITCH_INTERVAL_S = 0.0005  # the interpreter's, while a background write runs


class _StepFirst:
    """The interpreter's settings that put the training thread first while a background
    write runs, and the caller's back once it ends (only those still as set here).

    - Automatic garbage collection is paused: a collection of the oldest generation, set
      off by the save's own allocations, took 150-200 ms holding the GIL in the write's
      thread, and stopped the step for as long.
    - The GIL's switch interval falls from 5 ms to 0.5 ms: a step gives up the GIL in every
      torch op it calls, and may then wait for the write's thread to hand it back, up to
      one interval each time. Six paired runs: 115 ms against 124 ms of steps lost per
      save on a quiet host; three beside a CPU burner: 145 ms against 177 ms."""

    def __init__(self) -> None:
        self._collecting = gc.isenabled()
        self._interval = sys.getswitchinterval()
        gc.disable()
        sys.setswitchinterval(BACKGROUND_SWITCH_INTERVAL_S)

    def end(self) -> None:
        if self._collecting:
            gc.enable()
        if sys.getswitchinterval() == BACKGROUND_SWITCH_INTERVAL_S:
            sys.setswitchinterval(self._interval)


@dataclass
class SaveStats:
    """What saving cost this job: seconds each save blocked the caller (staging included),
    seconds a save waited for the previous background write, the staging buffers' bytes."""

    blocked_s: list[float] = field(default_factory=list)
    waited_s: list[float] = field(default_factory=list)
    background_s: list[float] = field(default_factory=list)
    staging_bytes: int = 0
    # per save, where its blocked seconds went: "wait" (the previous write), "fence" (the
    # ownership check and its broadcast), "state_dict", "stage" (the host copies), "start"
    phases_s: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Background:
    step: int
    thread: threading.Thread
    started: float
    error: BaseException | None = None
    staged: threading.Event = field(default_factory=threading.Event)  # every copy landed
    phases: dict[str, float] = field(default_factory=dict)  # the save's, in SaveStats


class Checkpointer:
    """Save, prune and resume a training run's checkpoints under ``root``.

    Construct it on every rank, after the process group is up and before training: rank 0
    claims ``root`` for this job (a second live job gets :class:`DirectoryOwnedError` on
    every rank). Every save is fenced by that claim: a job that lost ``root`` to another
    (paused past its lease) gets :class:`DirectoryFencedError` on every rank at its next
    save, and nothing of that save lands. ``keep``: newest intact checkpoints kept (None:
    all). ``lease_s``: the lease of the directory and of its locks (default
    ``$FSDP_EXT_LEASE_S``, else 60 s). ``fs``: where the checkpoints are stored (default: the
    local filesystem). ``background_nice``: how much lower than the training the
    background write's threads run (0-19; Linux nice). ``overlap_staging=True``: a
    background save copies the model's parameters and the optimizer's state in its thread,
    while the next step's forward and backward run, and the next ``optimizer.step()`` waits
    for that copy (as CheckFreq and torch-checkpointing do); everything else is copied before
    ``save`` returns. Only for loops that write those tensors through the optimizers given
    here alone between a save and the next step (off by default: an in-place write elsewhere
    would be saved half-done). Dying with the launcher is the
    launcher's choice (:func:`~fsdp_ext.checkpoint.exit_with_launcher`), not made here.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        extra: dict[str, Stateful] | None = None,
        keep: int | None = 3,
        lease_s: float | None = None,
        fs: CheckpointStorage | None = None,
        background_nice: int = 19,
        overlap_staging: bool = False,
    ) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if lease_s is not None:
            lease_s = check_lease(lease_s)
        extra = dict(extra or {})
        for name, value in extra.items():
            if name == "model" or not hasattr(value, "state_dict"):
                raise ValueError(
                    f"extra[{name!r}] must be a Stateful (state_dict / load_state_dict) under "
                    f"a name other than 'model', got {type(value).__name__}"
                )
        if fs is not None and not isinstance(fs, CheckpointStorage):
            raise TypeError(
                f"fs must be a CheckpointStorage (LocalStorage, or another backend), got {fs!r}"
            )
        if not isinstance(background_nice, int) or not 0 <= background_nice <= 19:
            raise ValueError(
                f"background_nice must be an int from 0 (the training's own priority) to 19 "
                f"(the lowest), got {background_nice!r}"
            )
        if not isinstance(overlap_staging, bool):
            raise TypeError(f"overlap_staging must be True or False, got {overlap_staging!r}")
        if optimizer is not None and model is None:
            raise ValueError("optimizer needs model= (its state is keyed by parameter names)")
        # an object store (s3://) keeps its checkpoints through a catalog (job/blob_run.py)
        self.location = os.fspath(root) if is_object_store(os.fspath(root)) else None
        self.root = Path(root) if self.location is None else self.location
        self.keep = keep
        self.background_nice = background_nice
        self.fs = fs
        self.state: dict[str, Any] = {}
        if model is not None:
            self.state["model"] = ModelOptimizerState(model, optimizer)
        self.state.update(extra)
        self._extras = tuple(extra)
        self._ownership: Ownership | None = None
        self._staging = StagingBuffers()
        self._background: _Background | None = None
        self._group: dist.ProcessGroup | None = None  # the background writes' own group
        self.stats = SaveStats()
        # the optimizers whose step waits for a background save's copy of their tensors
        optimizers = self.state["model"].optimizers if overlap_staging and model else []
        self._guarded = [opt for opt in optimizers if optimizer_runs_step_hooks(opt)]
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in self._guarded]
        error = None
        if _leader():
            try:
                if self.location is not None:
                    self._ownership = claim_blob(blob_store_for(self.location), lease_s=lease_s)
                else:
                    self._ownership = claim(self.root, lease_s=lease_s, fs=fs)
            except (DirectoryOwnedError, BlobAccessError) as exc:
                error = (type(exc), str(exc))
        error = _agree(error)
        if error is not None:
            raise error[0](error[1])

    def path(self, step: int) -> Path | str:
        if self.location is not None:
            return f"{self.location}/step-{step}"
        return self.root / step_name(step)

    @property
    def fence(self) -> Fence | None:
        """The owner generation this job writes as (rank 0's; None elsewhere)."""
        return None if self._ownership is None else self._ownership.fence

    def save(self, step: int, *, blocking: bool = True) -> Path:
        """Save every state as ``root/step-N`` (collective), then prune to ``keep``.

        ``blocking=False``: return once the state is staged to host memory (with
        ``overlap_staging``, the optimizers' tensors are copied in the background, before
        their next step); the write, the commit and the prune run in the background. A save
        first waits for the previous background write. Raises
        :class:`DirectoryFencedError` on every rank, with nothing published, once another
        job has taken ``root`` over (a background save checks that in its write, on the
        writes' own process group, so that ``save`` itself runs no collective: its error is
        raised by the next ``save``, ``wait`` or ``close``).
        ``stats.phases_s`` says where each save's blocked time went."""
        t0 = time.perf_counter()
        self.wait(before=step)
        marks = [("wait", time.perf_counter())]
        path = self.path(step)
        if blocking:
            self._check_fence(path, None)
            marks.append(("fence", time.perf_counter()))
            self._write(step, path, self.state, None)
            marks.append(("write", time.perf_counter()))
            self._record(t0, marks)
            return path
        step_first = _StepFirst()  # until the write ends
        try:
            state = {k: v.state_dict() for k, v in self.state.items()}
            marks.append(("state_dict", time.perf_counter()))
            staged = self._staging.stage(state, defer=self._written_by_step())
            marks.append(("stage", time.perf_counter()))
            self.stats.staging_bytes = self._staging.nbytes
            group = self._background_group()
            job = _Background(step, threading.Thread(), time.perf_counter())

            def write() -> None:
                try:
                    _lower_priority(self.background_nice)
                    try:  # the next optimizer step waits for it
                        self._staging.copy_deferred()
                    finally:
                        job.staged.set()
                    # the fence's check too: its broadcast is a collective, off the training's group
                    self._check_fence(path, group)
                    self._write(step, path, staged, group)
                except BaseException as exc:  # raised by the next save, wait or close
                    job.error = exc
                finally:
                    self.stats.background_s.append(time.perf_counter() - job.started)
                    step_first.end()

            job.thread = threading.Thread(target=write, name=f"fsdp_ext-save-{step}")
            self._background = job
            job.thread.start()
        except BaseException:  # no write started: the interpreter is the caller's again
            step_first.end()
            raise
        marks.append(("start", time.perf_counter()))
        self._record(t0, marks)
        job.phases = self.stats.phases_s[-1]
        if self._guarded:
            job.phases["step_wait"] = 0.0  # set by the next optimizer step
        return path

    def _written_by_step(self) -> Callable[[torch.Tensor], bool] | None:
        """Which tensors a background save may copy after ``save`` returns: those of the
        guarded optimizers' parameters and state (their storages), which nothing but their
        ``step`` writes; None when there are none (everything is copied at once)."""
        if not self._guarded:
            return None
        storages = set()
        for opt in self._guarded:
            for group in opt.param_groups:
                for param in group["params"]:
                    tensors = [param, *opt.state.get(param, {}).values()]
                    for t in tensors:
                        if isinstance(t, torch.Tensor):
                            storages.add(_storage(t))
        return lambda tensor: tensor.numel() > 0 and _storage(tensor) in storages

    def _before_step(self, optimizer, args, kwargs) -> None:
        """An optimizer's step pre-hook: the background save's copy of the tensors this
        step writes must land first. The wait counts as the save's blocked time."""
        job = self._background
        if job is None or job.staged.is_set():
            return
        t0 = time.perf_counter()
        job.staged.wait()
        waited = time.perf_counter() - t0
        job.phases["step_wait"] = job.phases.get("step_wait", 0.0) + waited
        self.stats.blocked_s[-1] += waited

    def _check_fence(self, path: Path | str, group: dist.ProcessGroup | None) -> None:
        """Raise :class:`DirectoryFencedError` on every rank of ``group`` once another job
        has taken ``root`` over; else set aside a corrupt checkpoint at ``path``."""
        fence = self.fence
        lost = None
        if fence is not None:
            try:
                lost = fence.lost()
            except BlobAccessError as exc:  # raised on every rank, none left waiting
                lost = (BlobAccessError, str(exc))
            if lost is None and self.location is None:
                set_aside(path, self.fs)  # a corrupt checkpoint of this step is kept
        lost = _agree(lost, group)
        if isinstance(lost, tuple):
            raise lost[0](lost[1])
        if lost is not None:
            raise DirectoryFencedError(lost)

    def _record(self, t0: float, marks: list[tuple[str, float]]) -> None:
        self.stats.blocked_s.append(marks[-1][1] - t0)
        times = [t0] + [t for _name, t in marks]
        self.stats.phases_s.append(
            {name: times[i + 1] - times[i] for i, (name, _t) in enumerate(marks)}
        )

    def wait(self, *, before: int | None = None) -> float:
        """Wait for the background save, if one runs; raise its error. Returns the seconds
        waited (said on stderr by rank 0 when a save had to wait for the previous one)."""
        job, self._background = self._background, None
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.thread.join()
        waited = time.perf_counter() - t0
        if before is not None:
            self.stats.waited_s.append(waited)
            if waited >= 0.001 and _leader():
                print(
                    f"fsdp_ext.checkpoint: the save of step {before} waited {waited:.3f} s "
                    f"for the background write of step {job.step} to finish",
                    file=sys.stderr,
                    flush=True,
                )
        if job.error is not None:
            raise job.error
        return waited

    def _background_group(self) -> dist.ProcessGroup | None:
        """A process group for the background writes alone (made once, collectively)."""
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _write(
        self, step: int, path: Path | str, state: dict[str, Any], group: dist.ProcessGroup | None
    ) -> None:
        fence = self.fence
        writer = None
        try:
            if self.location is not None:
                blob_run.save_step(self.location, step, state, fence, group)
            else:
                writer = SpreadFileSystemWriter(path, fs=self.fs, fence=fence)
                dcp.save(
                    state, storage_writer=writer, planner=SpreadSavePlanner(), process_group=group
                )
        except (Exception, CheckpointException) as exc:  # failed on every rank alike
            unusable = blob_run.store_error(exc)
            if unusable is not None:  # the store died (every rank has this failure): one line
                raise unusable from None  # not DCP's traceback of each rank
            if writer is not None:
                writer.abandon()
            lost = _agree(None if fence is None else fence.lost(), group)
            if lost is not None:
                raise DirectoryFencedError(lost) from exc
            full = _out_of_space(exc)
            if full is not None:
                raise full from exc
            raise
        lost = None
        if _leader():
            try:
                try:
                    self.prune()
                except (OSError, DirectoryFencedError):  # a prune a takeover fenced
                    lost = None if fence is None else fence.lost()
                    if lost is None:
                        raise
            except BlobAccessError as exc:  # the store died after the commit: every rank
                lost = (BlobAccessError, str(exc))  # raises it, none is left waiting
        lost = _agree(lost, group)
        if isinstance(lost, tuple):
            raise lost[0](lost[1])
        if lost is not None:
            raise DirectoryFencedError(lost)

    def prune(self) -> list[Path]:
        """Remove all but the newest ``keep`` intact checkpoints; returns what went. One
        being read by another job stays until a later prune; corrupt ones are not counted
        and never removed."""
        if self.keep is None:
            return []
        if self.location is not None:
            return blob_run.prune_steps(self.location, self.keep, self.fence)
        skipped = skipped_checkpoints(self.root, self.fs)
        intact = [p for _s, p in checkpoint_steps(self.root, self.fs) if p.name not in skipped]
        removed = []
        for path in intact[: -self.keep]:
            try:
                remove_checkpoint(path, self.fs, fence=self.fence)
                removed.append(path)
            except CheckpointBusyError as exc:
                warnings.warn(f"prune: {exc}", stacklevel=2)
        return removed

    def resume(self) -> int:
        """Load the newest intact checkpoint (collective); its step, or 0 with none."""
        if self.location is not None:
            step = blob_run.load_newest(self.location, self.state, optional=self._extras)
        else:
            step = load_intact(self.root, self.state, optional=self._extras, fs=self.fs)
        return 0 if step is None else step

    def close(self) -> None:
        """Wait for the background save, then give the directory up: the job is finished
        (a later job takes it at once)."""
        try:
            self.wait()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            if self._ownership is not None:
                self._ownership.release()
                self._ownership = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
