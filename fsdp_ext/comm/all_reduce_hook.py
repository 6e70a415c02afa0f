"""LoCo-compressed all-reduce over the replicate group, as an FSDP2 all-reduce hook (HSDP).

Shard with ``fully_shard`` on the ``dp_shard`` mesh only; FSDP then hands this hook each
unit's reduce-scatter output and we average it across replicas ourselves:

1. a quantised reduce-scatter over the replicas (LoCo error feedback on every rank's input),
2. a quantised all-gather of each rank's reduced slice (LoCo error feedback on the owner).

Every replica dequantises the same bytes, so replicas stay bit-identical. A unit whose
payload would not be smaller than its slice's values (:func:`~fsdp_ext.comm.codec.choose_wire`)
is all-reduced as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext._torch import all_gather_into
from fsdp_ext.comm.codec import Codec, choose_wire
from fsdp_ext.comm.error_feedback import ErrorFeedback, ErrorSubset
from fsdp_ext.comm.layout import ParamLayout
from fsdp_ext.comm.quantized_exchange import encode_rows, pad_columns, quantized_reduce_scatter
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.comm.unit import UnitBinding


def hold_for_current_stream(tensor: torch.Tensor) -> None:
    """Tell the caching allocator ``tensor`` is in use on the stream this hook runs on.

    FSDP allocates the reduce-scatter output on its reduce-scatter stream and, under mixed
    precision, drops it after the cast that follows this hook on the all-reduce stream; without
    this the next unit's reduce-scatter could reuse the memory while our kernels still run.
    """
    if tensor.device.type in ("cpu", "meta"):
        return  # CPU work is synchronous
    tensor.record_stream(torch.accelerator.current_stream(tensor.device))


class LoCoAllReduceHook:
    """``hook(reduce_output)``: replace ``reduce_output`` in place by its replica reduction.

    Each parameter's shard is cut evenly across the replicas (as FSDP cuts parameters), so a
    replica's slice holds pieces of the same parameters whichever of them are present, and
    the error stays keyed to parameters. Divides by the replica count unless the unit has a
    gradient divide factor (``set_gradient_divide_factor``): FSDP has then already applied the
    whole factor, and the replicas are summed, as native HSDP does.
    """

    def __init__(
        self,
        config: object | None,
        replicate_group: dist.ProcessGroup,
        *,
        codec: Codec | None = None,
        stats: CommStats | None = None,
        unit: UnitBinding | None = None,
    ):
        self.config = config
        self.replicate_group = replicate_group
        self.stats = stats if stats is not None else CommStats()
        self.unit = unit
        self.codec: Codec = codec if codec is not None else make_codec(config)
        self.scatter_feedback = self.gather_feedback = None
        if self.codec.keeps_feedback:
            self.scatter_feedback = ErrorFeedback(self.codec)
            self.gather_feedback = ErrorFeedback(self.codec)
        self._anonymous: ParamLayout | None = None

    def layout(self, numel: int) -> ParamLayout:
        if self.unit is not None:
            return self.unit.layout
        if self._anonymous is None:
            self._anonymous = ParamLayout(["<input>"], [numel])
        return self._anonymous

    def slice_width(self, layout: ParamLayout) -> int:
        """Elements of one replica's padded slice when every parameter is present."""
        pieces = layout.split(self.replicate_group.size())
        return self.codec.padded(pieces.width)

    def materialize(self, device: torch.device) -> None:
        if self.scatter_feedback is None:
            return
        layout = self.unit.layout if self.unit is not None else self._anonymous
        if layout is None:
            return
        width = self.slice_width(layout)
        self.scatter_feedback.materialize(self.replicate_group.size() * width, device)
        self.gather_feedback.materialize(width, device)

    def _feedback(self, feedback, rows, layout, present, width, device):
        if feedback is None:
            return None
        pieces = layout.split(self.replicate_group.size())
        full_width = self.codec.padded(pieces.width)
        if present == layout.all_present:
            feedback.materialize(rows * full_width, device)
            return feedback
        return feedback.subset(rows, full_width, pieces.columns(present, device), width)

    def out_scale(self) -> float:
        factor = None if self.unit is None else self.unit.group.gradient_divide_factor
        return 1.0 if factor is not None else 1.0 / self.replicate_group.size()

    def __call__(self, reduce_output: torch.Tensor) -> None:
        replicas = self.replicate_group.size()
        if replicas == 1:
            return
        hold_for_current_stream(reduce_output)
        numel = reduce_output.numel()
        layout = self.layout(numel)
        present = self.unit.present(numel) if self.unit is not None else layout.all_present
        if self.unit is None and layout.width != numel:
            raise RuntimeError(
                f"LoCoAllReduceHook was built for {layout.width} elements, got {numel}; "
                "one hook serves one unit"
            )
        device = reduce_output.device
        index = layout.slice_index(present, replicas, device)
        if not choose_wire(self.codec, [index.shape[1]], reduce_output.element_size()).compressed:
            self._plain_all_reduce(reduce_output)
            return
        width = self.codec.padded(index.shape[1])
        flat = reduce_output.reshape(-1).float()
        source = torch.cat([flat, flat.new_zeros(1)])
        padded = pad_columns(source[index], width)
        scatter_fb = self._feedback(self.scatter_feedback, replicas, layout, present, width, device)
        reduced, scatter_bytes = quantized_reduce_scatter(
            padded,
            self.replicate_group,
            self.codec,
            scatter_fb,
            out_scale=self.out_scale(),
            out_dtype=torch.float32,
        )
        gather_fb = self._feedback(self.gather_feedback, 1, layout, present, width, device)
        payload = encode_rows(reduced.view(1, -1), self.codec, gather_fb)
        for fb in (scatter_fb, gather_fb):
            if isinstance(fb, ErrorSubset):
                fb.write_back()
        gathered = payload.new_empty(replicas, payload.shape[1])
        all_gather_into(gathered.view(-1), payload.view(-1), group=self.replicate_group)
        mean = torch.empty(replicas, width, dtype=torch.float32, device=device)
        self.codec.decode(gathered, mean)
        mean = mean[:, : index.shape[1]]
        valid = index < numel
        result = torch.empty(numel + 1, dtype=torch.float32, device=device)
        result[index[valid]] = mean[valid]
        reduce_output.copy_(result[:numel].view_as(reduce_output))
        self.stats.bytes_sent += scatter_bytes + (replicas - 1) * payload.shape[1]
        self.stats.bytes_uncompressed += (
            2 * (replicas - 1) * numel * reduce_output.element_size() // replicas
        )
        self.stats.reductions += 1

    def _plain_all_reduce(self, reduce_output: torch.Tensor) -> None:
        """The stock HSDP step, for units too small to gain from the codec."""
        replicas = self.replicate_group.size()
        dist.all_reduce(reduce_output, group=self.replicate_group)
        reduce_output.mul_(self.out_scale())
        plain = 2 * (replicas - 1) * reduce_output.numel() * reduce_output.element_size()
        self.stats.bytes_sent += plain // replicas
        self.stats.bytes_uncompressed += plain // replicas
        self.stats.reductions += 1

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.scatter_feedback is None:
            return {}
        return {
            "all_reduce_scatter": self.scatter_feedback.state_dict(),
            "all_reduce_gather": self.gather_feedback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.scatter_feedback is not None:
            self.scatter_feedback.load_state_dict(state["all_reduce_scatter"])
            self.gather_feedback.load_state_dict(state["all_reduce_gather"])
