"""Step cost of a wrap plan: collectives and hooks, with constants measured on the machine.

Per step, every unit all-gathers in forward, again in backward unless its
``reshard_after_forward`` is False (the root's is, unless fully_shard got the argument
explicitly), and reduce-scatters once. A collective costs
``latency_s + bytes * seconds_per_byte`` (bytes each rank receives or sends:
``(world - 1) / world`` of the unit's unsharded bytes), a unit ``hook_s`` for its
forward/backward hooks and autograd nodes. With an int ``reshard_after_forward=r`` (hpZ)
the backward all-gather runs over ``r`` ranks of one node: ``(r - 1) / r`` of the bytes, at
``intra_node_seconds_per_byte`` (default: the same link). A prefetched all-gather
hides ``overlap`` of its time behind compute: 0 where collectives run on the calling
thread (gloo on CPU), close to 1 with NCCL on its own stream; it is the one constant not
calibrated (it depends on the compute it overlaps), so pass it for your GPU job.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class CostModel:
    """Constants of the step-cost model; the defaults were measured with gloo on the
    2-core development CPU (``calibrate_cost_model``, docs/wrap.md)."""

    latency_s: float = 3.0e-4
    seconds_per_byte: float = 4.0e-9
    hook_s: float = 5.0e-3
    overlap: float = 0.0
    source: str = "defaults (gloo, 2-core CPU)"
    intra_node_seconds_per_byte: float | None = None

    def __post_init__(self) -> None:
        for name in ("latency_s", "seconds_per_byte", "hook_s", "intra_node_seconds_per_byte"):
            value = getattr(self, name)
            if value is None and name == "intra_node_seconds_per_byte":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CostModel.{name} must be a number >= 0, got {value!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"CostModel.overlap must be in [0, 1], got {self.overlap!r}")

    def collective_s(self, nbytes: int, world_size: int, *, intra_node: bool = False) -> float:
        moved = nbytes * (world_size - 1) / max(world_size, 1)
        per_byte = self.seconds_per_byte
        if intra_node and self.intra_node_seconds_per_byte is not None:
            per_byte = self.intra_node_seconds_per_byte
        return self.latency_s + moved * per_byte

    def step_s(
        self,
        unit_bytes: list[int],
        reshard_after_forward: list[bool | int],
        world_size: int,
        *,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
    ) -> float:
        """Modelled seconds of FSDP overhead per step; ``unit_bytes[0]`` is the root.

        ``reshard_after_forward[i]``: False (kept: no backward gather), True (backward
        gather over ``world_size``) or an int ``r`` (backward gather over ``r`` ranks).
        """
        total = 0.0
        hidden = 1.0 - self.overlap
        for i, nbytes in enumerate(unit_bytes):
            if nbytes == 0 and i == 0:
                continue
            gather = self.collective_s(nbytes, world_size)
            total += self.hook_s + self.collective_s(nbytes, world_size)  # reduce-scatter
            total += gather * (hidden if forward_prefetch and i > 1 else 1.0)
            raf = reshard_after_forward[i]
            if raf is False:
                continue
            if not isinstance(raf, bool) and raf < world_size:  # hpZ: inside the node
                gather = self.collective_s(nbytes, raf, intra_node=True)
            total += gather * (hidden if backward_prefetch else 1.0)
        return total


def calibrate_cost_model(
    group: dist.ProcessGroup | None = None, *, repeats: int = 7, overlap: float | None = None
) -> CostModel:
    """Measure latency, bandwidth and per-unit hook time on this machine (collective).

    Every rank of ``group`` must call it. Latency: a 4-byte all-gather; bandwidth: an
    8 MiB one; hook time: a step of 16 tiny units minus a step of one, per extra unit,
    less its three collectives' latency. Medians of ``repeats``. ``overlap`` defaults to
    0 on CPU and 0.8 on GPUs.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats + 1):
            dist.barrier(group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    def gather(numel: int) -> float:
        inp = torch.zeros(numel, device=device)
        out = torch.empty(numel * world, device=device)
        gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return timed(lambda: gather_fn(out, inp, group=group))

    small, big_numel = gather(1), 1 << 21
    big = gather(big_numel)
    latency = small
    per_byte = max(big - small, 0.0) / (big_numel * 4 * world * (world - 1) / world)
    mesh = init_device_mesh(device.type, (world,))

    def step_time(units: int) -> float:
        model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(16))).to(device)
        if units > 1:
            for layer in model:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.ones(2, 4, device=device)
        return timed(lambda: model(x).sum().backward())

    # 16 units and the root: 15 units more, 46 collectives more (2 all-gathers and a
    # reduce-scatter each, against the root's one and one).
    hook = max((step_time(16) - step_time(1) - 46 * latency) / 15, 0.0)
    if overlap is None:
        overlap = 0.8 if device.type == "cuda" else 0.0
    base = CostModel()
    return replace(
        base,
        latency_s=latency,
        seconds_per_byte=per_byte,
        hook_s=hook,
        overlap=overlap,
        source=f"calibrated ({dist.get_backend(group)}, world {world}, {device.type})",
    )
