"""``LoCoReduceScatter``: an FSDP2 ``ReduceScatter`` that sends a gradient codec's payloads
(LoCo-compensated 4-/8-bit chunks by default)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import ReduceScatter, backward_task_id, reduce_output_only_viewed
from fsdp_ext.comm.absmax_codec import LoCoConfig
from fsdp_ext.comm.codec import Codec, WireChoice, choose_wire
from fsdp_ext.comm.deferred import DEFERRED
from fsdp_ext.comm.error_feedback import ErrorFeedback, ErrorSubset
from fsdp_ext.comm.hierarchical import (
    NodeGroups,
    all_shard_groups,
    build_node_groups,
    node_local_reduce_scatter,
)
from fsdp_ext.comm.layout import ParamLayout
from fsdp_ext.comm.quantized_exchange import (
    plain_reduce_scatter_into,
    quantized_reduce_scatter_into,
)
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.comm.unit import UnitBinding, reduce_dtype_of
from fsdp_ext.node_size import resolve_node_size

ReduceOp = dist.ReduceOp
WIRE_DTYPES = {torch.float16: torch.float32}  # reduce dtype -> what the rows travel in


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

    One instance serves one FSDP unit (:meth:`install`, or :func:`fsdp_ext.comm.enable`): it keeps
    the error of each of the unit's trainable parameters, and maps every reduction's columns to
    them, so a parameter left out of a reduction (no gradient) neither receives nor corrupts
    anyone's error. Each rank's chunk is padded to whole codec groups, so a quantisation group
    never straddles two ranks. The wire format is ``codec``'s (built from ``config``, a codec's
    options, when not given), except for a unit whose payload would not be smaller than its
    values (:attr:`wire`): those go as they are. FSDP calls it only when the shard group has
    more than one rank. fp16 gradients are computed in fp32. ``node_size`` (ranks per node, or
    ``"auto"``): hierarchical mode, full precision inside each node and the codec across nodes.
    ``overlap`` (the default): in a backward, where FSDP only views the output
    (:func:`fsdp_ext._torch.reduce_output_only_viewed`), the encoded exchange is started and
    its decode deferred to the next unit's exchange or the backward's end
    (:mod:`fsdp_ext.comm.deferred`), so the transfer runs behind the backward compute of the
    unit before. The bits are the same either way.
    """

    def __init__(
        self,
        config: object | None = None,
        *,
        codec: Codec | None = None,
        node_size: int | str | None = None,
        node_groups: NodeGroups | None = None,
        stats: CommStats | None = None,
        overlap: bool = True,
    ):
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        self.config = config if config is not None or codec is not None else LoCoConfig()
        self.stats = stats if stats is not None else CommStats()
        self.codec: Codec = codec if codec is not None else make_codec(self.config)
        self.feedback = None
        if self.codec.keeps_feedback:
            self.feedback = ErrorFeedback(self.codec)
        self.node_size = node_size
        self._node_groups = node_groups
        self.unit: UnitBinding | None = None
        self._anonymous: ParamLayout | None = None
        self._wire_cache: dict[tuple[int, torch.dtype], WireChoice] = {}

    def wire_for(self, shard: int, dtype: torch.dtype) -> WireChoice:
        """Encoded or plain for rows of ``shard`` elements in ``dtype`` (sizes only, so every
        rank of the group chooses alike)."""
        key = (shard, dtype)
        if key not in self._wire_cache:
            size = torch.empty((), dtype=dtype).element_size()
            self._wire_cache[key] = choose_wire(self.codec, [shard], size)
        return self._wire_cache[key]

    @property
    def wire(self) -> WireChoice:
        """The bound unit's choice when all its parameters have gradients (in its reduce
        dtype; fp16 travels as fp32)."""
        if self.unit is None:
            raise ValueError("this LoCoReduceScatter serves no unit yet: bind or install it")
        dtype = reduce_dtype_of(self.unit.group)
        return self.wire_for(self.unit.layout.width, WIRE_DTYPES.get(dtype, dtype))

    def bind(self, unit: UnitBinding) -> None:
        """Serve ``unit`` (and only it): its parameter layout keys the error buffer."""
        if self.unit is not None and self.unit.group is not unit.group:
            raise ValueError(
                f"this LoCoReduceScatter already serves unit {self.unit.fqn or '<root>'}; "
                f"it cannot also serve {unit.fqn or '<root>'}: its error buffer belongs to one "
                "unit's parameters, so give every unit its own comm (fsdp_ext.comm.enable does)"
            )
        self.unit = unit

    def install(self, module: FSDPModule) -> LoCoReduceScatter:
        """Bind to ``module``'s FSDP unit and make it the unit's reduce-scatter."""
        self.bind(UnitBinding.for_module(module))
        module.set_custom_reduce_scatter(self)
        return self

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def rows(self, world_size: int) -> int:
        """Rows of the quantised exchange: destinations, or nodes in hierarchical mode."""
        groups = self._node_groups
        return groups.num_nodes if groups is not None else world_size

    def layout(self, shard: int) -> ParamLayout:
        if self.unit is not None:
            return self.unit.layout
        if self._anonymous is None:
            self._anonymous = ParamLayout(["<input>"], [shard])
        return self._anonymous

    def _feedback_for(self, shard: int, rows: int, device: torch.device):
        """The whole error buffer, or the view of the parameters this reduction holds."""
        layout = self.layout(shard)
        present = self.unit.present(shard) if self.unit is not None else layout.all_present
        full_width = self.codec.padded(layout.width)
        if present == layout.all_present:
            if layout.width != shard:
                raise RuntimeError(
                    f"error buffer holds rows of {layout.width} elements but this reduction "
                    f"has {shard}: one LoCo comm object must serve one FSDP param group "
                    "(install it with fsdp_ext.comm.enable or LoCoReduceScatter.install)"
                )
            self.feedback.materialize(rows * full_width, device)
            return self.feedback
        width = self.codec.padded(shard)
        return self.feedback.subset(rows, full_width, layout.columns(present, device), width)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        """Reduce ``input_tensor`` (``[W * shard]``, rank-major) into ``output_tensor``.

        Returns None: FSDP orders it by stream, not by a ``Work``. The output is filled on
        return, or, with ``overlap`` in a backward, by the time the backward ends.
        """
        world_size = group.size()
        shard = output_tensor.numel()
        if input_tensor.numel() != world_size * shard:
            raise ValueError(
                f"input_tensor must hold world_size * output numel = {world_size * shard} "
                f"elements, got {input_tensor.numel()}"
            )
        out_scale = reduce_op_scale(op, world_size)
        wire_input = input_tensor.float() if input_tensor.dtype == torch.float16 else input_tensor
        intra_bytes = 0
        if self.node_size is not None or self._node_groups is not None:
            groups = self._groups(group)
            chunks, intra_bytes = node_local_reduce_scatter(wire_input, groups)
            exchange_group = groups.inter_node
        else:
            chunks = wire_input.view(world_size, shard)
            exchange_group = group
        if chunks.shape[0] == 1:
            output_tensor.copy_(chunks[0].float() * out_scale)
            sent = 0
        elif not self.wire_for(shard, chunks.dtype).compressed:
            sent = plain_reduce_scatter_into(
                output_tensor, chunks, exchange_group, out_scale=out_scale
            )
        else:
            feedback = None
            if self.feedback is not None:
                feedback = self._feedback_for(shard, chunks.shape[0], input_tensor.device)
            # padding, quantisation and the write into the output happen in the kernels;
            # fp16 is reduced into an fp32 buffer (the kernels write fp32 or bf16)
            target = output_tensor
            if output_tensor.dtype == torch.float16:
                target = torch.empty(shard, dtype=torch.float32, device=output_tensor.device)
            sent = quantized_reduce_scatter_into(
                target,
                chunks,
                exchange_group,
                self.codec,
                feedback,
                out_scale=out_scale,
                defer=DEFERRED.add if self._may_defer(output_tensor) else None,
            )
            if target is not output_tensor:
                output_tensor.copy_(target)
            if isinstance(feedback, ErrorSubset):
                feedback.write_back()
        self.stats.bytes_sent += sent
        self.stats.intra_node_bytes += intra_bytes
        self.stats.bytes_uncompressed += (world_size - 1) * shard * input_tensor.element_size()
        self.stats.reductions += 1
        return None

    def _may_defer(self, output: torch.Tensor) -> bool:
        """Whether ``output`` may be filled after the call returns (see the class doc)."""
        if not self.overlap or self.unit is None or backward_task_id() == -1:
            return False
        return reduce_output_only_viewed(self.unit.group, output.dtype)

    def _groups(self, group: dist.ProcessGroup) -> NodeGroups:
        if self._node_groups is None:
            ranks = dist.get_process_group_ranks(group)
            built = build_node_groups(all_shard_groups([ranks]), resolve_node_size(self.node_size))
            self._node_groups = built[tuple(ranks)]
        return self._node_groups

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {} if self.feedback is None else {"reduce_scatter": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict(state["reduce_scatter"])
