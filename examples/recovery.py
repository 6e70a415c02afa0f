"""train.py's recovery: where a restarted worker resumes from, and how a worker ends.

- ``snapshots``: with ``--snapshot-every K``, every rank's shards are kept in its node's RAM
  and on the next node (``fsdp_ext.job.snapshot``);
- ``resume_step``: the freshest of the in-memory snapshots and the disk checkpoints;
- ``ending``: a worker that fails exits at once, one that is interrupted in one line;
- ``RNGState``: each rank's RNG streams, checkpointed with the rest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from examples.config import TrainConfig
from fsdp_ext import Checkpointer
from fsdp_ext.job import Snapshots, job_name, snapshot_dir

__all__ = ["INTERRUPTED", "RNGState", "ending", "resume_step", "snapshots"]

INTERRUPTED = 130  # 128 + SIGINT


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


def snapshots(cfg: TrainConfig, ckpt: Checkpointer | None, fresh: bool) -> Snapshots | None:
    """This job's in-memory snapshots (None without --snapshot-every). The job's name is
    its checkpoint root, which its restarts and every node share; ``fresh``: a run that
    starts over drops what an earlier run of the same --out left in RAM, and so does a run
    that takes none (an earlier job of this --out that failed for good left them)."""
    if ckpt is None:
        return None
    job = job_name(cfg.checkpoint_root)
    if not cfg.snapshot_every:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(snapshot_dir(job), ignore_errors=True)
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    snaps = Snapshots(
        ckpt.state, job=job, ranks_per_node=per_node, checkpoint_root=cfg.checkpoint_root
    )
    if fresh:
        snaps.clear()
    return snaps


def resume_step(
    cfg: TrainConfig, ckpt: Checkpointer, snaps: Snapshots | None, log: Callable
) -> int:
    """Load the freshest state (collective): an in-memory snapshot at or after the newest
    disk checkpoint, else the newest intact disk checkpoint; its step."""
    log(f"resuming: loading the newest intact checkpoint under {cfg.checkpoint_root}")
    if snaps is not None:
        disk = cfg.latest_step() or 0
        step = snaps.restore(at_least=max(disk, 1))
        if step is not None:
            peers = f", ranks {snaps.recovered} from their peer's copy" if snaps.recovered else ""
            log(
                f"resumed from {snaps.dir}/step-{step:07d} at step {step} (in-memory "
                f"snapshot{peers}; the newest on disk is step {disk})"
            )
            return step
    step = ckpt.resume()
    if step == 0:
        raise FileNotFoundError(
            f"--resume: no intact checkpoint under {cfg.checkpoint_root} (see the warnings)"
        )
    log(f"resumed from {cfg.checkpoint_dir(step)} at step {step}")
    return step


@contextlib.contextmanager
def ending() -> Iterator[None]:
    """Ctrl-C: one line and status 130. Under torchrun, a worker whose training raised
    prints its traceback and exits at once: its process group is broken, torchrun
    restarts the group as soon as one worker has exited, and Python's own teardown of a
    gloo group whose peer is gone took 2.7-3.2 s of every restart in the lab."""
    try:
        yield
    except KeyboardInterrupt:
        print("train.py: interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except Exception:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
