"""Multi-process gloo harness: run one function on every rank of a real process group.

Ranks are forked from a forkserver that has already imported torch and fsdp_ext, so a run
costs a fork, not a fresh interpreter (importing fsdp_ext in every rank took most of the
suite's time on a loaded 2-core machine: 414 s against 70 s for three distributed test files).
Results and errors travel back as bytes (``torch.save``), which keeps tensors independent of
shared memory that dies with the child.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = float(os.environ.get("FSDP_EXT_TEST_TIMEOUT", "300"))
# Set to 1: in every rank, ``fully_shard`` without a mesh builds it on CUDA, as on a GPU
# machine, so that a rank relying on the default mesh fails on a CPU machine too.
FAKE_CUDA_ENV = "FSDP_EXT_DEFAULT_MESH_ON_CUDA"
_ERROR_GRACE_S = 3.0

_ctx = mp.get_context("forkserver")
# Nothing in fsdp_ext reads the environment at import time, so the forkserver's (old)
# environment does not leak into a rank through these modules.
# torch._dynamo too: a DTensor's constructor imports it on first use (``torch._disable_dynamo``),
# 0.6 s of CPU in every rank that shards; fsdp_ext no longer imports it (nor pipelining)
_ctx.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.fsdp",
        "torch._dynamo",
        "torch.profiler",
        "fsdp_ext",
    ]
)


class RankError(RuntimeError):
    """A rank raised; carries that rank's own traceback."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        also_failed: list[int] | None = None,
    ):
        self.rank = rank
        self.also_failed = [r for r in also_failed or [] if r != rank]
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n"
            + (f"(ranks {self.also_failed} failed after it)\n" if self.also_failed else "")
            + f"--- traceback from rank {rank} ---\n{remote_traceback}"
        )


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; names them."""

    def __init__(self, stuck: list[int], finished: list[int], timeout_s: float):
        self.stuck = stuck
        self.finished = finished
        super().__init__(
            f"ranks {stuck} did not finish within {timeout_s:.0f}s "
            f"(finished: {finished}); they were killed"
        )


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(fn, rank, world_size, store_path, results, args, kwargs, fake_cuda=0):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from fsdp_ext._torch import default_fsdp_mesh_on_cuda

    # Ranks share two cores; intra-op threads would only fight each other.
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        with default_fsdp_mesh_on_cuda() if fake_cuda else contextlib.nullcontext():
            out = fn(*args, **kwargs)
        payload = (rank, "ok", _dumps(out))
    except BaseException as exc:  # everything, KeyboardInterrupt too, goes to the parent
        payload = (rank, "error", (type(exc).__name__, str(exc), traceback.format_exc()))
    try:
        results.put(payload)
    finally:
        if dist.is_initialized() and payload[1] == "ok":
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). The first rank to raise has its
    exception re-raised here as :class:`RankError`; ranks still running after
    ``timeout`` seconds are named in :class:`RankTimeout`. Children are always reaped.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    fake_cuda = int(os.environ.get(FAKE_CUDA_ENV) or 0)  # read here: the forkserver's is old
    with tempfile.TemporaryDirectory(prefix="fsdp_ext_dist_") as tmp:
        results = _ctx.Queue()
        store = os.path.join(tmp, "store")
        procs = [
            _ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store, results, args, kwargs, fake_cuda),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()


def _collect(procs, results, timeout: float) -> list[Any]:
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    errors: dict[int, tuple[str, str, str]] = {}
    deadline = time.monotonic() + timeout
    error_deadline = None
    while len(outputs) + len(errors) < world_size:
        now = time.monotonic()
        limit = deadline if error_deadline is None else min(deadline, error_deadline)
        if now >= limit:
            break
        try:
            rank, status, data = results.get(timeout=min(0.5, limit - now))
        except queue.Empty:
            _note_silent_deaths(procs, outputs, errors)
            continue
        if status == "ok":
            outputs[rank] = _loads(data)
        else:
            errors[rank] = data
            # Peers of a failed rank usually block in a collective: give them a moment
            # to report their own errors, then stop waiting.
            error_deadline = error_deadline or time.monotonic() + _ERROR_GRACE_S
    if errors:
        # A rank that died silently, else the first error to arrive, is the cause; the
        # others are usually peers whose collectives broke because that rank went away.
        died = [r for r, e in errors.items() if e[0] == "ProcessDied"]
        rank = died[0] if died else next(iter(errors))
        exc_type, message, tb = errors[rank]
        raise RankError(rank, exc_type, message, tb, also_failed=sorted(errors))
    if len(outputs) < world_size:
        stuck = sorted(set(range(world_size)) - set(outputs))
        raise RankTimeout(stuck, sorted(outputs), timeout)
    return [outputs[r] for r in range(world_size)]


def _note_silent_deaths(procs, outputs, errors) -> None:
    """A rank that exited without reporting (segfault, os._exit) is an error, not a hang."""
    for rank, p in enumerate(procs):
        if rank in outputs or rank in errors or p.is_alive():
            continue
        p.join(timeout=0)
        if p.exitcode is not None and p.exitcode != 0:
            errors[rank] = ("ProcessDied", f"exit code {p.exitcode}", "<no traceback>")
