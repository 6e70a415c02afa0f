"""torchtitan: its FSDP step with an fsdp-ext wrap policy, ZeRO++, and LoCo in its checkpoints.

``apply_fsdp(model, dp_mesh, ..., auto_wrap_policy=...)`` takes the arguments of
``torchtitan.distributed.fsdp.apply_fsdp_to_decoder`` (0.3.0) and replaces it inside a
model's parallelize function. torchtitan's fixed units stay as they are: the token
embedding alone, ``[norm, lm_head]`` as one unit that is only resharded after forward
under ``"always"`` (or ``[tok_embeddings, norm, lm_head]`` with tied weights), and the
root last. The policy picks the units of the decoder blocks; the default,
``GranularityPolicy()``, picks one per block, which is torchtitan's plan exactly.
``comm=CommConfig(...)`` turns ZeRO++ on (``fsdp_ext.comm.enable``); under hpZ every unit
torchtitan reshards after forward keeps its post-forward copy on the node's ranks.
Mixed precision (``cast_forward_inputs=False``), CPU offload, the reshard policy, MoE
expert placement, gradient division off and EP prefetching are torchtitan's.

``with_comm_state(checkpointer, handle)`` puts LoCo's error buffers into torchtitan's
``CheckpointManager``: the ``CommHandle`` keys its bytes by rank (``rank{r}``), as
torchtitan's dataloader keys its state by ``dp_rank_{r}``, so every rank saves and loads
its own part through DCP (the adapters' one way, :mod:`fsdp_ext.integrations._common`).

torchtitan's ``parallelism.spmd_backend`` must be ``"partial_dtensor"``: under 0.3.0's
default, ``"spmd_types"`` (and under ``"full_dtensor"``), torchtitan hands FSDP its whole
SPMD mesh with ``dp_mesh_dims``, and ``fully_shard`` refuses the plain parameters of a
data-parallel model, torchtitan's own ``apply_fsdp_to_decoder`` included.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

from fsdp_ext._torch import ShardPlacementResult, fsdp_mesh_info, fsdp_units
from fsdp_ext.comm import CommConfig, CommHandle, enable
from fsdp_ext.integrations._common import comm_from_arguments, hpz_reshard_after_forward
from fsdp_ext.wrap import GranularityPolicy, WrapPlan, check_wrap, shard_by_policy

__all__ = ["SPMD_BACKENDS", "apply_fsdp", "check_spmd_backend", "plan_fsdp", "with_comm_state"]

RESHARD_AFTER_FORWARD_POLICIES = ("always", "never", "default")
# torchtitan 0.3.0's parallelism.spmd_backend values, and the one FSDP runs under
SPMD_BACKENDS = ("partial_dtensor", "full_dtensor", "spmd_types")
SUPPORTED_SPMD_BACKEND = "partial_dtensor"
# CheckpointManager's own keys (torchtitan.components.checkpoint) and the Trainer's.
RESERVED_STATE_KEYS = ("model", "optimizer", "dataloader", "lr_scheduler", "train_state")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    ep_degree: int = 1,
    edp_mesh: DeviceMesh | None = None,
    dp_mesh_dims: Any = None,
    edp_mesh_dims: Any = None,
    enable_symm_mem: bool = False,
    *,
    auto_wrap_policy: object = None,
    comm: CommConfig | None = None,
) -> CommHandle | None:
    """``apply_fsdp_to_decoder`` with ``auto_wrap_policy`` choosing the blocks' units.

    ``auto_wrap_policy``: anything :func:`fsdp_ext.shard_by_policy` takes (default
    ``GranularityPolicy()``: one unit per block, torchtitan's plan). ``comm``: ZeRO++ on
    every unit, returning the ``CommHandle`` (put LoCo's state in the checkpoint with
    :func:`with_comm_state`); None otherwise. Call it on every rank, where torchtitan
    calls ``apply_fsdp_to_decoder``: after TP/EP, activation checkpointing and compile,
    before ``to_empty`` and ``init_weights``.
    """
    from torchtitan.distributed.fsdp import (
        disable_fsdp_gradient_division,
        enable_fsdp_symm_mem,
    )

    _check_arguments(
        model, param_dtype, reduce_dtype, pp_enabled, reshard_after_forward_policy, ep_degree
    )
    comm = comm_from_arguments(comm)
    if comm is not None and ep_degree > 1:
        raise ValueError(
            f"comm with ep_degree={ep_degree} > 1 is not supported: experts on edp_mesh give "
            "each MoE unit two param groups (per-parameter meshes), and FSDP2 takes a custom "
            "reduce-scatter or all-gather only on a unit with one"
        )
    if comm is not None and comm.hpz and reshard_after_forward_policy == "never":
        raise ValueError(
            "comm=CommConfig(hpz=True) reshards every unit to its node; "
            "reshard_after_forward_policy='never' keeps full copies: pick one"
        )
    policy, kwargs = _shard_fixed_units(
        model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload,
        reshard_after_forward_policy, ep_degree, edp_mesh, dp_mesh_dims, edp_mesh_dims,
        auto_wrap_policy, comm,
    )  # fmt: skip
    shard_by_policy(model, auto_wrap_policy=policy, **kwargs)
    if enable_symm_mem:
        enable_fsdp_symm_mem(model)
    disable_fsdp_gradient_division(model)  # the trainer divides by the global token count
    if ep_degree > 1:
        _prefetch_in_order(model)
    return enable(model, comm) if comm is not None else None


def plan_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    ep_degree: int = 1,
    edp_mesh: DeviceMesh | None = None,
    dp_mesh_dims: Any = None,
    edp_mesh_dims: Any = None,
    enable_symm_mem: bool = False,
    *,
    auto_wrap_policy: object = None,
) -> WrapPlan:
    """The units :func:`apply_fsdp` would make with the same arguments, nothing sharded.

    Plans a copy of ``model`` on the meta device (cheap when ``model`` is on meta, as
    torchtitan builds it) with torchtitan's fixed units in place, so ``str(plan)`` lists
    them as well as the blocks' units the policy picks. Call it on every rank of
    ``dp_mesh`` (sharding the fixed units of the copy is local, but needs the mesh).
    """
    del enable_symm_mem  # no effect on the units
    meta = copy.deepcopy(model)
    if any(t.device.type != "meta" for t in meta.parameters()):
        meta = meta.to("meta")
    policy, kwargs = _shard_fixed_units(
        meta, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload,
        reshard_after_forward_policy, ep_degree, edp_mesh, dp_mesh_dims, edp_mesh_dims,
        auto_wrap_policy,
    )  # fmt: skip
    return check_wrap(
        meta,
        policy,
        mp_policy=kwargs["mp_policy"],
        reshard_after_forward=kwargs.get("reshard_after_forward"),
        world_size=dp_mesh.shape[-1],
    )


def _shard_fixed_units(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool,
    reshard_after_forward_policy: str,
    ep_degree: int,
    edp_mesh: DeviceMesh | None,
    dp_mesh_dims: Any,
    edp_mesh_dims: Any,
    auto_wrap_policy: object,
    comm: CommConfig | None = None,
) -> tuple[object, dict[str, Any]]:
    """Check the arguments, shard torchtitan's fixed units, and return the policy and the
    ``fully_shard`` kwargs for the rest."""
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.utils import get_spmd_backend

    _check_arguments(
        model, param_dtype, reduce_dtype, pp_enabled, reshard_after_forward_policy, ep_degree
    )
    if ep_degree > 1 and edp_mesh is None:
        raise ValueError(f"ep_degree={ep_degree} > 1 needs edp_mesh (the experts' FSDP mesh)")
    check_spmd_backend(get_spmd_backend())
    reshard_after_forward = get_fsdp_reshard_after_forward_policy(
        reshard_after_forward_policy, pp_enabled
    )
    if reshard_after_forward:  # hpZ: the node's ranks instead of the whole dp mesh
        reshard_after_forward = hpz_reshard_after_forward(comm, dp_mesh, reshard_after_forward)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    fsdp_config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if dp_mesh_dims is not None:
        fsdp_config["dp_mesh_dims"] = dp_mesh_dims
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()
    _shard_embedding_and_head(
        model, fsdp_config, reshard_after_forward_policy, reshard_after_forward
    )
    kwargs = dict(fsdp_config)
    if reshard_after_forward is not True:  # False, or hpZ's ranks per node
        kwargs["reshard_after_forward"] = reshard_after_forward
    # else None: FSDP2 reshards every unit but the root, as torchtitan's True and its
    # root call without the argument do
    placement = _expert_shard_placement_fn(model, dp_mesh, ep_degree, edp_mesh, edp_mesh_dims)
    if placement is not None:
        kwargs["shard_placement_fn"] = placement
    return (GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy), kwargs


def check_spmd_backend(spmd_backend: str) -> None:
    """Refuse a torchtitan ``spmd_backend`` FSDP2 cannot shard under, naming the one to use."""
    if spmd_backend == SUPPORTED_SPMD_BACKEND:
        return
    if spmd_backend not in SPMD_BACKENDS:
        raise ValueError(f"spmd_backend must be one of {SPMD_BACKENDS}, got {spmd_backend!r}")
    raise ValueError(
        f"torchtitan's parallelism.spmd_backend is {spmd_backend!r}"
        + (" (0.3.0's default)" if spmd_backend == "spmd_types" else "")
        + ": under it torchtitan hands FSDP its whole SPMD mesh with dp_mesh_dims, and "
        "fully_shard then wants every parameter as a DTensor on that mesh (it refuses the "
        "plain parameters of a data-parallel model, under torchtitan's own "
        "apply_fsdp_to_decoder too). fsdp-ext's drop-in shards under 'partial_dtensor': "
        "choose spmd_backend='partial_dtensor' "
        "(--parallelism.spmd_backend partial_dtensor)"
    )


def _check_arguments(
    model: nn.Module,
    param_dtype: object,
    reduce_dtype: object,
    pp_enabled: object,
    reshard_after_forward_policy: object,
    ep_degree: object,
) -> None:
    missing = [n for n in ("tok_embeddings", "layers", "norm", "lm_head") if not hasattr(model, n)]
    if not isinstance(model, nn.Module) or missing:
        raise TypeError(
            "model must be a torchtitan Decoder (tok_embeddings, layers, norm, lm_head); "
            f"{type(model).__name__} lacks {', '.join(missing) or 'nn.Module'}"
        )
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if not isinstance(value, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype, got {value!r}")
    if not isinstance(pp_enabled, bool):
        raise TypeError(f"pp_enabled must be a bool, got {pp_enabled!r}")
    if reshard_after_forward_policy not in RESHARD_AFTER_FORWARD_POLICIES:
        raise ValueError(
            f"reshard_after_forward_policy must be one of {RESHARD_AFTER_FORWARD_POLICIES}, "
            f"got {reshard_after_forward_policy!r}"
        )
    if isinstance(ep_degree, bool) or not isinstance(ep_degree, int) or ep_degree < 1:
        raise ValueError(f"ep_degree must be an int >= 1, got {ep_degree!r}")


def _shard_embedding_and_head(
    model: nn.Module,
    fsdp_config: dict[str, Any],
    policy_name: str,
    reshard_after_forward: bool | int,
) -> None:
    """torchtitan's fixed units: the embedding, and ``[norm, lm_head]`` kept unsharded after
    forward (FSDP would prefetch it right away for backward) unless ``"always"``."""
    keep_head = reshard_after_forward if policy_name == "always" else False
    if getattr(model, "enable_weight_tying", False):
        # tok_embeddings and lm_head share a weight: one unit, one all-gather
        modules = [m for m in (model.tok_embeddings, model.norm, model.lm_head) if m is not None]
        torch_fully_shard(modules, **fsdp_config, reshard_after_forward=keep_head)
        return
    if model.tok_embeddings is not None:
        torch_fully_shard(
            model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard_after_forward
        )
    if model.norm is not None and model.lm_head is not None:
        torch_fully_shard(
            [model.norm, model.lm_head], **fsdp_config, reshard_after_forward=keep_head
        )


def _expert_shard_placement_fn(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    ep_degree: int,
    edp_mesh: DeviceMesh | None,
    edp_mesh_dims: Any,
) -> Any:
    """torchtitan's expert placement, for whichever unit ends up holding each expert.

    ``Shard(1)`` when the experts' shard degree (efsdp x ep) exceeds their count, which
    would otherwise pad dim 0; with ``ep_degree > 1`` the experts live on ``edp_mesh``
    (a per-parameter mesh). None when every parameter takes FSDP's default.
    """
    placements: dict[nn.Parameter, Shard] = {}
    for block in model.layers.values():
        if not getattr(block, "moe_enabled", False):
            continue
        experts = block.moe.routed_experts.inner_experts
        degree = edp_mesh["efsdp"].size() * ep_degree if ep_degree > 1 else dp_mesh.size()
        placement = Shard(1) if degree > experts.num_experts else Shard(0)
        placements.update(dict.fromkeys(experts.parameters(), placement))
    if ep_degree == 1 and all(p == Shard(0) for p in placements.values()):
        return None
    if ep_degree == 1:
        return placements.get

    edp_mesh_info = fsdp_mesh_info(edp_mesh, edp_mesh_dims)

    def expert_placement(param: nn.Parameter) -> Any:
        if param in placements:
            return ShardPlacementResult(placement=placements[param], mesh_info=edp_mesh_info)
        return None  # Shard(0) on the unit's mesh, dp_mesh

    return expert_placement


def _prefetch_in_order(model: nn.Module) -> None:
    """Explicit prefetch, one unit ahead in forward and one behind in backward, as
    torchtitan sets under EP (its device-to-host syncs defeat FSDP's implicit prefetch):
    embedding, the blocks' units in order, then ``[norm, lm_head]``."""
    head = model.tok_embeddings
    tail = [model.norm, model.lm_head] if model.norm is not None and model.lm_head else []
    fixed = {id(m) for m in (head, *tail) if m is not None}
    body = [
        unit.modules[0]
        for unit in fsdp_units(model.layers)
        if not fixed.intersection(map(id, unit.modules))
    ]
    if not body:
        return
    if head is not None:
        head.set_modules_to_forward_prefetch([body[0]])
    for unit, following in zip(body, [*body[1:], None], strict=True):
        if following is not None:
            unit.set_modules_to_forward_prefetch([following])
        elif tail:
            unit.set_modules_to_forward_prefetch(tail)
    if tail:
        model.lm_head.set_modules_to_backward_prefetch([body[-1]])
    for unit, previous in zip(body[::-1], [*body[::-1][1:], None], strict=True):
        if previous is not None:
            unit.set_modules_to_backward_prefetch([previous])
        elif head is not None:
            unit.set_modules_to_backward_prefetch([head])


def with_comm_state(checkpointer: Any, handle: CommHandle, *, key: str = "loco") -> None:
    """Save and load ``handle``'s error buffers with torchtitan's ``CheckpointManager``.

    ``checkpointer.states`` goes to ``dcp.save`` / ``dcp.load`` whole; the handle's state
    is ``{"rank{r}": bytes}``, one key per rank, so each rank writes and reads its own
    part. Call it before ``checkpointer.load()`` (``Trainer.train`` loads first). A
    checkpoint written without LoCo has no such key: resume it with
    ``checkpoint.exclude_from_loading=["loco"]``.
    """
    if not isinstance(handle, CommHandle):
        raise TypeError(f"handle must be a CommHandle, got {type(handle).__name__}")
    if not isinstance(key, str) or not key or key in RESERVED_STATE_KEYS:
        raise ValueError(
            f"key must be a non-empty str other than {RESERVED_STATE_KEYS} "
            f"(CheckpointManager's and the Trainer's own), got {key!r}"
        )
    states = getattr(checkpointer, "states", None)
    if not isinstance(states, dict):
        raise TypeError(
            "checkpointer must be an enabled torchtitan CheckpointManager (with a states "
            f"dict); {type(checkpointer).__name__} has states={states!r}"
        )
    states[key] = handle
