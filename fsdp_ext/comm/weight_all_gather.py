"""The quantised parameter all-gather: an FSDP2 ``AllGather`` that sends int8 weights.

FSDP2 hands its all-gather comm the flat input of one unit (this rank's padded shard of
every parameter, concatenated, already cast to the param dtype) and the ``[W * n]`` output
it will copy the unsharded parameters from. This comm encodes each parameter's piece of the
input with the config's codec
(:class:`~fsdp_ext.comm.blockwise_int8_codec.BlockwiseInt8Codec` by default) into its own
stretch of one payload row, so a quantisation group never mixes two parameters (a norm's
weights near 1 next to a projection's near 0.02 would lose the projection's) nor two ranks'
shards; it all-gathers the payloads and decodes every rank's row, its own included, into the
output, so every rank computes with the same weights. The sharded parameters are never
touched: the optimizer keeps updating them in full precision.

Which gathers are quantised:
- forward gathers over the shard group, always;
- backward gathers over the shard group, if ``config.backward``;
- gathers over a smaller group (hpZ: ``reshard_after_forward=<node size>``, the backward
  gather from the node-local copy) never: that copy holds the forward's dequantised
  weights already, and re-quantising them would change what forward computed with;
- a unit whose all-gather is not in a float dtype (mixed parameter dtypes make FSDP gather
  bytes) is gathered as is;
- a unit whose payload (codes, scales, padding to whole groups) would not be smaller than
  its plain bytes (a lone norm, biases, a small model at a large group size) is gathered as
  is: :func:`~fsdp_ext.comm.codec.choose_wire`, per unit, the same on every rank
  (:attr:`QuantizedWeightAllGather.wire`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_ext._torch import AllGather, FSDPParamGroup, all_gather_into, gathering_for_backward
from fsdp_ext.comm.codec import Codec, WireChoice, choose_wire
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.weight_config import QuantizedAllGather

__all__ = ["QuantizedWeightAllGather", "WeightGatherStats"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class WeightGatherStats:
    """What one rank sent in parameter all-gathers, counted at the call site.

    A ring all-gather sends each rank's contribution to its ``W - 1`` peers, so a gather
    of ``b`` bytes per rank counts ``(W - 1) * b``. ``bytes_sent``: quantised payloads;
    ``bytes_uncompressed``: what the stock gather would have sent for those gathers;
    ``full_precision_bytes``: gathers over the shard group left unquantised;
    ``intra_node_bytes``: hpZ's node-local backward gathers (always unquantised).
    """

    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    full_precision_bytes: int = 0
    intra_node_bytes: int = 0
    quantized_gathers: int = 0
    full_precision_gathers: int = 0
    intra_node_gathers: int = 0

    def add(self, other: WeightGatherStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def compression_ratio(self) -> float:
        """``bytes_sent / bytes_uncompressed`` of the quantised gathers (0 before any)."""
        return self.bytes_sent / self.bytes_uncompressed if self.bytes_uncompressed else 0.0


def _spans(sizes) -> list[tuple[int, int]]:
    """(start, size) of consecutive pieces of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append((start, size))
        start += size
    return out


class QuantizedWeightAllGather(AllGather):
    """FSDP2 ``AllGather`` of one unit (its param group): int8 on the wire (see module doc).

    Runs synchronously and returns ``None`` (FSDP then waits on nothing).
    """

    def __init__(self, config: QuantizedAllGather, group: FSDPParamGroup, fqn: str = ""):
        self.config = config
        self.codec: Codec = make_codec(config.codec, config)  # feedback-free: checked there
        self.fqn = fqn
        self._group = group
        self._segment_cache: dict[int, tuple[int, ...]] = {}
        self._wire_cache: dict[tuple[int, torch.dtype], WireChoice] = {}
        self.stats = WeightGatherStats()

    @property
    def wire(self) -> WireChoice:
        """This unit's choice for its shard-group gathers: every parameter's padded shard in
        the dtype FSDP gathers (the mixed-precision param dtype, else the parameter's)."""
        params = self._group.fsdp_params
        n = sum(p.padded_sharded_param_size.numel() for p in params)
        dtype = (params[0].param_dtype or params[0].orig_dtype) if params else torch.float32
        return self.wire_for(n, dtype)

    def wire_for(self, n: int, dtype: torch.dtype) -> WireChoice:
        """Encoded or plain for a flat input of ``n`` elements in ``dtype`` (sizes only)."""
        key = (n, dtype)
        if key not in self._wire_cache:
            size = torch.empty((), dtype=dtype).element_size()
            self._wire_cache[key] = choose_wire(self.codec, self._segments(n), size)
        return self._wire_cache[key]

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self, n: int) -> tuple[int, ...]:
        """Each parameter's share of a flat input of ``n`` elements (FSDP's padded shards,
        in parameter order), so that no quantisation group mixes two parameters; the whole
        input as one segment if the sizes do not add up to ``n``."""
        if n not in self._segment_cache:
            sizes = tuple(p.padded_sharded_param_size.numel() for p in self._group.fsdp_params)
            self._segment_cache[n] = sizes if sum(sizes) == n else (n,)
        return self._segment_cache[n]

    def _kind(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> str:
        """``"quantized"``, ``"full_precision"`` or ``"intra_node"`` for this gather."""
        if group is not self._group.mesh_info.shard_process_group:
            return "intra_node"  # hpZ: the post-forward group, inside a node
        if input_tensor.dtype not in FLOAT_DTYPES:
            return "full_precision"
        if not self.config.backward and gathering_for_backward(self._group):
            return "full_precision"
        if not self.wire_for(input_tensor.numel(), input_tensor.dtype).compressed:
            return "full_precision"  # the payload would be larger than the values
        return "quantized"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        world, n = group.size(), input_tensor.numel()
        kind = self._kind(input_tensor, group)
        plain = (world - 1) * n * input_tensor.element_size()
        if kind == "intra_node":
            all_gather_into(output_tensor, input_tensor, group=group)
            self.stats.intra_node_bytes += plain
            self.stats.intra_node_gathers += 1
            return None
        if kind == "full_precision":
            all_gather_into(output_tensor, input_tensor, group=group)
            self.stats.full_precision_bytes += plain
            self.stats.full_precision_gathers += 1
            return None
        segments = self._segments(n)
        widths = [self.codec.payload_bytes(numel) for numel in segments]
        payload = torch.empty(1, sum(widths), dtype=torch.uint8, device=input_tensor.device)
        # input_tensor is this rank's slot of output_tensor: encode all of it before the
        # decoded rows overwrite it
        for (start, numel), (at, width) in zip(_spans(segments), _spans(widths), strict=True):
            rows = input_tensor[start : start + numel].view(1, numel)
            self.codec.encode(rows, payload[:, at : at + width])
        gathered = torch.empty(world, payload.shape[1], dtype=torch.uint8, device=payload.device)
        all_gather_into(gathered.view(-1), payload.view(-1), group=group)
        out = output_tensor.view(world, n)
        for (start, numel), (at, width) in zip(_spans(segments), _spans(widths), strict=True):
            self.codec.decode(
                gathered[:, at : at + width].contiguous(), out[:, start : start + numel]
            )
        self.stats.bytes_sent += (world - 1) * payload.shape[1]
        self.stats.bytes_uncompressed += plain
        self.stats.quantized_gathers += 1
        return None
