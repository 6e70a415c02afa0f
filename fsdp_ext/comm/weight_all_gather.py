"""The quantised parameter all-gather: an FSDP2 ``AllGather`` that sends int8 weights.

FSDP2 hands its all-gather comm the flat input of one unit (this rank's padded shard of
every parameter, concatenated, already cast to the param dtype) and the ``[W * n]`` output
it will copy the unsharded parameters from. This comm encodes the input into one payload
row with the config's codec (:class:`~fsdp_ext.comm.blockwise_int8_codec.BlockwiseInt8Codec`
by default: groups never straddle two ranks' shards), all-gathers the payloads, and decodes
every rank's row, its own included, into the output, so every rank computes with the same
weights. The sharded parameters are never
touched: the optimizer keeps updating them in full precision.

Which gathers are quantised:
- forward gathers over the shard group, always;
- backward gathers over the shard group, if ``config.backward``;
- gathers over a smaller group (hpZ: ``reshard_after_forward=<node size>``, the backward
  gather from the node-local copy) never: that copy holds the forward's dequantised
  weights already, and re-quantising them would change what forward computed with;
- a unit whose all-gather is not in a float dtype (mixed parameter dtypes make FSDP gather
  bytes) is gathered as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_ext._torch import AllGather, FSDPParamGroup, gathering_for_backward
from fsdp_ext.comm.codec import Codec
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.weight_config import QuantizedAllGather

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


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    # looked up at each call, so a caller that wraps the collective to count bytes sees it
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


class QuantizedWeightAllGather(AllGather):
    """FSDP2 ``AllGather`` of one unit (its param group): int8 on the wire (see module doc).

    Runs synchronously and returns ``None`` (FSDP then waits on nothing).
    """

    def __init__(self, config: QuantizedAllGather, group: FSDPParamGroup, fqn: str = ""):
        self.config = config
        self.codec: Codec = make_codec(config.codec, config)  # feedback-free: checked there
        self.fqn = fqn
        self._group = group
        self.stats = WeightGatherStats()

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _kind(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> str:
        """``"quantized"``, ``"full_precision"`` or ``"intra_node"`` for this gather."""
        if group is not self._group.mesh_info.shard_process_group:
            return "intra_node"  # hpZ: the post-forward group, inside a node
        if input_tensor.dtype not in FLOAT_DTYPES:
            return "full_precision"
        if not self.config.backward and gathering_for_backward(self._group):
            return "full_precision"
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
            _all_gather(output_tensor, input_tensor, group)
            self.stats.intra_node_bytes += plain
            self.stats.intra_node_gathers += 1
            return None
        if kind == "full_precision":
            _all_gather(output_tensor, input_tensor, group)
            self.stats.full_precision_bytes += plain
            self.stats.full_precision_gathers += 1
            return None
        payload = torch.empty(
            1, self.codec.payload_bytes(n), dtype=torch.uint8, device=input_tensor.device
        )
        # input_tensor is this rank's slot of output_tensor: encode it before the decoded
        # rows overwrite it
        self.codec.encode(input_tensor.view(1, n), payload)
        gathered = torch.empty(world, payload.shape[1], dtype=torch.uint8, device=payload.device)
        _all_gather(gathered.view(-1), payload.view(-1), group)
        self.codec.decode(gathered, output_tensor.view(world, n))
        self.stats.bytes_sent += (world - 1) * payload.shape[1]
        self.stats.bytes_uncompressed += plain
        self.stats.quantized_gathers += 1
        return None
