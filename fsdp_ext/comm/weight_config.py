"""Options of the ``int8`` weight codec and of the quantised parameter all-gather (qwZ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fsdp_ext.comm.blockwise_int8_codec import BlockwiseInt8Codec

__all__ = ["WeightQuantConfig"]


@dataclass(frozen=True)
class WeightQuantConfig:
    """Settings of qwZ: FSDP's parameter all-gather sends block-wise int8 weights instead of
    the param dtype (:class:`~fsdp_ext.comm.weight_all_gather.QuantizedWeightAllGather` does).

    ``bits``: 8 (int8 codes, one fp32 absmax scale per group; 4-bit weights lose too much
    for pre-training, ZeRO++ section 5). ``group_size``: values per scale; the codec says
    which are valid (a power of two its CUDA kernels are tiled for: 32 to 4096, checked on
    every device when the config is built).
    ``backward``: also quantise the all-gathers that run in backward, so forward and
    backward compute with the same weights (the gradient is the one at the quantised
    weights); ``False`` quantises forward only and gathers full precision in backward
    (the ``int8_forward`` preset). Under hpZ (``reshard_after_forward`` = node size) the
    backward gather stays inside the node and carries the forward's dequantised weights,
    unquantised, whatever ``backward`` says.

    Only the wire and the unsharded compute copy are quantised: FSDP's sharded parameters,
    which the optimizer updates, keep their dtype and values. Another weight codec brings
    its own options class (with a ``backward`` field) and registers it
    (:func:`fsdp_ext.comm.register_codec` with ``carries="weights"``).
    """

    codec: ClassVar[str] = "int8"

    bits: int = 8
    group_size: int = 256
    backward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits != 8:
            raise ValueError(f"WeightQuantConfig.bits must be 8, got {self.bits!r}")
        if not isinstance(self.backward, bool):
            raise ValueError(f"WeightQuantConfig.backward must be a bool, got {self.backward!r}")
        try:  # the codec's limits, its CUDA kernels' included, checked on every device
            BlockwiseInt8Codec.from_config(self).check_device(torch.device("cuda"))
        except ValueError as exc:
            raise ValueError(f"WeightQuantConfig: {exc}") from exc
