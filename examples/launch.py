"""How train.py starts: relaunching itself under torchrun, owning --out for the whole job, and
joining the process group (with torchrun's store workaround).

    python examples/train.py --nproc-per-node 2 ...   # launch_owning: claim --out, then torchrun
    torchrun --nproc-per-node 2 examples/train.py ...  # init_distributed: env:// rendezvous
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from examples.config import TrainConfig
from fsdp_ext import DirectoryOwnedError
from fsdp_ext.checkpoint import RUN_ID_ENV, blob_store_for
from fsdp_ext.job import LAUNCHER_PID_ENV, claim, claim_blob
from fsdp_ext.warm import CLIENT, SOCKET_ENV

__all__ = ["FENCED", "LAUNCHER_FLAGS", "init_distributed", "launch", "launch_owning"]

FENCED = 3  # the exit status of a job that lost --out to another job
LAUNCHER_FLAGS = ("--nproc-per-node", "--max-restarts")  # torchrun's, not the workers'


def init_distributed(cfg: TrainConfig) -> None:
    """Join the job's process group: torchrun's (env://), or a group of one."""
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


def launch(argv: list[str], cfg: TrainConfig, script: str) -> None:
    """Re-run ``script`` under torchrun, without the launcher flags; with
    ``$FSDP_EXT_WARM_SOCKET`` set, each worker is forked from that warm server (no imports
    to pay at a start or a restart), else started fresh."""
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for arg in argv:
        if skip or arg.startswith(LAUNCHER_FLAGS):
            skip = arg in LAUNCHER_FLAGS
            continue
        rest.append(arg)
    launcher = [f"--nproc-per-node={cfg.nproc_per_node}", f"--max-restarts={cfg.max_restarts}"]
    if os.environ.get(SOCKET_ENV):  # workers forked from the warm server there (fsdp_ext.warm)
        script, rest = str(CLIENT), [script, *rest]
    torchrun(["--standalone", *launcher, script, *rest])


def launch_owning(argv: list[str], cfg: TrainConfig, script: str) -> None:
    """Own --out's checkpoints for the whole job, torchrun's restarts included, then launch.

    The workers inherit the run id and this launcher's pid: they join its ownership, and
    die with it (fsdp_ext.exit_with_launcher)."""
    os.environ.setdefault(RUN_ID_ENV, f"train-{os.getpid()}-{time.time_ns():x}")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        if cfg.on_object_store:
            owner = claim_blob(blob_store_for(cfg.checkpoint_root), lease_s=cfg.lease)
        else:
            owner = claim(cfg.checkpoint_root, lease_s=cfg.lease)
    except DirectoryOwnedError as exc:
        print(f"train.py: error: argument --out: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        launch(argv, cfg, script)
    except BaseException:
        lost = owner.fence.lost()
        if lost is None:
            raise
        print(f"train.py: error: argument --out: {lost}", file=sys.stderr, flush=True)
        sys.exit(FENCED)
    finally:
        owner.release()
