"""Every private PyTorch name fsdp-ext touches, in one place.

FSDP2 exposes its comm extension points (``ReduceScatter``, ``AllGather``), its per-unit
state and DeviceMesh flattening only under private names. Reading them here means a torch
upgrade touches this file alone. Each shim says which torch versions it covers; the suite
runs on 2.11 (the oldest supported release), 2.13, 2.14 and 2.15.

FSDP2's per-unit objects (``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``) are internal too,
even where their attributes look public (``group.fsdp_params``, ``group.mp_policy``): the
library reads them only through the small accessors below, and
``scripts/import_graph.py --check`` flags such a read anywhere else.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import metadata as sharded_tensor_metadata
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE as CHECKPOINT_WRAPPED_MODULE,
)
from torch.distributed.checkpoint import metadata as dcp_metadata

# 2.11-2.15: DCP's stock de-duplication of replicated items over the ranks' save plans.
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

# 2.11-2.15: sets a value in a nested state dict by its flattened path (how
# ``DefaultLoadPlanner.load_bytes`` puts a non-tensor item back).
from torch.distributed.checkpoint._traverse import set_element as set_state_dict_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

# 2.11-2.15: where ``.metadata`` records an item's bytes: (relative_path, offset, length).
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo

# 2.11-2.15: the write items DCP's default planner makes for one state-dict entry.
from torch.distributed.checkpoint.planner_helpers import _create_write_items as create_write_items

# 2.11-2.15: the canonical name DCP's state-dict helpers key a parameter by (wrapper parts
# ``_checkpoint_wrapped_module`` and ``_orig_mod`` dropped).
from torch.distributed.checkpoint.state_dict import _get_fqns as dcp_fqns
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

# 2.11-2.15: the comm interfaces a custom reduce-scatter / all-gather implements.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# 2.11-2.15: what a param group is doing (forward, backward, idle); the mesh info of an
# int reshard's post-forward (replicate, shard) mesh.
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, TrainingState

# 2.11-2.15: builds the mesh info a ``ShardPlacementResult`` carries.
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info as fsdp_mesh_info

# 2.11-2.15: the per-unit state FSDP2 keeps (parameters, mixed precision, reshard setting).
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

# 2.11-2.15: the base class of FSDP1's policy objects (ModuleWrapPolicy, CustomPolicy).
from torch.distributed.fsdp.wrap import _Policy as FSDP1Policy

# 2.11-2.15: pytree mapping (no public equivalent).
from torch.utils._pytree import tree_map

try:  # 2.13-2.15: what ``shard_placement_fn`` may return to put a parameter on another mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # 2.11: ``shard_placement_fn`` returns a ``Shard`` only, on the unit's mesh

    class ShardPlacementResult:  # type: ignore[no-redef]
        """Stands in for the name on torch 2.11, which has no per-parameter meshes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(
                f"a parameter on its own mesh (ShardPlacementResult) needs torch >= 2.13; "
                f"this is torch {torch.__version__}: shard experts with their own fully_shard "
                "call on their mesh instead"
            )


try:  # 2.11-2.15: the stock reduce-scatter object, put back by ``CommHandle.remove()``
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # older releases: no comm object is set by default
    DefaultReduceScatter = None

try:  # 2.11-2.15: the stock all-gather object, put back by ``WeightGatherHandle.remove()``
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
except ImportError:  # older releases: no comm object is set by default
    DefaultAllGather = None

# 2.11-2.14: the dispatch-level mode the host-sync counter (fsdp_ext.testing) records
# data-dependent ops with (``_local_scalar_dense``, ``nonzero``, ...).
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

# The installed release, (major, minor): what a shim for one release range looks at.
RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

__all__ = [
    "DCP_LOAD_DROPS_METADATA_ERRORS",
    "DCP_METADATA_LEGACY_GLOBALS",
    "DCP_METADATA_PRIVATE_GLOBALS",
    "GROUP_TRANSITIONS_AFTER",
    "GROUP_TRANSITIONS_BEFORE",
    "RELEASE",
    "AllGather",
    "DcpStorageInfo",
    "DedupHookSavePlanner",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDP1Policy",
    "FSDPParamGroup",
    "FSDPUnit",
    "MetadataInferenceSeam",
    "ReduceScatter",
    "ShardPlacementResult",
    "TorchDispatchMode",
    "all_gather_into",
    "auto_reshard_after_forward",
    "canonical_fqn",
    "compiled_inner",
    "create_write_items",
    "dedup_save_plans",
    "default_fsdp_mesh_on_cuda",
    "dtensor_local_tensor",
    "flatten_mesh",
    "forward_prefetch_targets",
    "fsdp_mesh_info",
    "fsdp_params",
    "fsdp_state_id",
    "fsdp_units",
    "fsspec_writer_and_reader",
    "gather_dtype",
    "gathered_bytes",
    "gathering_for_backward",
    "group_device",
    "group_modules",
    "group_reshard_after_forward",
    "group_unshard_async_op",
    "has_all_gather_in_flight",
    "is_hsdp_group",
    "is_sharded_post_forward",
    "is_unsharded",
    "log_metadata_error_dcp_load_drops",
    "optimizer_runs_step_hooks",
    "padded_shard_numel",
    "param_group",
    "param_groups",
    "param_mp_policy",
    "reduce_scatter_into",
    "run_fsdp1_policy",
    "set_group_unshard_async_op",
    "set_state_dict_element",
    "shard_process_group",
    "sharded_param",
    "sharded_post_forward_data",
    "storage_alignment",
    "stored_tensor_layout",
    "trainable_fsdp_params",
    "tree_map",
    "unflatten_mesh",
    "unsharded_accumulated_grad",
    "unsharded_param",
    "write_files",
    "write_tensor_archive",
]


def fsspec_writer_and_reader() -> tuple[type, type]:
    """Stock DCP's ``FsspecWriter`` and ``FsspecReader`` (2.11-2.15: only in the private
    ``_fsspec_filesystem``; ``torch.distributed.checkpoint`` does not re-export them), the
    baseline of the S3 benchmark. Imported on call: the module imports fsspec."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


# 2.13 renamed the tensor collectives (``*_single``); 2.11-2.12 have only the old names.
# Looked up at each call, so that a benchmark wrapping ``dist``'s collectives to count the
# bytes on the wire sees the library's calls too.


def reduce_scatter_into(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def all_gather_into(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def canonical_fqn(model: nn.Module, name: str) -> str:
    """The name ``get_model_state_dict`` gives ``name`` (a parameter or module of
    ``model``): without the ``_checkpoint_wrapped_module`` of ``checkpoint_wrapper`` or the
    ``_orig_mod`` of ``torch.compile``, so that state keyed by it survives adding or
    removing either wrapper (2.11-2.15 ``_get_fqns``; it keeps a trailing wrapper part of
    a module's own name, dropped here first)."""
    head, _, last = name.rpartition(".")
    if last in (CHECKPOINT_WRAPPED_MODULE, "_orig_mod"):
        return canonical_fqn(model, head)
    if not name:
        return name
    (fqn,) = dcp_fqns(model, name)
    return fqn


# FSDPParamGroup methods at which unsharded memory changes (2.11-2.15): a memory tracker
# samples before the first three (memory is freed inside) and after ``unshard``.
GROUP_TRANSITIONS_BEFORE = ("_to_sharded", "_to_sharded_post_forward", "post_backward")
GROUP_TRANSITIONS_AFTER = ("unshard",)


def fsdp_state_id(module: nn.Module) -> int:
    """Identity of a unit's FSDP state: modules sharded in one ``fully_shard([a, b])`` share it."""
    return id(module._get_fsdp_state())


def param_groups(module: nn.Module) -> list[FSDPParamGroup]:
    """Every param group of a unit (2.13-2.15 allow several, one per mesh; 2.11-2.12 one)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def param_group(module: nn.Module) -> FSDPParamGroup | None:
    """The unit's single param group (None when it manages no parameter)."""
    return module._get_fsdp_state()._fsdp_param_group


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP state (one ``fully_shard`` call): its modules and their names in pre-order
    (the root's name is ``""``), and its param groups (none when it manages no parameter)."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    groups: tuple[FSDPParamGroup, ...]

    @property
    def fqn(self) -> str:
        """The name of its first module."""
        return self.names[0]

    @property
    def module(self) -> nn.Module:
        """Its first module (any of them reaches the same state)."""
        return self.modules[0]


def fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """Every FSDP unit at and below ``model``, each once, in the order FSDP's root keeps its
    states (``named_modules()`` pre-order, a unit placed at its first module): the one walk
    every part of fsdp_ext makes over units."""
    found: dict[int, tuple[list[str], list[nn.Module], nn.Module]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        names, modules, _ = found.setdefault(fsdp_state_id(module), ([], [], module))
        names.append(fqn)
        modules.append(module)
    return [
        FSDPUnit(tuple(names), tuple(modules), tuple(param_groups(first)))
        for names, modules, first in found.values()
    ]


# ---- FSDPParamGroup / FSDPParam reads: attributes that look public but are FSDP internals.


def fsdp_params(group: FSDPParamGroup) -> list[Any]:
    """The group's ``FSDPParam`` objects, in FSDP's parameter order (2.11-2.15)."""
    return list(group.fsdp_params)


def sharded_param(fsdp_param: Any) -> nn.Parameter:
    """The sharded parameter (a DTensor) the module holds between steps (2.11-2.15)."""
    return fsdp_param.sharded_param


def trainable_fsdp_params(group: FSDPParamGroup) -> list[Any]:
    """The group's parameters FSDP reduces gradients for (it skips frozen ones)."""
    return [p for p in group.fsdp_params if p.sharded_param.requires_grad]


def padded_shard_numel(fsdp_param: Any) -> int:
    """Elements of the parameter's shard padded on dim 0, as it sits in FSDP's flat
    all-gather input and reduce-scatter output (2.11-2.15)."""
    return fsdp_param.padded_sharded_param_size.numel()


def param_mp_policy(group: FSDPParamGroup, fsdp_param: Any) -> Any:
    """The ``MixedPrecisionPolicy`` FSDP applies to one parameter of ``group``.

    2.15 resolves the policy per parameter (``FSDPParam.mp_policy``; the group keeps none);
    2.11-2.14 keep one per group (``FSDPParamGroup.mp_policy``).
    """
    policy = getattr(fsdp_param, "mp_policy", None)
    return policy if policy is not None else group.mp_policy


def gather_dtype(group: FSDPParamGroup, fsdp_param: Any) -> torch.dtype:
    """The dtype FSDP gathers the parameter in: set at FSDP's lazy init (2.11-2.15
    ``FSDPParam.param_dtype``), before it the parameter's mixed-precision policy, else its
    own dtype. A non-float parameter keeps its dtype (FSDP casts only float ones)."""
    own = fsdp_param.sharded_param.dtype
    if not own.is_floating_point:
        return own
    return (
        getattr(fsdp_param, "param_dtype", None)
        or param_mp_policy(group, fsdp_param).param_dtype
        or own
    )


def unsharded_accumulated_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient FSDP accumulates apart from the parameter's ``.grad`` (no-sync
    steps in a reduce dtype), or None where there is none besides ``.grad``.

    2.11-2.14: an attribute holding its own buffer. 2.15: a property that returns the
    unsharded parameter's ``.grad`` (the autograd leaf accumulates), the same tensor a
    memory count already has: counting it again would double every unsharded gradient.
    """
    if isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property):
        return None
    return fsdp_param.unsharded_accumulated_grad


def group_device(group: FSDPParamGroup) -> torch.device:
    """The device the group gathers and reduces on (2.11-2.15)."""
    return group.device


def group_modules(group: FSDPParamGroup) -> tuple[nn.Module, ...]:
    """The modules one ``fully_shard`` call put in this group (2.11-2.15)."""
    return tuple(group.modules)


def shard_process_group(group: FSDPParamGroup) -> dist.ProcessGroup | None:
    """The group's reduce-scatter / all-gather process group; None for a replicate-only
    (DDP-style) unit, which has no shard dim (2.11-2.15: ``mesh_info.shard_process_group``)."""
    return getattr(group.mesh_info, "shard_process_group", None)


def is_hsdp_group(group: FSDPParamGroup) -> bool:
    """Whether the group is sharded on a 2-D (replicate, shard) mesh (2.11-2.15)."""
    return getattr(group.mesh_info, "replicate_mesh_dim", None) is not None


def reduce_output_only_viewed(group: FSDPParamGroup, dtype: torch.dtype) -> bool:
    """Whether FSDP2, once this unit's reduce-scatter comm returns, only takes views of the
    output as the sharded gradients and reads none of it until the optimizer does (2.11-2.15,
    ``foreach_reduce``): no all-reduce after it (HSDP or an all-reduce hook), no post-divide
    (fp16 reduces), no cast (every sharded parameter and gradient in ``dtype``), no
    accumulation into an existing gradient, no CPU offload, no post-accumulate-grad hook."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if group._all_reduce_hook is not None or is_hsdp_group(group):
        return False
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.sharded_param
        if not param.requires_grad:
            continue
        grad_dtype = getattr(fsdp_param, "sharded_grad_dtype", None)  # 2.15
        if param.dtype != dtype or grad_dtype not in (None, dtype):
            return False
        if param.grad is not None or fsdp_param.offload_to_cpu:
            return False
        if getattr(param, "_post_accumulate_grad_hooks", None):
            return False
    return True


def backward_task_id() -> int:
    """The id of the autograd backward running on this thread, -1 outside one (2.11-2.15)."""
    return int(torch._C._current_graph_task_id())


def queue_backward_callback(callback: Any) -> None:
    """Run ``callback`` once the running backward has finished its graph (2.11-2.15; after
    FSDP2's own final callback, which its root queues when its backward begins)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def is_unsharded(group: FSDPParamGroup) -> bool:
    """Whether the group's parameters are gathered now (2.11-2.15)."""
    return bool(group.is_unsharded)


def is_sharded_post_forward(group: FSDPParamGroup) -> bool:
    """Whether the group holds its node-local post-forward shards now (2.11-2.15)."""
    return bool(group.is_sharded_post_forward)


def auto_reshard_after_forward(module: nn.Module) -> bool:
    """Whether ``fully_shard`` got ``reshard_after_forward=None`` (root stays gathered)."""
    return bool(module._get_fsdp_state()._auto_reshard_after_forward)


def group_reshard_after_forward(group: FSDPParamGroup | None) -> bool | int:
    """The ``reshard_after_forward`` a unit was sharded with: False, True or the int size."""
    if group is None or not group._reshard_after_forward:
        return False
    if group._use_post_forward_mesh:
        return group.post_forward_mesh_info.shard_mesh_size
    return True


def gathered_bytes(fsdp_param: Any, dtype: Any = None) -> int:
    """Bytes one parameter takes when gathered: its local (post-EP/TP) original size in
    ``dtype`` (default: the dtype FSDP gathers it in, or its own before lazy init)."""
    dtype = dtype or getattr(fsdp_param, "param_dtype", None) or fsdp_param.orig_dtype
    return fsdp_param._orig_size.numel() * dtype.itemsize


def unsharded_param(fsdp_param: Any) -> nn.Parameter | None:
    """The unsharded parameter FSDP creates at its first all-gather, or None before it."""
    return getattr(fsdp_param, "_unsharded_param", None)


def sharded_post_forward_data(fsdp_param: Any) -> Any:
    """The node-local shard kept between forward and backward under an int reshard."""
    return fsdp_param._sharded_post_forward_param_data


def gathering_for_backward(group: FSDPParamGroup) -> bool:
    """Whether the group's all-gather now is a backward one (its own or a prefetch), 2.11-2.15:
    FSDP sets ``PRE_BACKWARD`` before unsharding in backward, also on a prefetched group."""
    return group._training_state == TrainingState.PRE_BACKWARD


def group_unshard_async_op(group: FSDPParamGroup) -> bool:
    """Whether FSDP calls the group's all-gather comm with ``async_op=True``, 2.11-2.15."""
    return bool(group.unshard_async_op)


def set_group_unshard_async_op(group: FSDPParamGroup, async_op: bool) -> None:
    """Make FSDP call this group's all-gather comm with ``async_op`` (2.11-2.15: the
    attribute ``FSDPModule._set_unshard_async_op`` sets on every group below a module; set
    here on one group only). Pre-forward, pre-backward and every prefetch (forward explicit,
    backward implicit or explicit) pass it; copy-out then calls ``wait()`` on the returned
    ``Work``, in the unit's own pre-forward or pre-backward."""
    group.unshard_async_op = bool(async_op)


def forward_prefetch_targets(module: FSDPModule) -> list[nn.Module]:
    """The modules ``module`` prefetches in forward (``set_modules_to_forward_prefetch``),
    2.11-2.15: read from its FSDP state's list of target states."""
    targets = module._get_fsdp_state()._states_to_forward_prefetch
    found = []
    for state in targets:
        modules = getattr(state, "_modules", ())
        found.extend(modules[:1])
    return found


def has_all_gather_in_flight(group: FSDPParamGroup) -> bool:
    """Whether the group's all-gather was issued and its result not yet consumed."""
    return group._all_gather_result is not None


def finalize_each_backward(root: FSDPModule) -> None:
    """Make the next backward of ``root`` finish FSDP's work itself (reduce, reshard).

    2.15's ``PipelineStage`` turns on manual backward finalization in every forward and
    finalizes once in ``perform_reduce_grad``; a root whose inputs need no gradient (the
    embeddings) then keeps its reduction pending. 2.11-2.14 have no manual mode: each
    backward always finalized itself.
    """
    if hasattr(root, "set_manual_backward_finalization"):
        root.set_manual_backward_finalization(False)


@contextlib.contextmanager
def post_forward_meshes_built_together(dp_mesh: DeviceMesh, size: int) -> Iterator[None]:
    """Inside, ``fully_shard(..., reshard_after_forward=size)`` on ``dp_mesh`` uses one
    post-forward mesh that every rank of the world built in one call.

    FSDP2 (2.11-2.15) builds a new ``DeviceMesh`` for each unit with an int reshard (in
    ``_get_post_forward_mesh_info``, which ``_fully_shard`` imports by name): new process
    groups, each a rendezvous of the whole world. Under PP each stage shards its own units
    on its own dp ranks; stages with different numbers of units then make different numbers
    of those calls, and the job hangs. Here all ranks first build every stage's
    (replicate, shard) grid in one ``DeviceMesh`` (collective: call this on every rank),
    and each unit takes its own stage's slice.
    """
    ranks = dp_mesh.mesh.flatten().tolist()
    if not 1 < size < len(ranks) or len(ranks) % size:  # FSDP makes no mesh (or refuses)
        yield
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    groups = list(dict.fromkeys(tuple(r) for r in everyone))  # each stage's dp ranks, once
    grid = torch.tensor(groups).view(len(groups), -1, size)
    mesh = DeviceMesh(dp_mesh.device_type, grid, mesh_dim_names=("dp_groups", "rep", "shard"))
    ours = HSDPMeshInfo(mesh["rep", "shard"], shard_mesh_dim=1, replicate_mesh_dim=0)
    modules = [
        importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")
        for name in ("_fsdp_init", "_fully_shard")
    ]
    original = modules[0]._get_post_forward_mesh_info

    def shared(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        if (
            reshard_after_forward == size
            and not isinstance(reshard_after_forward, bool)
            and mesh_info.mesh.mesh.flatten().tolist() == ranks
        ):
            return ours
        return original(reshard_after_forward, mesh_info)

    for module in modules:
        module._get_post_forward_mesh_info = shared
    try:
        yield
    finally:
        for module in modules:
            module._get_post_forward_mesh_info = original


@contextlib.contextmanager
def default_fsdp_mesh_on_cuda() -> Iterator[None]:
    """Make ``fully_shard`` without a mesh build its default mesh on CUDA, as it does on a
    GPU machine, even in a gloo rank.

    Tests use it to show on a CPU machine what a GPU machine changes: 2.11-2.15 pick the
    default mesh's device with ``torch._C._get_accelerator()`` in ``_init_default_mesh``
    (which ``_fully_shard`` imports by name). Building that mesh then fails here (no CUDA)
    as it fails there on a second rank ("invalid device ordinal" with one GPU). Nothing
    else changes: torch's other CUDA checks (DCP's streams, ...) work on a real GPU.
    """
    modules = [
        importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")
        for name in ("_fsdp_init", "_fully_shard")
    ]
    originals = [m._init_default_mesh for m in modules]

    def on_cuda(*args: Any, **kwargs: Any) -> DeviceMesh:
        saved = torch._C._get_accelerator
        torch._C._get_accelerator = lambda: torch.device("cuda")
        try:
            return originals[0](*args, **kwargs)
        finally:
            torch._C._get_accelerator = saved

    for module in modules:
        module._init_default_mesh = on_cuda
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module._init_default_mesh = original


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A multi-dim mesh flattened to one named dim (2.11-2.15: ``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def unflatten_mesh(
    mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh | None:
    """A 1-D mesh split into named dims, or None where torch lacks ``_unflatten`` (2.11)."""
    if not hasattr(DeviceMesh, "_unflatten"):
        return None
    return mesh._unflatten(0, sizes, names)


def run_fsdp1_policy(policy: FSDP1Policy, root: nn.Module) -> dict[nn.Module, Any]:
    """The modules an FSDP1 policy object wraps below and at ``root``, each with its kwargs
    (``True`` or a dict of overrides; 2.11-2.15: ``_Policy._run_policy``)."""
    return policy._run_policy(root, set(), {})


def compiled_inner(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``module`` itself when it is not compiled
    (2.11-2.15: ``OptimizedModule._orig_mod``)."""
    return getattr(module, "_orig_mod", module)


class MetadataInferenceSeam:
    """A mixin for ``PipelineStage``: a seam around its shape-inference backward.

    2.12-2.15 infer gradient shapes on the first step with an autograd pass over the stage
    (``_backward_metadata_inference``); a subclass wraps it in
    :meth:`metadata_inference_context`. 2.11 has no such pass, and the seam is never used.
    A mixin rather than a subclass, so that importing this module does not import
    ``torch.distributed.pipelining`` (and with it ``torch._dynamo``, about 1 s of CPU in
    every process): only a pipelined job pays for it.
    """

    def metadata_inference_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.metadata_inference_context():
            return super()._backward_metadata_inference(*args, **kwargs)


# 2.11: ``dcp.load`` reads ``.metadata`` under ``except Exception``, logs one INFO line without
# the error and fails with a bare "metadata is None": the storage reader's error is lost.
# 2.13-2.15 keep it ("metadata is None; global metadata read failed: <error>"). 2.12 is not
# checked and counted with 2.11 (the cost: the error logged once more).
DCP_LOAD_DROPS_METADATA_ERRORS = RELEASE < (2, 13)


def log_metadata_error_dcp_load_drops(exc: Exception) -> None:
    """Log a storage reader's ``.metadata`` error where ``dcp.load`` drops it (2.11), worded
    as 2.13-2.15's own message, so that the cause is not lost; the caller re-raises it."""
    if DCP_LOAD_DROPS_METADATA_ERRORS:
        logger.error("metadata is None; global metadata read failed: %s", exc)


# 2.11-2.15: globals DCP's ``.metadata`` pickles under private names: the memory-format enum
# inside ``TensorProperties``, ``_StorageInfo``, and the lookup ``torch.layout`` objects
# pickle through. The restricted unpickler allows exactly these.
DCP_METADATA_PRIVATE_GLOBALS: dict[tuple[str, str], object] = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): (
        dcp_metadata._MEM_FORMAT_ENCODING
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}

# 2.11-2.14 still define them: DCP metadata pickled by torch releases before 2.4 names its
# tensor properties (and their memory-format enum) from the sharded-tensor module; stock
# DCP loads such checkpoints (``test_compatibility.py::test_sharded_tensor_dependency``).
DCP_METADATA_LEGACY_GLOBALS: dict[tuple[str, str], object] = {
    (sharded_tensor_metadata.__name__, name): getattr(sharded_tensor_metadata, name)
    for name in ("TensorProperties", "MEM_FORMAT_ENCODING")
}


class DedupHookSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose deduplication of the ranks' plans is a public hook.

    2.11-2.15: the global step calls ``_dedup_save_plans(all_plans)``; subclasses override
    :meth:`dedup_plans` instead.
    """

    def dedup_plans(self, all_plans: list) -> list:
        return dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)

    def _dedup_save_plans(self, all_plans: list) -> list:
        return self.dedup_plans(all_plans)


def write_files(writer: FileSystemWriter, planner: Any, file_queue: Any) -> Any:
    """Run the stock write loop of ``writer`` over ``file_queue`` (``(path, file name,
    items)`` tuples), with its ``thread_count`` threads; a future of the write results.

    2.11-2.15: ``FileSystemWriter._write_data(planner, file_queue)``.
    """
    return writer._write_data(planner, file_queue)


def storage_alignment() -> int:
    """The byte alignment ``torch.save`` gives a storage's bytes in its archive (a setting).

    2.11-2.15: ``torch.serialization._get_storage_alignment()``.
    """
    from torch import serialization

    return serialization._get_storage_alignment()


def write_tensor_archive(tensor: torch.Tensor, stream: Any) -> bool:
    """Write ``torch.save(tensor, stream)``'s archive without the zip records' CRC-32; True
    when it is without (its records then depend on the tensor's layout alone), False where
    it fell back to ``torch.save``.

    ``torch.load`` never checks that CRC (a flipped byte loads silently), and the checkpoint
    manifest already hashes every byte the stream sees, so computing it is a second full
    pass over the data for nothing: on a loaded 2-core machine it was about half of a
    background write's CPU time. The archive is otherwise byte for byte ``torch.save``'s
    (the zip's CRC fields hold 0), and any ``torch.load`` reads it.

    2.11-2.15: ``torch._C.PyTorchFileWriter(buffer, compute_crc32, alignment)`` and
    ``torch.serialization._save`` (what ``torch.save`` runs); falls back to ``torch.save``
    where either is missing.
    """
    import pickle

    from torch import serialization

    try:
        archive = torch._C.PyTorchFileWriter(stream, False, storage_alignment())
        save = serialization._save
    except (AttributeError, TypeError):
        torch.save(tensor, stream)
        return False
    save(tensor, archive, pickle, serialization.DEFAULT_PROTOCOL, False)
    archive.write_end_of_file()
    stream.flush()
    return True


def stored_tensor_layout(stream: Any) -> tuple[torch.Tensor, int, str | None]:
    """A ``torch.save`` archive's tensor on the meta device (dtype, shape, strides; no bytes
    read), where its storage's bytes start in the archive, and the byte order they were
    written in (None when the archive does not say).

    2.11-2.15: ``torch.load(map_location="meta")`` records that offset in the private
    ``UntypedStorage._checkpoint_offset``; the archive's records are read with the private
    ``torch._C.PyTorchFileReader`` (``zipfile`` would read the archive's last 64 KiB whole).
    It lets the checkpoint reader copy the bytes straight into their destination instead of
    loading a second copy of the tensor.
    """
    start = stream.tell()
    tensor = torch.load(stream, map_location="meta", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"the archive holds a {type(tensor).__name__}, not a tensor")
    stream.seek(start)
    archive = torch._C.PyTorchFileReader(stream)
    order = archive.get_record("byteorder").decode() if archive.has_record("byteorder") else None
    return tensor, int(tensor.untyped_storage()._checkpoint_offset), order


# 2.11-2.15: the local shard a DTensor holds, read as the attribute ``to_local()`` returns
# through an autograd function (about 40 us a call: staging reads hundreds of them per save).
def dtensor_local_tensor(tensor: Any) -> torch.Tensor:
    return tensor._local_tensor


# 2.11-2.15: ``Optimizer.__init__`` wraps its class's ``step`` once (``_patch_step_function``,
# marked ``hooked``) so that the hooks of ``register_step_pre_hook`` run; a wrapper that never
# calls it (accelerate's ``AcceleratedOptimizer``) would take the hook and never run it.
def optimizer_runs_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(type(optimizer).step, "hooked", False)) and hasattr(
        optimizer, "_optimizer_step_pre_hooks"
    )
