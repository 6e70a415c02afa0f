"""HF accelerate: shard with an fsdp-ext policy, then let ``accelerator.prepare`` take over.

``prepare(accelerator, model, optimizer, auto_wrap_policy=...)`` replaces
``accelerator.prepare(model, optimizer)`` under ``FullyShardedDataParallelPlugin(fsdp_version=2)``.
Accelerate's FSDP2 path only knows the two FSDP1 wrap functions by identity and drops any
other policy without a word, and it skips a model that is already an ``FSDPModule``. So the
adapter shards first, with the plugin's mesh, mixed precision, offload and reshard settings,
turns the plugin's own wrap policy off (it would look for layer classes FSDP2 renamed), gives
the optimizer the sharded parameters, and then calls ``prepare``, which sets up everything
else (gradient clipping, state dicts, dataloaders). With ``comm=CommConfig(...)`` it turns
on ZeRO++ (LoCo / qgZ gradients, qwZ weights, hpZ secondary shards) through
``fsdp_ext.comm.enable``, and ``save_state`` / ``load_state`` keep LoCo's error buffers, one
file per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fsdp_ext._torch import compiled_inner
from fsdp_ext.comm import CommConfig, enable
from fsdp_ext.integrations._common import (
    check_plugin,
    comm_from_arguments,
    keep_fsdp_on_cpu,
    load_comm_state,
    optimizer_param_names,
    refuse_sharded,
    restore_optimizer_params,
    save_comm_state,
    shard,
)

__all__ = ["check_plugin", "keep_fsdp_on_cpu", "prepare", "shard"]

OptimizerOrFactory = (
    torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
)


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: OptimizerOrFactory,
    *other: Any,
    auto_wrap_policy: Any = None,
    comm: CommConfig | None = None,
) -> tuple[Any, ...]:
    """``accelerator.prepare(model, optimizer, *other)`` with fsdp-ext's sharding.

    ``optimizer``: an optimizer over ``model``'s parameters (built before sharding; its
    param groups and hyper-parameters carry over to the sharded parameters, its state
    must still be empty), or a factory ``params -> optimizer``. ``auto_wrap_policy``:
    anything :func:`fsdp_ext.shard_by_policy` takes (default ``GranularityPolicy()``, one unit
    per block). ``comm``: ZeRO++ on every unit (``fsdp_ext.comm.enable``; hpZ shards
    with the node's ranks), LoCo's error buffers kept in ``save_state`` / ``load_state``.
    Returns what ``prepare``
    returns, then the ``CommHandle`` (None without ``comm``):
    ``model, optimizer, handle = prepare(...)``.
    Call it on every rank, on a model ``accelerator.prepare`` has not seen.
    """
    refuse_sharded(
        model,
        "pass the unsharded model to fsdp_ext.integrations.accelerate.prepare in place of "
        "accelerator.prepare; it shards with auto_wrap_policy, then calls accelerator.prepare",
    )
    comm = comm_from_arguments(comm)
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        raise ValueError("optimizer must not have stepped yet: its state cannot be resharded")
    names = {p: n for n, p in model.named_parameters()}
    shard(accelerator, model, auto_wrap_policy=auto_wrap_policy, comm=comm)
    optimizer = _optimizer_for(optimizer, model, names)
    group_names = optimizer_param_names(optimizer, model)
    prepared = accelerator.prepare(model, optimizer, *other)
    restore_optimizer_params(optimizer, prepared[0], group_names)
    if comm is None:
        return (*prepared, None)
    handle = enable(prepared[0], comm)
    if comm.gradients is None:
        return (*prepared, handle)  # qwZ and hpZ keep no state between steps
    # every rank runs both hooks with the checkpoint directory (before accelerate's own
    # files): each writes and reads its own part
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: save_comm_state(handle, output_dir)
    )
    accelerator.register_load_state_pre_hook(
        lambda models, input_dir: load_comm_state(handle, input_dir)
    )
    return (*prepared, handle)


def _optimizer_for(
    optimizer: OptimizerOrFactory, model: nn.Module, names: dict[nn.Parameter, str]
) -> torch.optim.Optimizer:
    """An optimizer over the sharded parameters: the factory's, or ``optimizer`` with
    every group pointed at the sharded parameter of the same name (in place; its state
    is empty, so nothing else refers to the old parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    sharded = dict(compiled_inner(model).named_parameters())  # torch.compile'd by prepare
    for group in optimizer.param_groups:
        if any(p not in names for p in group["params"]):
            raise ValueError("optimizer holds parameters that are not model's parameters")
        group["params"] = [sharded[names[p]] for p in group["params"]]
    return optimizer
