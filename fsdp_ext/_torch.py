"""Every private PyTorch name fsdp-ext touches, in one place.

FSDP2 exposes its comm extension points (``ReduceScatter``, ``AllGather``), its per-unit
state and DeviceMesh flattening only under private names. Reading them here means a torch
upgrade touches this file alone. Each shim says which torch versions it covers; the suite
runs on 2.13 and 2.14, and 2.11 is the oldest supported release.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata

# 2.11-2.14: DCP's stock de-duplication of replicated items over the ranks' save plans.
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

# 2.11-2.14: sets a value in a nested state dict by its flattened path (how
# ``DefaultLoadPlanner.load_bytes`` puts a non-tensor item back).
from torch.distributed.checkpoint._traverse import set_element as set_state_dict_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

# 2.11-2.14: where ``.metadata`` records an item's bytes: (relative_path, offset, length).
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo

# 2.11-2.14: the write items DCP's default planner makes for one state-dict entry.
from torch.distributed.checkpoint.planner_helpers import _create_write_items as create_write_items
from torch.distributed.device_mesh import DeviceMesh

# 2.11-2.14: the comm interfaces a custom reduce-scatter / all-gather implements.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# 2.11-2.14: what ``shard_placement_fn`` may return to put a parameter on another mesh, and
# what a param group is doing (forward, backward, idle).
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult, TrainingState

# 2.11-2.14: builds the mesh info a ``ShardPlacementResult`` carries.
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info as fsdp_mesh_info

# 2.11-2.14: the per-unit state FSDP2 keeps (parameters, mixed precision, reshard setting).
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

# 2.11-2.14: the base class of FSDP1's policy objects (ModuleWrapPolicy, CustomPolicy).
from torch.distributed.fsdp.wrap import _Policy as FSDP1Policy
from torch.distributed.pipelining import PipelineStage

# 2.11-2.14: pytree mapping (no public equivalent).
from torch.utils._pytree import tree_map

try:  # 2.13-2.14: the stock reduce-scatter object, put back by ``CommHandle.remove()``
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # 2.11-2.12: no comm object is set by default
    DefaultReduceScatter = None

try:  # 2.13-2.14: the stock all-gather object, put back by ``WeightGatherHandle.remove()``
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
except ImportError:  # 2.11-2.12: no comm object is set by default
    DefaultAllGather = None

# 2.11-2.14: the dispatch-level mode the host-sync counter (fsdp_ext.testing) records
# data-dependent ops with (``_local_scalar_dense``, ``nonzero``, ...).
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "DCP_METADATA_PRIVATE_GLOBALS",
    "GROUP_TRANSITIONS_AFTER",
    "GROUP_TRANSITIONS_BEFORE",
    "AllGather",
    "DcpStorageInfo",
    "DedupHookSavePlanner",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDP1Policy",
    "FSDPParamGroup",
    "PipelineStageBase",
    "ReduceScatter",
    "ShardPlacementResult",
    "TorchDispatchMode",
    "all_gather_into",
    "auto_reshard_after_forward",
    "compiled_inner",
    "create_write_items",
    "dedup_save_plans",
    "flatten_mesh",
    "fsdp_mesh_info",
    "fsdp_state_id",
    "gathered_bytes",
    "gathering_for_backward",
    "group_reshard_after_forward",
    "has_all_gather_in_flight",
    "param_group",
    "param_groups",
    "reduce_scatter_into",
    "run_fsdp1_policy",
    "set_state_dict_element",
    "sharded_post_forward_data",
    "thread_in_dcp_save",
    "tree_map",
    "unflatten_mesh",
    "unsharded_param",
    "write_files",
]

# 2.13 renamed the tensor collectives (``*_single``); 2.11-2.12 have only the old names.
# Looked up at each call, so that a benchmark wrapping ``dist``'s collectives to count the
# bytes on the wire sees the library's calls too.


def reduce_scatter_into(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def all_gather_into(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


# FSDPParamGroup methods at which unsharded memory changes (2.11-2.14): a memory tracker
# samples before the first three (memory is freed inside) and after ``unshard``.
GROUP_TRANSITIONS_BEFORE = ("_to_sharded", "_to_sharded_post_forward", "post_backward")
GROUP_TRANSITIONS_AFTER = ("unshard",)


def fsdp_state_id(module: nn.Module) -> int:
    """Identity of a unit's FSDP state: modules sharded in one ``fully_shard([a, b])`` share it."""
    return id(module._get_fsdp_state())


def param_groups(module: nn.Module) -> list[FSDPParamGroup]:
    """Every param group of a unit (2.13-2.14 allow several, one per mesh; 2.11-2.12 one)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def param_group(module: nn.Module) -> FSDPParamGroup | None:
    """The unit's single param group (None when it manages no parameter)."""
    return module._get_fsdp_state()._fsdp_param_group


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
    """Whether the group's all-gather now is a backward one (its own or a prefetch), 2.11-2.14:
    FSDP sets ``PRE_BACKWARD`` before unsharding in backward, also on a prefetched group."""
    return group._training_state == TrainingState.PRE_BACKWARD


def has_all_gather_in_flight(group: FSDPParamGroup) -> bool:
    """Whether the group's all-gather was issued and its result not yet consumed."""
    return group._all_gather_result is not None


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A multi-dim mesh flattened to one named dim (2.11-2.14: ``DeviceMesh._flatten``)."""
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
    (``True`` or a dict of overrides; 2.11-2.14: ``_Policy._run_policy``)."""
    return policy._run_policy(root, set(), {})


def compiled_inner(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``module`` itself when it is not compiled
    (2.11-2.14: ``OptimizedModule._orig_mod``)."""
    return getattr(module, "_orig_mod", module)


class PipelineStageBase(PipelineStage):
    """``PipelineStage`` with a seam around its shape-inference backward.

    2.12-2.14 infer gradient shapes on the first step with an autograd pass over the stage
    (``_backward_metadata_inference``); a subclass wraps it in
    :meth:`metadata_inference_context`. 2.11 has no such pass, and the seam is never used.
    """

    def metadata_inference_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.metadata_inference_context():
            return super()._backward_metadata_inference(*args, **kwargs)


# 2.11-2.14: the function every ``dcp.save`` / ``dcp.async_save`` runs its save in.
_DCP_SAVE_FRAME = ("state_dict_saver.py", "_save_state_dict")


def thread_in_dcp_save(thread_ident: int) -> bool:
    """Whether the thread ``thread_ident`` of this process is inside a DCP save right now.

    DCP calls no storage-writer method after a save fails, so a checkpoint lock taken by a
    save that then failed is recognised by its thread having left ``_save_state_dict``.
    """
    frame = sys._current_frames().get(thread_ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name == _DCP_SAVE_FRAME[1] and code.co_filename.endswith(_DCP_SAVE_FRAME[0]):
            return True
        frame = frame.f_back
    return False


# 2.11-2.14: globals DCP's ``.metadata`` pickles under private names: the memory-format enum
# inside ``TensorProperties``, ``_StorageInfo``, and the lookup ``torch.layout`` objects
# pickle through. The restricted unpickler allows exactly these.
DCP_METADATA_PRIVATE_GLOBALS: dict[tuple[str, str], object] = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): (
        dcp_metadata._MEM_FORMAT_ENCODING
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


class DedupHookSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose deduplication of the ranks' plans is a public hook.

    2.11-2.14: the global step calls ``_dedup_save_plans(all_plans)``; subclasses override
    :meth:`dedup_plans` instead.
    """

    def dedup_plans(self, all_plans: list) -> list:
        return dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)

    def _dedup_save_plans(self, all_plans: list) -> list:
        return self.dedup_plans(all_plans)


def write_files(writer: FileSystemWriter, planner: Any, file_queue: Any) -> Any:
    """Run the stock write loop of ``writer`` over ``file_queue`` (``(path, file name,
    items)`` tuples), with its ``thread_count`` threads; a future of the write results.

    2.11-2.14: ``FileSystemWriter._write_data(planner, file_queue)``.
    """
    return writer._write_data(planner, file_queue)
