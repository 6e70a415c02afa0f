"""The qwZ weight codec: block-wise int8, one fp32 absmax scale per group, no feedback.

Format and rounding are specified in :mod:`fsdp_ext.kernels.quantize_blockwise`; the work runs
in its ``quantize_blockwise`` / ``dequantize_blockwise`` kernels (Triton on CUDA, the torch
reference elsewhere; see :mod:`fsdp_ext.kernels.backend`). Rows may be float32, bfloat16 or
float16 (FSDP gathers in the mixed-precision param dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdp_ext.comm.codec import Codec, Feedback
from fsdp_ext.kernels.quantize_blockwise import (
    TRITON_GROUP_SIZES,
    dequantize_blockwise,
    payload_row_bytes,
    quantize_blockwise,
    unit_payload_row_bytes,
)

__all__ = ["BlockwiseInt8Codec"]


class BlockwiseInt8Codec(Codec):
    """``s = absmax / 127`` per group of ``group_size``, ``q = clamp(floor(x / s + 0.5),
    -127, 127)`` as int8; decoding gives ``q * s``. A pure function of its input."""

    format_keys = ("bits",)

    def __init__(self, group_size: int = 256):
        gs = group_size
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 4 or gs & (gs - 1):
            raise ValueError(f"group_size must be a power of two >= 4, got {group_size!r}")
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: Any) -> BlockwiseInt8Codec:
        """From a :class:`~fsdp_ext.comm.weight_config.WeightQuantConfig` (or anything with
        a ``group_size``)."""
        return cls(config.group_size)

    def padded(self, numel: int) -> int:
        return -(-numel // self.group_size) * self.group_size

    def payload_bytes(self, numel: int) -> int:
        return payload_row_bytes(numel, self.group_size)

    def encode(
        self, rows: torch.Tensor, payload: torch.Tensor, feedback: Feedback | None = None
    ) -> None:
        if feedback is not None:
            raise ValueError("the block-wise int8 codec keeps no error feedback")
        quantize_blockwise(rows, payload, group_size=self.group_size)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        dequantize_blockwise(payload, out, group_size=self.group_size)

    def unit_payload_bytes(self, segments: Sequence[int]) -> int:
        return unit_payload_row_bytes(segments, self.group_size)

    def encode_unit(
        self, rows: torch.Tensor, payload: torch.Tensor, segments: Sequence[int]
    ) -> None:
        # one launch for the whole unit (its tile table is cached per unit)
        quantize_blockwise(rows, payload, group_size=self.group_size, segments=segments)

    def decode_unit(
        self, payload: torch.Tensor, out: torch.Tensor, segments: Sequence[int]
    ) -> None:
        dequantize_blockwise(payload, out, group_size=self.group_size, segments=segments)

    def decode_reduce(
        self, payload: torch.Tensor, out: torch.Tensor, *, out_scale: float = 1.0
    ) -> None:
        rows = torch.empty(payload.shape[0], out.numel(), dtype=torch.float32, device=out.device)
        self.decode(payload, rows)
        total = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
        for row in rows:  # float32, in row order, as the contract says
            total += row
        out.copy_(total * torch.tensor(out_scale, dtype=torch.float32))

    def header(self) -> dict[str, object]:
        return {"bits": 8, "group_size": self.group_size}

    def check_device(self, device: torch.device) -> None:
        if torch.device(device).type == "cuda" and self.group_size not in TRITON_GROUP_SIZES:
            raise ValueError(
                f"on {device}, the block-wise int8 codec's Triton kernels take group_size in "
                f"{TRITON_GROUP_SIZES}; got group_size={self.group_size}"
            )
