"""Pieces shared by the gradient codec kernels (``quantize_ef``, ``dequantize_reduce``).

The codec is symmetric absmax per group: ``s = absmax / qmax`` and
``q = clamp(floor(h / s + 0.5), -qmax - 1, qmax)``, with ``qmax = 7`` for 4 bits and 127 for 8.
Rounding is half-up via ``floor(x + 0.5)`` and division is IEEE round-to-nearest
(``div_rn`` in Triton), so the reference and the kernel agree bit for bit.

Wire encoding: a 4-bit value is stored as the nibble ``q + 8``; element ``2i`` goes in the
low nibble of byte ``i`` and element ``2i + 1`` in the high nibble. An 8-bit value is stored
as the byte ``q + 128``. Scales are fp32, one per group.

Payload layout (the all-to-all send buffer): ``[W, chunk_bytes]`` uint8, one row per
destination rank; row ``w`` holds the codes of its ``G`` groups, then their ``G`` fp32 scales,
so each destination's bytes are contiguous (``chunk_bytes = G * (group_size * bits / 8 + 4)``).

Bit-exactness on a GPU: the kernels are launched with ``enable_fp_fusion=False``, so the
compiler never contracts ``a * b + c`` into an FMA; every product and sum is rounded on its
own, as in the torch reference. Passing the option explicitly is also what silences Triton
3.9's warning about ``TRITON_DEFAULT_FP_FUSION`` (whose default flips in 3.10): the choice is
ours, not the environment's.

Non-finite groups: a group whose compensated values hold a NaN or Inf is sent with
``q = 0`` everywhere and scale ``NaN``. Dequantisation computes ``0 * NaN = NaN`` at every
position of the group, so the non-finite value reaches the receiver instead of being
packed away into a finite nibble.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

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


def payload_chunk_bytes(groups: int, group_size: int, bits: int) -> int:
    """Bytes of one destination's row of the payload: codes then fp32 scales."""
    return groups * (bytes_per_group(group_size, bits) + 4)


def check_payload(
    payload: torch.Tensor, num_rows: int, groups: int, group_size: int, bits: int
) -> None:
    if bytes_per_group(group_size, bits) % 4:
        raise ValueError(
            f"group_size * bits / 8 must be a multiple of 4 for the payload layout, got "
            f"group_size={group_size}, bits={bits}"
        )
    want = (num_rows, payload_chunk_bytes(groups, group_size, bits))
    if payload.dtype != torch.uint8 or tuple(payload.shape) != want or not payload.is_contiguous():
        raise ValueError(
            f"payload must be a contiguous uint8 tensor of shape {want}, "
            f"got {payload.dtype} {tuple(payload.shape)}"
        )


def payload_views(
    payload: torch.Tensor, groups: int, group_size: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W, G * code_bytes]`` uint8 codes and ``[W, G]`` fp32 scales, both views of ``payload``."""
    code_bytes = groups * bytes_per_group(group_size, bits)
    codes = payload[:, :code_bytes]
    if payload.shape[1] == 0:  # no groups: torch views a [W, 0] byte tensor as no floats
        return codes, payload.new_empty((payload.shape[0], 0), dtype=torch.float32)
    scales = payload.view(torch.float32)[:, code_bytes // 4 :]
    return codes, scales


# The fast CPU paths work on blocks of whole groups, about this many elements, so that the
# block's handful of fp32 work buffers stays in the core's L2 cache while each torch op
# makes its pass over it: the reference makes its ~30 passes over memory-sized temporaries.
CPU_BLOCK_ELEMENTS = 131072
# The CPU paths pair 4-bit codes through int16 views of byte pairs where that is the byte order.
LITTLE_ENDIAN = sys.byteorder == "little"


def cpu_block_groups(group_size: int) -> int:
    """Groups per block of the fast CPU paths."""
    return max(1, CPU_BLOCK_ELEMENTS // group_size)


SMALLEST_NORMAL = 2.0**-126  # fp32


class CpuWorkspace:
    """The block buffers of the fast CPU paths: fp32 ``h, q, e, r`` ``[groups, group_size]``,
    per-group ``absmax``, ``safe`` and ``ones``, and the byte buffers of 4-bit packing."""

    def __init__(self, device: torch.device, groups: int, group_size: int):
        self.groups, self.group_size = groups, group_size
        self.h, self.q, self.e, self.r = torch.empty(4, groups, group_size, device=device)
        self.absmax, self.safe = torch.empty(2, groups, 1, device=device)
        self.ones = torch.ones(groups, 1, device=device)
        self.code_bytes = torch.empty(groups * group_size, dtype=torch.uint8, device=device)
        self.low, self.high = torch.empty(
            2, groups * group_size // 2 + 1, dtype=torch.int16, device=device
        )
        self.pairs = self.low


_workspaces = threading.local()


def cpu_workspace(device: torch.device, groups: int, group_size: int) -> CpuWorkspace:
    """This thread's workspace for blocks of ``groups`` groups, kept between calls: a fresh
    one per call would page-fault its megabytes in again every reduction."""
    cache = getattr(_workspaces, "by_shape", None)
    if cache is None:
        cache = _workspaces.by_shape = {}
    key = (torch.device(device), group_size)
    work = cache.get(key)
    if work is None or work.groups < groups:
        work = cache[key] = CpuWorkspace(
            device, max(groups, cpu_block_groups(group_size)), group_size
        )
    return work


# Tile table: (groups per program, num_warps) by kernel and group size. A program of 4 warps
# handles 2048 elements (quantize_ef, which keeps h, e and q live) or 4096 (dequantize_reduce):
# every thread then moves at least 16 contiguous bytes of each stream (fp32 or bf16 values,
# int8 errors, 4-bit codes), so each load is one 16-byte vector (ld.global.v4.b32), and the
# registers stay low enough for several programs per SM. A group larger than the tile is one
# program on its own, with more warps, so a thread's share stays the same.
# GROUPS * group_size is fixed per kernel, so the number of compiled variants does not grow
# with the table.
TILE_ELEMENTS = {"quantize_ef": 2048, "dequantize_reduce": 4096}
TILE_WARPS = {"quantize_ef": 4, "dequantize_reduce": 4}
# Group sizes the Triton codec kernels are built for (each is a compiled variant); the torch
# references take any power of two. LoCoConfig takes exactly these, on every device.
TRITON_GROUP_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# Compiled ahead of time for every error storage and input dtype; the larger sizes for the
# default storage (int8 errors) and both input dtypes, the other storages differing only in
# the error's load and store (see the compile_cases of quantize_ef).
AOT_ALL_STORAGES = (32, 64, 128, 256)


def tile_config(kernel: str, group_size: int, bits: int) -> tuple[int, int]:
    """(groups per program, num_warps) for ``kernel`` on groups of ``group_size``."""
    if group_size not in TRITON_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {TRITON_GROUP_SIZES} for the Triton kernels "
            f"(the torch reference takes any power of two), got {group_size}"
        )
    elements = TILE_ELEMENTS[kernel]
    groups = max(1, elements // group_size)
    return groups, TILE_WARPS[kernel] * max(1, group_size // elements)


@dataclass(frozen=True)
class CompileCase:
    """One compiled variant of a kernel, as its launcher would produce it.

    ``signature`` maps every runtime argument to its Triton type (``"*fp32"``, ``"i32"``...);
    ``constexprs`` gives the compile-time ones. ``aligned`` names the arguments the runtime
    specialises as multiples of 16 for aligned tensors and sizes (the common case).
    """

    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    aligned: tuple[str, ...] = ()
    streams: tuple[str, ...] = field(default=())  # the main data streams, for PTX checks
    values: int = 0  # values one program handles (0: not a per-value kernel)

    @property
    def name(self) -> str:
        values = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        types = ",".join(f"{k}:{v}" for k, v in self.signature.items() if v.startswith("*"))
        unaligned = "unit" in self.signature and "unit" not in self.aligned
        return f"{self.kernel.__name__}[{values}]({types})" + (" unaligned" if unaligned else "")


def launch_options() -> dict[str, bool]:
    """Compiler options of every codec launch (see "Bit-exactness on a GPU" above)."""
    return {"enable_fp_fusion": False}


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

    @triton.jit
    def absmax_rows(h):
        """Per row of ``h``: ``max |h|`` and whether the row holds a NaN or an Inf, from one
        integer max over the bits with the sign cleared (``|v|`` orders like its bits, and
        NaN's bits top Inf's): 2 instructions per element instead of 6."""
        bits = tl.max(h.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        return bits.to(tl.float32, bitcast=True), bits >= 0x7F800000

    @triton.jit
    def div_round_half_up(h, safe):
        """``floor(h / safe + 0.5)`` per row of ``h``, ``h / safe`` IEEE round-to-nearest, but
        with one IEEE division per row (``safe`` is the row's scale), not one per element.

        ``r = RN(1 / s)``; ``q0 = RN(h r)``; ``q = RN(q0 + (h - s q0) r)``, the residual exact
        through an FMA. Markstein's theorem: with ``r`` correctly rounded and ``q0`` within an
        ulp, ``q = RN(h / s)``, barring underflow and overflow, which are kept out: an
        ``s < 2^-90`` is first scaled, with ``h``, by ``2^64`` (both exact, the quotient
        unchanged), so ``r`` is finite and the residual of any quotient >= 1/4 is a normal
        number; ``s < 2^126`` (an absmax over ``qmax``) and ``|h / s| <= 2^8`` here. A
        quotient below 1/4 rounds half up to 0 whatever its last bits. This is the sequence
        CUDA's own ``div.rn.f32`` runs (plus a check, per element, for the ranges kept out
        here), minus a reciprocal per element. ``tests/test_codec_division.py`` checks it
        against IEEE division on 10^8 pairs (ties and their neighbours, subnormals).
        """
        m = tl.where(safe < 8.077935669463161e-28, 18446744073709551616.0, 1.0)
        s = safe * m
        r = tl.math.div_rn(1.0, s)
        hm = h * m[:, None]
        q0 = hm * r[:, None]
        q = tl.fma(-s[:, None], q0, hm)
        return tl.floor(tl.fma(q, r[:, None], q0) + 0.5)


def as_int16_bits(t: torch.Tensor) -> torch.Tensor:
    """View a bf16 tensor as int16 so kernels read and write its raw bits."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t
