"""Training-loop pieces that stay correct under PP: one step, the loss, checkpoint state.

- Only the first stage feeds inputs and only the last stage sees targets and losses;
  :func:`pipeline_step` routes them so one call works on every rank.
- :func:`reduce_pipeline_loss` gives every rank the global mean loss: the last stage's
  microbatch losses, averaged over microbatches and the dp ranks, then sent over pp.
- :class:`PipelineState` is a DCP ``Stateful`` over the model parts of this rank (its
  stages, or the whole model at pp=1), keyed by the original fqns, with flattened
  optimizer state (torchtitan's layout): a checkpoint saved at one pp degree loads at
  another, because every rank asks only for the keys its parts hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_ext.parallel_dims import ParallelDims


def pipeline_step(
    schedule: Any, stages: Sequence[Any], inputs, targets, *, forward_only: bool = False
) -> list[torch.Tensor]:
    """Run one schedule step; returns this rank's microbatch losses (empty off the last stage).

    ``inputs`` are used only where a local stage is the first one, ``targets`` only where
    one is the last (both can be passed everywhere). ``forward_only``: ``schedule.eval``,
    for validation.
    """
    _check_batch(stages, inputs, targets)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    # A batch sliced from a longer sequence (x = tokens[:, :-1]) is strided; torch 2.11's
    # stages check strides against the contiguous shapes they inferred, and refuse it.
    inputs, targets = (
        t.contiguous() if isinstance(t, torch.Tensor) else t for t in (inputs, targets)
    )
    args = (inputs,) if is_first else ()
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if is_last else {}
    (schedule.eval if forward_only else schedule.step)(*args, **kwargs)
    return losses


def _check_batch(stages: Sequence[Any], inputs: Any, targets: Any) -> None:
    """A batch the microbatches cannot split evenly fails deep in the last stage, and the
    other ranks then lose their peer; every rank that passes it refuses it here instead."""
    n = next((s.n_microbatches for s in stages if getattr(s, "n_microbatches", None)), None)
    rows = {
        name: t.shape[0]
        for name, t in (("inputs", inputs), ("targets", targets))
        if isinstance(t, torch.Tensor) and t.dim() > 0
    }
    if len(set(rows.values())) > 1:
        raise ValueError(
            f"inputs has {rows['inputs']} rows and targets {rows['targets']}; pass the same "
            "rows of both"
        )
    for name, size in rows.items():
        if n is not None and size % n:
            raise ValueError(
                f"{name} has a batch of {size} rows, which n_microbatches={n} does not split "
                f"evenly; pass a multiple of {n} rows (this rank's slice of the batch)"
            )


def reduce_pipeline_loss(
    losses: Sequence[torch.Tensor], stages: Sequence[Any], parallel_dims: ParallelDims
) -> float:
    """The global mean loss of the step, the same float on every rank.

    Mean over this rank's microbatches (equal sizes), mean over the dp ranks holding the
    last stage, then a sum over pp in which only the last stage contributes.
    """
    is_last = any(s.is_last for s in stages)
    if is_last and not losses:
        raise ValueError("losses is empty on the last stage: pass the list from pipeline_step")
    value = torch.stack([loss.detach().float() for loss in losses]).mean() if is_last else None
    total = value if value is not None else torch.zeros((), dtype=torch.float32)
    if parallel_dims.dp > 1:
        dist.all_reduce(total, group=parallel_dims.dp_flat_mesh.get_group())
        total = total / parallel_dims.dp
    if parallel_dims.pp > 1:
        dist.all_reduce(total, group=parallel_dims.pp_mesh.get_group())
    return float(total)


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class PipelineState:
    """DCP ``Stateful`` of this rank's model parts and their optimizers.

    ``model_parts``: the stage modules this rank holds (``[s.submod for s in stages]``),
    or ``[model]`` without PP. ``optimizers``: one per part, same order (or None).
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
    ):
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers) if optimizers is not None else []
        if self.optimizers and len(self.optimizers) != len(self.model_parts):
            raise ValueError(
                f"optimizers must have one entry per model part ({len(self.model_parts)}), "
                f"got {len(self.optimizers)}"
            )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self.model_parts:
            state.update(get_model_state_dict(part))
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            state.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            keys = set(get_model_state_dict(part))
            part_state = {k: v for k, v in state_dict.items() if k in keys}
            set_model_state_dict(part, part_state)
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=_FLAT)
