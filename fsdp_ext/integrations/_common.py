"""What the trainer adapters share.

LoCo's error buffers differ per rank, and a trainer's checkpoint is written by its own code,
so every adapter keeps them one way: each rank saves and loads its own part,
``CommHandle.state_dict()``'s ``{"rank{r}": bytes}``, and nothing is gathered (the buffers
are as large as the gradient shards). A trainer that hands every rank the checkpoint
directory (accelerate's ``save_state`` / ``load_state`` hooks, the HF ``Trainer``'s optimizer
save and load) gets one file per rank, :func:`save_comm_state` / :func:`load_comm_state`;
torchtitan's checkpoint is DCP, which writes each rank's keys itself, so it takes the
handle as one of its states. A checkpoint without this rank's part (LoCo newly on, another
world size) gives the handle's one warning and fresh buffers, or raises under ``strict``.

Accelerate's FSDP2 path (which the HF ``Trainer`` runs on) is shared too: finding the FSDP2
plugin with a message that says why it is missing, sharding with the plugin's settings,
and keeping the optimizer's parameters by name across ``accelerator.prepare``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from fsdp_ext._torch import compiled_inner
from fsdp_ext.comm import CommConfig, CommHandle
from fsdp_ext.wrap import GranularityPolicy, node_local_reshard, shard_by_policy

LOCO_STATE_FILE = "fsdp_ext_loco_rank{rank}.pt"

# accelerate keeps a FullyShardedDataParallelPlugin only on accelerators (GPU, XPU, NPU, ...)
CPU_FSDP_DROPPED = (
    "accelerate dropped the FSDP plugin: on CPU it runs DDP (distributed_type=MULTI_CPU) and "
    "keeps FSDP only on GPUs and other accelerators. On GPUs nothing else is needed; to keep "
    "FSDP2 on CPU (tests, rehearsals), call "
    "fsdp_ext.integrations.accelerate.keep_fsdp_on_cpu(accelerator, plugin) right after "
    "building the Accelerator (see docs/integrations.md, 'FSDP on CPU')"
)

__all__ = [
    "CPU_FSDP_DROPPED",
    "LOCO_STATE_FILE",
    "check_plugin",
    "comm_from_arguments",
    "comm_state_path",
    "fsdp2_plugin",
    "fully_shard_kwargs",
    "hpz_reshard_after_forward",
    "keep_fsdp_on_cpu",
    "load_comm_state",
    "optimizer_param_names",
    "refuse_sharded",
    "restore_optimizer_params",
    "save_comm_state",
    "shard",
]


# ------------------------------------------------------------------------- ZeRO++


def comm_from_arguments(comm: CommConfig | None) -> CommConfig | None:
    """An adapter's ``comm=``, checked; None when it turns nothing on."""
    if comm is not None and not isinstance(comm, CommConfig):
        raise TypeError(f"comm must be a fsdp_ext.CommConfig or None, got {type(comm).__name__}")
    return comm if comm is not None and comm.enabled else None


def hpz_reshard_after_forward(comm: CommConfig | None, mesh: Any, default: Any) -> Any:
    """``reshard_after_forward`` for the units: the ranks per node of ``mesh`` under hpZ
    (``comm.hpz``), else ``default``."""
    if comm is None or not comm.hpz:
        return default
    return node_local_reshard(mesh, comm.node_size, dist.get_world_size())


# ------------------------------------------------------------------------- LoCo state


def comm_state_path(directory: str | os.PathLike) -> str:
    """This rank's LoCo file in a checkpoint directory."""
    return os.path.join(os.fspath(directory), LOCO_STATE_FILE.format(rank=dist.get_rank()))


def save_comm_state(handle: CommHandle, directory: str | os.PathLike) -> str:
    """Write this rank's part of ``handle``'s state into ``directory``; every rank calls it
    (no collective). Returns the file's path."""
    path = comm_state_path(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(handle.state_dict(), path)
    return path


def load_comm_state(handle: CommHandle, directory: str | os.PathLike) -> None:
    """Read this rank's part back from ``directory``. Without the file, the handle resets its
    buffers with one warning (``handle.strict = True`` makes it raise)."""
    path = comm_state_path(directory)
    state = torch.load(path, weights_only=True) if os.path.isfile(path) else {}
    handle.load_state_dict(state)


# ------------------------------------------------------------------- accelerate's FSDP2


def refuse_sharded(model: nn.Module, fix: str) -> None:
    """A model FSDP already sharded (``accelerator.prepare`` ran on it) would be sharded a
    second time, and FSDP2 fails deep inside ``DeviceMesh``: refuse it here."""
    if isinstance(compiled_inner(model), FSDPModule):
        raise ValueError(f"model is already sharded (accelerator.prepare ran on it?): {fix}")


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
    fn = policy.func if isinstance(policy, functools.partial) else policy
    return fn is transformer_auto_wrap_policy or fn is size_based_auto_wrap_policy


def _distributed_type(accelerator: Any) -> str:
    value = accelerator.distributed_type
    return str(getattr(value, "value", value))


def fsdp2_plugin(accelerator: Any) -> Any:
    """The accelerator's FSDP2 plugin, checked; a ValueError naming why there is none."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    kind = _distributed_type(accelerator)
    if plugin is None and kind == "MULTI_CPU":
        raise ValueError(CPU_FSDP_DROPPED)
    if plugin is None and kind == "NO":
        raise ValueError(
            "FSDP2 needs a distributed launch (torchrun --nproc-per-node N, or accelerate "
            "launch): accelerate sees one process (distributed_type=NO)"
        )
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        version = None if plugin is None else getattr(plugin, "fsdp_version", 1)
        raise ValueError(
            "accelerator must use FullyShardedDataParallelPlugin(fsdp_version=2): "
            f"Accelerator(fsdp_plugin=...) (got fsdp_version={version}, distributed_type={kind})"
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


def keep_fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Put back the FSDP plugin accelerate dropped on CPU: what it sets itself on GPUs
    (``distributed_type = FSDP`` on the accelerator's state and on ``PartialState``, which
    every later ``AcceleratorState()`` copies, and the plugin). Call it right after building
    the ``Accelerator``, on every rank."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "plugin must be a FullyShardedDataParallelPlugin(fsdp_version=2), got "
            f"{type(plugin).__name__} with fsdp_version={getattr(plugin, 'fsdp_version', None)}"
        )
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def fully_shard_kwargs(accelerator: Any, plugin: Any) -> dict[str, Any]:
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


def shard(
    accelerator: Any,
    model: nn.Module,
    *,
    auto_wrap_policy: Any = None,
    comm: CommConfig | None = None,
) -> nn.Module:
    """Check the plugin, shard ``model`` in place with the plugin's settings, and turn the
    plugin's own wrap policy off, so that a later ``accelerator.prepare`` takes ``model``
    as it is. Under hpZ (``comm.hpz``) every unit keeps its
    post-forward copy sharded over its node's ranks, whatever the plugin's reshard says."""
    plugin = fsdp2_plugin(accelerator)
    policy = GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy
    if accelerator.mixed_precision != "no":
        # as accelerate does: FSDP2 wants one orig dtype per unit; fp32 masters, compute
        # in the policy's param_dtype
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    kwargs = fully_shard_kwargs(accelerator, plugin)
    kwargs["reshard_after_forward"] = hpz_reshard_after_forward(
        comm, kwargs.get("mesh"), kwargs["reshard_after_forward"]
    )
    shard_by_policy(model, auto_wrap_policy=policy, **kwargs)
    plugin.auto_wrap_policy = None  # prepare would re-derive it from renamed FSDP classes
    plugin.transformer_cls_names_to_wrap = None
    return model


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
    sharded = dict(compiled_inner(model).named_parameters())  # torch.compile'd by prepare
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        group["params"] = [sharded[n] for n in names]
