"""Configuration of the quantised parameter all-gather (ZeRO++ qwZ)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_ext.comm.registry import CODECS, make_codec

__all__ = ["WeightQuantConfig"]

MIN_GROUP_SIZE, MAX_GROUP_SIZE = 32, 4096


@dataclass(frozen=True)
class WeightQuantConfig:
    """Settings of qwZ: FSDP's parameter all-gather sends block-wise int8 weights instead of
    the param dtype (:class:`~fsdp_ext.comm.weight_all_gather.QuantizedWeightAllGather` does).

    ``bits``: 8 (int8 codes, one fp32 absmax scale per group; 4-bit weights lose too much
    for pre-training, ZeRO++ section 5). ``group_size``: values per scale, a power of two
    from 32 to 4096 (every one has a CUDA kernel; a codec's own CUDA limits are checked
    here, when the config is built).
    ``backward``: also quantise the all-gathers that run in backward, so forward and
    backward compute with the same weights (the gradient is the one at the quantised
    weights); ``False`` quantises forward only and gathers full precision in backward. Under
    hpZ (``reshard_after_forward`` = node size) the backward gather stays inside the node and
    carries the forward's dequantised weights, unquantised, whatever ``backward`` says.

    Only the wire and the unsharded compute copy are quantised: FSDP's sharded parameters,
    which the optimizer updates, keep their dtype and values. ``codec`` names the wire
    format in :data:`fsdp_ext.comm.registry.CODECS` (built from this config); a weight
    codec keeps no error feedback.
    """

    bits: int = 8
    group_size: int = 256
    backward: bool = True
    codec: str = "int8_blockwise"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits != 8:
            raise ValueError(f"WeightQuantConfig.bits must be 8, got {self.bits!r}")
        gs = self.group_size
        if (
            not isinstance(gs, int)
            or isinstance(gs, bool)
            or not MIN_GROUP_SIZE <= gs <= MAX_GROUP_SIZE
            or gs & (gs - 1)
        ):
            raise ValueError(
                f"WeightQuantConfig.group_size must be a power of two from {MIN_GROUP_SIZE} to "
                f"{MAX_GROUP_SIZE}, got {gs!r}"
            )
        if not isinstance(self.backward, bool):
            raise ValueError(f"WeightQuantConfig.backward must be a bool, got {self.backward!r}")
        if self.codec not in CODECS:
            raise ValueError(
                f"WeightQuantConfig.codec must be one of {sorted(CODECS)}, got {self.codec!r}"
            )
        try:
            codec = make_codec(self.codec, self)
        except (AttributeError, TypeError) as exc:
            raise ValueError(
                f"WeightQuantConfig.codec={self.codec!r} cannot be built from a "
                f"WeightQuantConfig ({exc}); its factory wants another config"
            ) from exc
        try:  # the CUDA kernels' limits, checked on every device before any worker starts
            codec.check_device(torch.device("cuda"))
        except ValueError as exc:
            raise ValueError(f"WeightQuantConfig: {exc}") from exc
        if codec.keeps_feedback:
            raise ValueError(
                f"WeightQuantConfig.codec={self.codec!r} keeps error feedback; a weight "
                "all-gather takes a codec that is a pure function of the weights"
            )
