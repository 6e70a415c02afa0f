"""Gradient-norm clipping for gradients that live on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one tensor, which
fails once dense gradients are DTensors on the dp mesh and expert gradients DTensors on
the (efsdp, ep) mesh. Here gradients are grouped by (mesh, placements). Each group's
partial ``sum |g|^p`` (``max |g|`` for inf) is reduced over exactly the mesh dims that
shard it (never over a replicated dim, which would count replicas twice), the groups
are combined, then stages are combined over ``pp_mesh``:
``total = (sum_groups norm_g^p)^(1/p)``, the same value on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_EPS = 1e-6


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type`` norm is at most ``max_norm``.

    Returns the global norm before clipping (a plain fp32 scalar tensor). A non-finite
    norm leaves every gradient untouched (scaling by ``max_norm / inf`` would turn inf
    into nan and finite values into 0) and, with ``error_if_nonfinite``, raises.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    max_norm = float(max_norm)
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, norm_type, pp_mesh=pp_mesh)
    finite = torch.isfinite(total)
    if error_if_nonfinite and not bool(finite):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to return it without clipping"
        )
    coef = torch.where(finite, (max_norm / (total + _EPS)).clamp(max=1.0), torch.ones_like(total))
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))
    return total


def total_grad_norm(
    grads: list[torch.Tensor], norm_type: float, *, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """The norm of all ``grads`` as if they were one unsharded vector, on every rank."""
    is_inf = math.isinf(norm_type)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:  # insertion order: every rank of a mesh meets the groups in one order
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else (None, ())
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    partials = [
        _group_partial(members, mesh, placements, norm_type)
        for (mesh, placements), members in groups.items()
    ]
    if not partials:
        total = torch.zeros((), dtype=torch.float32, device=device)
    elif is_inf:
        total = torch.stack(partials).max()
    else:
        total = torch.stack(partials).sum()
    if pp_mesh is not None and pp_mesh.size() > 1:
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        total = _nan_to_inf(total) if is_inf else total
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    return total if is_inf else total ** (1.0 / norm_type)


def _group_partial(
    members: list[torch.Tensor],
    mesh: DeviceMesh | None,
    placements: tuple,
    norm_type: float,
) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|``) over one group's full tensors, reduced over its mesh."""
    is_inf = math.isinf(norm_type)
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in members]
    # A rank's shard may be empty (uneven sharding); the inf-norm of nothing raises in torch.
    norms = torch.stack(
        [torch.zeros((), dtype=torch.float32, device=members[0].device)]
        + [
            torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)
            for t in locals_
            if t.numel()
        ]
    )
    # MAX reductions may drop a nan (max(nan, x) can be x); an inf survives them.
    partial = _nan_to_inf(norms.max()) if is_inf else (norms**norm_type).sum()
    if mesh is None:
        return partial
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                f"gradients must be reduced before clipping; got placement {placement} on "
                f"mesh dim {dim}"
            )
        if not placement.is_replicate():  # Shard, or _StridedShard (no is_shard())
            op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
            dist.all_reduce(partial, op=op, group=mesh.get_group(dim))
    return partial


def _nan_to_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, math.inf), x)
