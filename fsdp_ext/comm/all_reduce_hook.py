"""LoCo-compressed all-reduce over the replicate group, as an FSDP2 all-reduce hook (HSDP).

Shard with ``fully_shard`` on the ``dp_shard`` mesh only; FSDP then hands this hook each
unit's reduce-scatter output and we average it across replicas ourselves:

1. a quantised reduce-scatter over the replicas (LoCo error feedback on every rank's input),
2. a quantised all-gather of each rank's reduced slice (LoCo error feedback on the owner).

Every replica dequantises the same bytes, so replicas stay bit-identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.error_feedback import ErrorFeedback
from fsdp_ext.comm.quantized_exchange import (
    pad_columns,
    quantize_to_payload,
    quantized_reduce_scatter,
    round_up,
    split_payload,
)
from fsdp_ext.comm.stats import CommStats
from triton_kernels.dequantize_reduce import dequantize_reduce

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LoCoAllReduceHook:
    """``hook(reduce_output)``: replace ``reduce_output`` in place by its replica mean."""

    def __init__(
        self,
        config: LoCoConfig,
        replicate_group: dist.ProcessGroup,
        *,
        stats: CommStats | None = None,
    ):
        self.config = config
        self.replicate_group = replicate_group
        self.stats = stats if stats is not None else CommStats()
        on = config.error_feedback
        self.scatter_feedback = ErrorFeedback(config) if on else None
        self.gather_feedback = ErrorFeedback(config) if on else None

    def slice_numel(self, numel: int) -> int:
        """Elements of this rank's padded slice of a ``numel``-element gradient."""
        replicas = self.replicate_group.size()
        return round_up(-(-numel // replicas), self.config.group_size)

    def materialize(self, numel: int, device: torch.device) -> None:
        width = self.slice_numel(numel)
        if self.scatter_feedback is not None:
            self.scatter_feedback.materialize(self.replicate_group.size() * width, device)
            self.gather_feedback.materialize(width, device)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        replicas = self.replicate_group.size()
        if replicas == 1:
            return
        numel = reduce_output.numel()
        width = self.slice_numel(numel)
        padded = pad_columns(reduce_output.view(1, -1), replicas * width).view(replicas, width)
        reduced, scatter_bytes = quantized_reduce_scatter(
            padded,
            self.replicate_group,
            self.config,
            self.scatter_feedback,
            out_scale=1.0 / replicas,
            out_dtype=torch.float32,
        )
        payload = quantize_to_payload(reduced, 1, self.config, self.gather_feedback)
        gathered = payload.new_empty(replicas, payload.shape[1])
        _all_gather(gathered.view(-1), payload.view(-1), group=self.replicate_group)
        codes, scales = split_payload(gathered, self.config)
        mean = dequantize_reduce(
            codes.view(1, -1),
            scales.view(1, -1),
            group_size=self.config.group_size,
            bits=self.config.bits,
            out_dtype=reduce_output.dtype,
        )
        reduce_output.copy_(mean[:numel].view_as(reduce_output))
        self.stats.bytes_sent += scatter_bytes + (replicas - 1) * payload.shape[1]
        self.stats.bytes_uncompressed += (
            2 * (replicas - 1) * numel * reduce_output.element_size() // replicas
        )
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
