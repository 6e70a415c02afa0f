"""The model and the outside-the-library loggers of the overlap tests (qwZ's gathers in
``test_qwz_overlap.py``, LoCo's exchanges in ``test_loco_overlap.py``): 4 blocks of different
sizes, so each unit's collective has its own size, sharded per block and at the root."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WORLD, GROUP, DIM = 2, 32, 32
HIDDEN = (64, 96, 128, 160)  # one size per block: each unit's gather has its own size


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList([Block(h) for h in HIDDEN])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    rank = dist.get_rank()
    return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]


def sharded(mesh, mp: torch.dtype | None = None) -> Net:
    torch.manual_seed(0)
    net = Net()
    kwargs = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=mp)}
    for block in net.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    return net


class Marker(torch.autograd.Function):
    """Identity; its backward logs that the block after it finished its backward compute."""

    @staticmethod
    def forward(ctx, x, log, index):
        ctx.log, ctx.index = log, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("bwd_done", ctx.index))
        return grad, None, None


class LoggedWork(dist.Work):
    """Delegates to the collective's ``Work`` and logs when it is waited for."""

    def __init__(self, work, log, unit):
        super().__init__()
        self._work, self._log, self._unit = work, log, unit

    def wait(self, timeout=None):
        self._log.append(("wait", self._unit))
        return self._work.wait()


def logged_collective(real, unit_of: dict, log: list):
    """``real`` (a gloo collective taking ``output, input``) wrapped to log each call's start
    and each ``wait()`` as ``("start" | "wait", unit)``, the unit named by the output's size."""

    def logged(output, input, *args, async_op=False, **kwargs):
        unit = unit_of.get(output.numel())
        log.append(("start", unit))
        work = real(output, input, *args, async_op=async_op, **kwargs)
        if not async_op:
            log.append(("wait", unit))
            return work
        return LoggedWork(work, log, unit)

    return logged
