"""The recovery benchmark's torchft peer: examples/train.py's model and data under torchft.

    torchrun --nnodes 1 --nproc-per-node 2 ... benchmarks/torchft_train.py \
        --replica 0 --replicas 2 --lighthouse http://ADDR:29510 --node-addr ADDR \
        --ready-dir SHARED/ready -- TRAIN.PY FLAGS...

HSDP as torchft 0.2.0 offers it on CPU: each node is one replica group, which shards the
model over its own ranks with FSDP2 (examples/parallel.py, as train.py does); torchft's
``Manager`` joins the replica groups per step through its lighthouse, and averages each
rank's gradient shard over the replicas that are alive (``manager.allreduce``, gloo) before
``OptimizerWrapper`` steps only when the step commits. A replica that dies leaves the quorum
at the next step; the others go on without a restart. Each replica takes its slice of the
same global batch train.py would (replica r, local rank l: the (r x ranks + l)-th slice), so
a lost replica's samples are skipped. Rank 0 of each replica prints train.py's step line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp_ext  # noqa: E402
from examples.config import parse_args  # noqa: E402
from examples.data import get_batch  # noqa: E402
from examples.model import Transformer  # noqa: E402
from examples.startup import cached_corpus  # noqa: E402
from examples.train import lr_lambda, parallelize  # noqa: E402

READY_WAIT_S = 300.0


def _ready(ready_dir: Path, replica: int, replicas: int) -> None:
    """Every replica group starts its first step together (one file each on the shared
    directory): torchft would otherwise let the first one train alone, and the second
    would have to heal from it."""
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / f"replica-{replica}").write_text("ready\n")
    deadline = time.monotonic() + READY_WAIT_S
    while len(list(ready_dir.glob("replica-*"))) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ready_dir}: the other replica groups never came")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--node-addr", required=True)
    parser.add_argument("--ready-dir", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0, help="torchft's op timeout, s")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    ranks = int(os.environ["WORLD_SIZE"])
    cfg = parse_args(flags, world_size=ranks * args.replicas)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    dims = fsdp_ext.ParallelDims(ranks)
    dims.build_mesh("cpu")
    par = parallelize(model, cfg, dims)
    params = [p for part in par.parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        replica_id=f"node{args.replica}",
        lighthouse_addr=args.lighthouse,
        hostname=args.node_addr,
        store_addr=args.node_addr,
        store_port=int(os.environ["MASTER_PORT"]),
        rank=rank,
        world_size=ranks,
        init_sync=False,
    )
    opt = OptimizerWrapper(manager, optimizer)
    corpus = cached_corpus()
    local = cfg.batch_size // (ranks * args.replicas)
    at = (args.replica * ranks + rank) * local
    _ready(args.ready_dir, args.replica, args.replicas)
    tokens = cfg.batch_size * cfg.seq_len
    while manager.current_step() < cfg.steps:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)  # the quorum of this step
        step = manager.current_step()
        x, y = get_batch(
            corpus.train, seed=cfg.seed, step=step, batch_size=cfg.batch_size, seq_len=cfg.seq_len
        )
        loss = par.train_step(x[at : at + local], y[at : at + local])
        for p in params:  # HSDP: each shard averaged over the live replica groups
            if p.grad is not None:
                manager.allreduce(p.grad.to_local()).wait()
        fsdp_ext.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()  # steps the optimizer only if every live replica agrees (should_commit)
        if manager.current_step() > step:  # committed
            scheduler.step()
            ms = (time.perf_counter() - t0) * 1e3
            if rank == 0 and (manager.current_step() % cfg.log_every == 0):
                print(
                    f"step {manager.current_step():5d} | loss {loss:.4f} | "
                    f"{tokens / ms * 1e3:8.0f} tok/s | {ms:7.1f} ms/step | "
                    f"replicas {manager.num_participants()}",
                    flush=True,
                )
        elif rank == 0:
            print(f"torchft: step {step} not committed (a replica failed)", flush=True)
    if rank == 0:
        print(f"torchft: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    if not math.isfinite(loss):
        sys.exit(1)


if __name__ == "__main__":
    main()
