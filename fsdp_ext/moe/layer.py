"""Mixture-of-experts feed-forward: top-k router, grouped SwiGLU experts, shared expert.

Pure torch and parallelism-agnostic, as in torchtitan: expert parallelism swaps the
``dispatcher`` of :class:`GroupedExperts` (see ``expert_parallel.py``), and the global
load-balancing statistics come from ``MoE.load_balance_group`` when one is set.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class TopKRouter(nn.Module):
    """Softmax over expert scores, keep the ``top_k`` best per token."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, normalize_top_k: bool = True):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, dim]`` -> probs ``[T, E]`` (fp32), top-k weights and expert ids ``[T, k]``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU per expert on expert-major rows: ``counts[e]`` consecutive rows go to expert e.

    An expert with no rows still takes part (an empty matmul), so its weights always get a
    gradient, exactly zero, and every rank runs the same backward.
    """
    outputs = []
    for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
        hidden = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
        outputs.append(hidden @ w2[e].t())
    return torch.cat(outputs, dim=0)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """Expert weights are DTensors (Shard(0) over ep) under expert parallelism."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def local_dispatch(
    x: torch.Tensor, counts: torch.Tensor, compute, weights: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """ep=1: every expert lives here, the rows are already expert-major."""
    return compute(x, counts, *weights)


class GroupedExperts(nn.Module):
    """All experts' SwiGLU weights in single ``[num_experts, ...]`` parameters.

    One module, so one FSDP unit: its forward runs on every rank whatever the routing.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.dispatcher = local_dispatch
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: rows sorted by global expert id, ``counts[e]`` rows for expert e."""
        weights = (_local(self.w1), _local(self.w2), _local(self.w3))
        return self.dispatcher(x, counts, grouped_swiglu, weights)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``out`` that feeds gradient ``scale`` into ``aux`` on backward.

    The load-balancing loss then trains the router without the training loop knowing.
    ``scale`` must be what the loop multiplies its loss by before ``backward`` (a
    GradScaler's scale, ``1/n`` under gradient accumulation): see :func:`set_aux_loss_scale`.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float | torch.Tensor):
        ctx.aux_dtype = aux.dtype
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        scale = torch.as_tensor(ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, scale.detach().clone().reshape(()), None


def set_aux_loss_scale(model: nn.Module, scale: float | torch.Tensor) -> int:
    """Tell every :class:`MoE` in ``model`` what the loss is multiplied by before backward.

    The load-balancing loss is not part of the loss the training loop sees (it enters the
    gradient inside the MoE layer, which also works under pipeline parallelism, where it
    is on another stage than the loss), so the loop's scaling must be passed on by hand,
    as with Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``::

        scale = scaler.get_scale() / accumulation_steps    # GradScaler and accumulation
        fsdp_ext.set_aux_loss_scale(model, scale)
        scaler.scale(loss / accumulation_steps).backward()

    Call it whenever the scale changes (a GradScaler changes it after overflow steps);
    ``scale`` may be a 0-dim tensor (e.g. on the GPU, to avoid a sync). Returns the number
    of MoE layers set.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise TypeError(f"scale must be a float or a one-element float tensor, got {scale!r}")
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    else:
        raise TypeError(f"scale must be a float or a one-element float tensor, got {scale!r}")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.aux_loss_scale = scale
    return len(moes)


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts, with an optional always-on shared expert.

    ``load_balance_coef > 0`` adds the Switch-Transformer loss
    ``coef * E * sum_e f_e * P_e`` (f: fraction of routed slots, P: mean router prob) to the
    gradient. ``f`` is counted over the global batch (all-reduced over
    ``load_balance_group``) and ``P`` over the local batch, so the data-parallel mean of the
    per-rank losses equals the single-process loss on the global batch, for any layout.
    The last value is kept in ``aux_loss`` (detached) for logging. Its gradient is
    multiplied by ``aux_loss_scale`` (1 by default; set by :func:`set_aux_loss_scale`), so
    that it follows the loss scaling of the training loop.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        shared_hidden_dim: int = 0,
        load_balance_coef: float = 0.0,
        normalize_top_k: bool = True,
    ):
        super().__init__()
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}"
            )
        if load_balance_coef < 0:
            raise ValueError(f"load_balance_coef must be >= 0, got {load_balance_coef!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.load_balance_coef = load_balance_coef
        self.load_balance_group: dist.ProcessGroup | None = None
        self.router = TopKRouter(dim, num_experts, top_k, normalize_top_k=normalize_top_k)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_expert = SwiGLU(dim, shared_hidden_dim) if shared_hidden_dim > 0 else None
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_scale: float | torch.Tensor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, weights, experts = self.router(tokens)
        slots = experts.flatten()  # slot t * k + j holds token t's j-th expert
        counts = torch.bincount(slots, minlength=self.num_experts)
        order = torch.argsort(slots, stable=True)
        routed = self.experts(tokens[order // self.top_k], counts)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.numel(), device=order.device)
        per_slot = routed[unsorted].view(-1, self.top_k, shape[-1])
        out = (per_slot * weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.load_balance_coef > 0 and self.training:
            aux = self.load_balance_coef * self._load_balance_loss(probs, counts)
            self.aux_loss = aux.detach()
            out = _AddAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out.view(shape)

    def _load_balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.float32)
        if self.load_balance_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.load_balance_group)
        fraction = counts / counts.sum()
        return self.num_experts * (fraction * probs.mean(dim=0)).sum()


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: the MoE's shared expert, and the dense layers of
    ``examples/model.py``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
