"""Pieces shared by the gradient codec kernels (``quantize_ef``, ``dequantize_reduce``).

The codec is symmetric absmax per group: ``s = absmax / qmax`` and
``q = clamp(floor(h / s + 0.5), -qmax - 1, qmax)``, with ``qmax = 7`` for 4 bits and 127 for 8.
Rounding is half-up via ``floor(x + 0.5)`` and division is IEEE round-to-nearest
(``div_rn`` in Triton), so the reference and the kernel agree bit for bit.

Wire encoding: a 4-bit value is stored as the nibble ``q + 8``; element ``2i`` goes in the
low nibble of byte ``i`` and element ``2i + 1`` in the high nibble. An 8-bit value is stored
as the byte ``q + 128``. Scales are fp32, one per group.

Non-finite groups: a group whose compensated values hold a NaN or Inf is sent with
``q = 0`` everywhere and scale ``NaN``. Dequantisation computes ``0 * NaN = NaN`` at every
position of the group, so the non-finite value reaches the receiver instead of being
packed away into a finite nibble.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional off Linux x86-64; the references still work
    triton = None
    tl = None

QMAX = {4: 7, 8: 127}
ERROR_QMAX = 127


def qmax(bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"bits must be one of {sorted(QMAX)}, got {bits!r}")
    return QMAX[bits]


def bytes_per_group(group_size: int, bits: int) -> int:
    """Packed payload bytes of one group (scale excluded)."""
    return group_size * bits // 8


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the *_reference functions instead")


if triton is not None:

    @triton.jit
    def bf16_bits_rne(x):
        """fp32 -> bf16 bit pattern (int16), round-to-nearest-even, NaN kept NaN.

        Done by hand because the Triton interpreter truncates on ``.to(tl.bfloat16)``.
        """
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def bf16_bits_to_fp32(bits):
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


def as_int16_bits(t: torch.Tensor) -> torch.Tensor:
    """View a bf16 tensor as int16 so kernels read and write its raw bits."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t
