"""``LoCoReduceScatter``: an FSDP2 ``ReduceScatter`` that sends 4-/8-bit LoCo-compensated chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.error_feedback import ErrorFeedback
from fsdp_ext.comm.hierarchical import NodeGroups, build_node_groups, node_local_reduce_scatter
from fsdp_ext.comm.quantized_exchange import quantized_reduce_scatter_into, round_up
from fsdp_ext.comm.stats import CommStats

ReduceOp = dist.ReduceOp


def reduce_op_scale(op: object, world_size: int) -> float:
    """The factor FSDP's ``op`` applies to the sum: AVG -> 1/W, SUM -> 1, PREMUL_SUM(f) -> f."""
    op_type = getattr(op, "op", op)  # a ReduceOp instance wraps its RedOpType
    if op_type == ReduceOp.PREMUL_SUM:
        # (op, factor): the one accessor torch 2.11 has (``op.factor`` came later).
        return float(op.__getstate__()[1])
    if op_type == ReduceOp.SUM:
        return 1.0
    if op_type == ReduceOp.AVG:
        return 1.0 / world_size
    raise ValueError(f"op must be ReduceOp.SUM, ReduceOp.AVG or ReduceOp.PREMUL_SUM, got {op!r}")


class LoCoReduceScatter(ReduceScatter):
    """Quantise each rank's compensated chunks, ``all_to_all`` them, dequantise-reduce.

    Install one instance per FSDP param group (``FSDPModule.set_custom_reduce_scatter``):
    it owns that unit's error buffer. Each rank's chunk is padded to a multiple of
    ``group_size`` internally, so a quantisation group never straddles two ranks.
    FSDP calls it only when the shard group has more than one rank.
    """

    def __init__(
        self,
        config: LoCoConfig | None = None,
        *,
        node_groups: NodeGroups | None = None,
        stats: CommStats | None = None,
    ):
        self.config = config if config is not None else LoCoConfig()
        self.stats = stats if stats is not None else CommStats()
        self.feedback = ErrorFeedback(self.config) if self.config.error_feedback else None
        self._node_groups = node_groups

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def error_numel(self, shard_numel: int, world_size: int) -> int:
        """Elements of the error buffer for a reduce-scatter of ``world_size * shard_numel``."""
        k = self.config.intra_node_size or 1
        return world_size // k * round_up(shard_numel, self.config.group_size)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        """Reduce ``input_tensor`` (``[W * shard]``, rank-major) into ``output_tensor``.

        Runs synchronously and returns None: FSDP orders it by stream, not by a ``Work``.
        """
        world_size = group.size()
        shard = output_tensor.numel()
        if input_tensor.numel() != world_size * shard:
            raise ValueError(
                f"input_tensor must hold world_size * output numel = {world_size * shard} "
                f"elements, got {input_tensor.numel()}"
            )
        out_scale = reduce_op_scale(op, world_size)
        self.config.check_group_size(world_size)
        k = self.config.intra_node_size or 1
        intra_bytes = 0
        if k > 1:
            groups = self._groups(group)
            chunks, intra_bytes = node_local_reduce_scatter(input_tensor, groups)
            exchange_group = groups.inter_node
        else:
            chunks = input_tensor.view(world_size, shard)
            exchange_group = group
        if chunks.shape[0] == 1:
            output_tensor.copy_((chunks[0].float() * out_scale).to(output_tensor.dtype))
            sent = 0
        else:
            # padding, quantisation and the write into output_tensor happen in the kernels
            sent = quantized_reduce_scatter_into(
                output_tensor,
                chunks,
                exchange_group,
                self.config,
                self.feedback,
                out_scale=out_scale,
            )
        self.stats.bytes_sent += sent
        self.stats.intra_node_bytes += intra_bytes
        self.stats.bytes_uncompressed += (world_size - 1) * shard * input_tensor.element_size()
        self.stats.reductions += 1
        return None

    def _groups(self, group: dist.ProcessGroup) -> NodeGroups:
        if self._node_groups is None:
            self._node_groups = build_node_groups(group, self.config.intra_node_size)
        return self._node_groups

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {} if self.feedback is None else {"reduce_scatter": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict(state["reduce_scatter"])
