"""HF accelerate: shard with an fsdp-ext policy, then let ``accelerator.prepare`` take over.

``prepare(accelerator, model, optimizer, auto_wrap_policy=...)`` replaces
``accelerator.prepare(model, optimizer)`` under ``FullyShardedDataParallelPlugin(fsdp_version=2)``.
Accelerate's FSDP2 path only knows the two FSDP1 wrap functions by identity and drops any
other policy without a word, and it skips a model that is already an ``FSDPModule``. So the
adapter shards first, with the plugin's mesh, mixed precision, offload and reshard settings,
turns the plugin's own wrap policy off (it would look for layer classes FSDP2 renamed), gives
the optimizer the sharded parameters, and then calls ``prepare``, which sets up everything
else (gradient clipping, state dicts, dataloaders). With ``loco=`` it registers LoCo and puts
its error buffers into ``save_state`` / ``load_state``, gathered from every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_ext._torch import compiled_inner, tree_map
from fsdp_ext.comm import CommHandle, LoCoConfig, register_comm_hook
from fsdp_ext.wrap import GranularityPolicy, fully_shard

OptimizerOrFactory = (
    torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
)


class AllRanksCommState:
    """A ``CommHandle``'s state for accelerate's ``register_for_checkpointing``.

    Accelerate calls ``state_dict`` on every rank but writes only the main process's
    result, then loads that one file on every rank. LoCo's error buffers differ per rank,
    so ``state_dict`` gathers every rank's part (a collective) and ``load_state_dict`` picks
    this rank's.
    """

    def __init__(self, handle: CommHandle):
        self.handle = handle

    def state_dict(self) -> dict[str, Any]:
        mine = tree_map(
            lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t,
            self.handle.state_dict(),
        )
        parts: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, mine)
        return {key: value for part in parts for key, value in part.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.handle.load_state_dict(state_dict)


def check_plugin(plugin: Any) -> None:
    """Refuse a plugin accelerate would mishandle: our policy in it is silently dropped."""
    policy = getattr(plugin, "auto_wrap_policy", None)
    if isinstance(policy, GranularityPolicy) or (
        policy is not None and getattr(plugin, "fsdp_version", 1) == 2 and not _is_fsdp1_fn(policy)
    ):
        raise ValueError(
            f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}): accelerate's FSDP2 "
            "path ignores every policy but transformer_auto_wrap_policy and "
            "size_based_auto_wrap_policy, so every layer would stay in the root unit. Pass "
            "the policy to fsdp_ext.integrations.accelerate.prepare(..., auto_wrap_policy=...) "
            "instead."
        )


def _is_fsdp1_fn(policy: Any) -> bool:
    import functools

    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    fn = policy.func if isinstance(policy, functools.partial) else policy
    return fn is transformer_auto_wrap_policy or fn is size_based_auto_wrap_policy


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: OptimizerOrFactory,
    *other: Any,
    auto_wrap_policy: Any = None,
    loco: LoCoConfig | None = None,
) -> tuple[Any, ...]:
    """``accelerator.prepare(model, optimizer, *other)`` with fsdp-ext's sharding.

    ``optimizer``: an optimizer over ``model``'s parameters (built before sharding; its
    param groups and hyper-parameters carry over to the sharded parameters, its state
    must still be empty), or a factory ``params -> optimizer``. ``auto_wrap_policy``:
    anything :func:`fsdp_ext.fully_shard` takes (default ``GranularityPolicy()``, one unit
    per block). ``loco``: register LoCo on every unit and checkpoint its error buffers.
    Returns what ``prepare`` returns, plus the ``CommHandle`` last when ``loco`` is given.
    Call it on every rank.
    """
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        raise ValueError("optimizer must not have stepped yet: its state cannot be resharded")
    names = {p: n for n, p in model.named_parameters()}
    shard(accelerator, model, auto_wrap_policy=auto_wrap_policy)
    optimizer = _optimizer_for(optimizer, model, names)
    group_names = optimizer_param_names(optimizer, model)
    prepared = accelerator.prepare(model, optimizer, *other)
    restore_optimizer_params(optimizer, prepared[0], group_names)
    if loco is None:
        return prepared
    handle = register_comm_hook(prepared[0], loco)
    accelerator.register_for_checkpointing(AllRanksCommState(handle))
    return (*prepared, handle)


def shard(accelerator: Any, model: nn.Module, *, auto_wrap_policy: Any = None) -> nn.Module:
    """Steps 1 to 4 of :func:`prepare`: check the plugin, shard ``model`` in place with the
    plugin's settings, and turn the plugin's own wrap policy off, so that a later
    ``accelerator.prepare`` takes ``model`` as it is. Also the first step of
    :class:`fsdp_ext.integrations.hf_trainer.FSDPExtTrainer`."""
    plugin = _fsdp2_plugin(accelerator)
    policy = GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy
    if accelerator.mixed_precision != "no":
        # as accelerate does: FSDP2 wants one orig dtype per unit; fp32 masters, compute
        # in the policy's param_dtype
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    fully_shard(model, auto_wrap_policy=policy, **_fully_shard_kwargs(accelerator, plugin))
    plugin.auto_wrap_policy = None  # prepare would re-derive it from renamed FSDP classes
    plugin.transformer_cls_names_to_wrap = None
    return model


def _fsdp2_plugin(accelerator: Any) -> Any:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "accelerator must use FullyShardedDataParallelPlugin(fsdp_version=2) "
            f"(got fsdp_plugin={plugin!r}, distributed_type={accelerator.distributed_type})"
        )
    check_plugin(plugin)
    unsupported = {
        "activation_checkpointing": "apply torch's checkpoint_wrapper before prepare",
        "cpu_ram_efficient_loading": "load the weights before prepare",
        "ignored_modules": "no fsdp-ext equivalent yet",
    }
    for name, hint in unsupported.items():
        if getattr(plugin, name, None):
            raise ValueError(f"FullyShardedDataParallelPlugin({name}=...) is not supported: {hint}")
    return plugin


def _fully_shard_kwargs(accelerator: Any, plugin: Any) -> dict[str, Any]:
    """The kwargs accelerate's own FSDP2 path passes to every ``fully_shard``."""
    kwargs: dict[str, Any] = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    if plugin.cpu_offload is not None:
        kwargs["offload_policy"] = plugin.cpu_offload
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        kwargs["mesh"] = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    return kwargs


def _optimizer_for(
    optimizer: OptimizerOrFactory, model: nn.Module, names: dict[nn.Parameter, str]
) -> torch.optim.Optimizer:
    """An optimizer over the sharded parameters: the factory's, or ``optimizer`` with
    every group pointed at the sharded parameter of the same name (in place; its state
    is empty, so nothing else refers to the old parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    model = compiled_inner(model)  # torch.compile'd by prepare
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        if any(p not in names for p in group["params"]):
            raise ValueError("optimizer holds parameters that are not model's parameters")
        group["params"] = [sharded[names[p]] for p in group["params"]]
    return optimizer


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """Each param group's parameters, by name in ``model``: what
    :func:`restore_optimizer_params` puts back after ``accelerator.prepare``."""
    names = {p: n for n, p in model.named_parameters()}
    return [[names[p] for p in group["params"]] for group in optimizer.param_groups]


def restore_optimizer_params(
    optimizer: torch.optim.Optimizer, model: nn.Module, group_names: list[list[str]]
) -> None:
    """Point every param group at ``model``'s parameters of the recorded names.

    ``accelerator.prepare`` re-maps an optimizer's parameters by ``data_ptr`` of their local
    shard. A parameter with fewer dim-0 rows than ranks (Qwen2-MoE's ``shared_expert_gate``,
    1 row) has an empty shard on the last ranks, and every empty shard has ``data_ptr`` 0, so
    there the optimizer ends up holding one of them twice and the others not at all. The
    values do not change (the shards are empty), but the optimizer state differs in
    structure between ranks, and a full-state-dict save (the ``Trainer``'s default)
    then fails with a collective mismatch.
    """
    model = compiled_inner(model)  # torch.compile'd by prepare
    sharded = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        group["params"] = [sharded[n] for n in names]
