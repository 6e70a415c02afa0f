"""Block-wise int8 weights for the quantised parameter all-gather (ZeRO++ qwZ).

Both sides of the all-gather, each with its torch reference (the spec) beside it:

- :func:`quantize_blockwise` (sender): ``[R, n]`` rows of fp32/bf16/fp16 weights -> one
  payload row each. A row is cut into groups of ``group_size`` consecutive values (the last
  one zero-padded inside the kernel, so a group never straddles two rows: two ranks' shards);
  a group's scale is ``s = absmax / 127`` (fp32) and its codes are
  ``q = clamp(floor(x / s + 0.5), -127, 127)`` as int8 (symmetric, -128 unused).
- :func:`dequantize_blockwise` (receiver): payload rows -> ``[R, n]`` rows ``q * s``, the
  fp32 product rounded once (to nearest even) into the output's dtype: fp32, bf16 or fp16.

With ``segments`` (the lengths of consecutive pieces of a row that add up to ``n``: one FSDP
unit's parameters in its flat all-gather buffer), every piece is grouped on its own, so a
group never mixes two parameters, and the whole unit still takes **one launch** per side: a
per-unit tile table (cached, built once on the host and copied to the device once) tells
each program which piece it quantises.

The rounding is the gradient codec's (:mod:`fsdp_ext.kernels.codec_common`): half-up via
``floor(x + 0.5)``, IEEE round-to-nearest division (``div_rn``), launches with FP fusion off,
bf16 rounded by hand, so kernel and reference agree bit for bit. A group of zeros gets
``s = 0`` and ``q = 0``; a group holding a NaN or Inf is sent as ``q = 0`` with ``s = NaN``,
so all of it dequantises to NaN and a non-finite weight can never come back finite.

Payload row layout (the codec's, with 8-bit codes): the int8 codes of every group (piece
after piece, each padded to whole groups), then one fp32 scale per group:
``G * (group_size + 4)`` bytes, ``G`` the groups of the row. With ``segments`` the scales
are followed by zero scales up to a multiple of 4 (:func:`unit_payload_row_bytes`), so that
rows are 16-byte multiples and every row of a gathered ``[W, bytes]`` buffer is read with
16-byte vector loads in place.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from fsdp_ext.kernels import backend
from fsdp_ext.kernels.codec_common import (
    CompileCase,
    as_int16_bits,
    launch_options,
    require_triton,
    tl,
    triton,
)

QMAX = 127
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Group sizes the Triton kernels are built for (each is a compiled variant, all compiled
# ahead of time in the tests); the torch references take any power of two >= 4.
TRITON_GROUP_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# A program covers TILE_ELEMENTS values (TILE_ELEMENTS // group_size groups) with 4 warps:
# 32 values per thread, so every load and store of a stream is a 16-byte vector.
TILE_ELEMENTS = 4096
NUM_WARPS = 4
# Segment offsets are passed in units of ALIGN elements when every one is a multiple of it:
# the compiler then proves 16-byte alignment and emits vector loads and stores.
ALIGN = 16
AOT_GROUP_SIZE = 256  # the default, compiled ahead of time for every dtype
_DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def groups_per_row(n: int, group_size: int) -> int:
    return -(-n // group_size)


def payload_row_bytes(n: int, group_size: int) -> int:
    """Bytes of one payload row for a row of ``n`` values: int8 codes, then fp32 scales."""
    return groups_per_row(n, group_size) * (group_size + 4)


def unit_groups(segments: Sequence[int], group_size: int) -> int:
    """Groups of a row cut into ``segments``, each padded to whole groups."""
    return sum(groups_per_row(s, group_size) for s in segments)


def _scale_slots(segments: Sequence[int] | None, groups: int) -> int:
    return groups if segments is None else -(-groups // 4) * 4


def unit_payload_row_bytes(segments: Sequence[int], group_size: int) -> int:
    """Bytes of one payload row for a row cut into ``segments``: codes, scales, and zero
    scales up to a multiple of 4 (a multiple of 16 bytes in all)."""
    groups = unit_groups(segments, group_size)
    return groups * group_size + 4 * _scale_slots(segments, groups)


def payload_parts(payload: torch.Tensor, n: int, group_size: int, segments=None):
    """``([R, G * group_size]`` int8 codes, ``[R, G]`` fp32 scales), views of ``payload``."""
    groups = (
        groups_per_row(n, group_size) if segments is None else unit_groups(segments, group_size)
    )
    code_bytes = groups * group_size
    codes = payload[:, :code_bytes].view(torch.int8)
    if payload.shape[1] == 0:  # nothing to view as fp32
        return codes, payload.new_empty(payload.shape[0], 0, dtype=torch.float32)
    scales = payload.view(torch.float32)[:, code_bytes // 4 : code_bytes // 4 + groups]
    return codes, scales


def _check_group_size(group_size: int) -> None:
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < 4
        or group_size & (group_size - 1)
    ):
        raise ValueError(f"group_size must be a power of two >= 4, got {group_size!r}")


def _check_rows(name: str, rows: torch.Tensor) -> None:
    if rows.dim() != 2 or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with unit column stride, got {tuple(rows.shape)}")
    if rows.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}.dtype must be float32, bfloat16 or float16, got {rows.dtype}")


def _check_segments(segments, n: int) -> None:
    if segments is None:
        return
    if any(not isinstance(s, int) or s < 0 for s in segments) or sum(segments) != n:
        raise ValueError(
            f"segments must be non-negative ints adding up to the row length {n}, got "
            f"{list(segments)[:8]}{'...' if len(segments) > 8 else ''}"
        )


def _check_payload(payload: torch.Tensor, num_rows: int, n: int, group_size: int, segments) -> None:
    width = (
        payload_row_bytes(n, group_size)
        if segments is None
        else unit_payload_row_bytes(segments, group_size)
    )
    want = (num_rows, width)
    if (
        payload.dtype != torch.uint8
        or tuple(payload.shape) != want
        or (width > 1 and payload.stride(1) != 1)
        or (width and num_rows > 1 and payload.stride(0) % 4)
        or (width and payload.storage_offset() % 4)
    ):
        raise ValueError(
            f"payload must be a uint8 tensor of shape {want} with contiguous rows starting "
            f"at multiples of 4 bytes, got {payload.dtype} {tuple(payload.shape)}"
        )


def _check(rows, payload, group_size: int, name: str, segments=None) -> None:
    _check_group_size(group_size)
    _check_rows(name, rows)
    _check_segments(segments, rows.shape[1])
    _check_payload(payload, rows.shape[0], rows.shape[1], group_size, segments)


# ---------------------------------------------------------------- references (the spec)


def _padded_groups(rows: torch.Tensor, group_size: int, segments) -> torch.Tensor:
    """``[R, G, group_size]`` fp32: every segment zero-padded to whole groups, in order."""
    num_rows, n = rows.shape
    segments = (n,) if segments is None else segments
    groups = unit_groups(segments, group_size)
    padded = torch.zeros(num_rows, groups * group_size, dtype=torch.float32, device=rows.device)
    start = at = 0
    for length in segments:
        padded[:, at : at + length] = rows[:, start : start + length]
        start += length
        at += groups_per_row(length, group_size) * group_size
    return padded.view(num_rows, groups, group_size)


def quantize_blockwise_reference(
    rows: torch.Tensor,
    payload: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Quantise each row of ``rows`` into the same row of ``payload`` (layout above)."""
    _check(rows, payload, group_size, "rows", segments)
    num_rows, n = rows.shape
    x = _padded_groups(rows, group_size, segments)
    bad = ~torch.isfinite(x).all(dim=2, keepdim=True)
    scale = x.abs().amax(dim=2, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe + 0.5).clamp_(-QMAX, QMAX)
    q = torch.where(bad, torch.zeros_like(q), q)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    codes, scales = payload_parts(payload, n, group_size, segments)
    codes.copy_(q.to(torch.int8).view(num_rows, -1))
    scales.copy_(scale.view(num_rows, -1))
    if segments is not None:  # the zero scales that round rows to 16 bytes
        payload[:, codes.shape[1] + 4 * scales.shape[1] :] = 0


def dequantize_blockwise_reference(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Write ``q * s`` of each payload row into the same row of ``out`` (its dtype)."""
    _check(out, payload, group_size, "out", segments)
    num_rows, n = out.shape
    codes, scales = payload_parts(payload, n, group_size, segments)
    values = codes.float().view(num_rows, -1, group_size) * scales.unsqueeze(-1)
    values = values.view(num_rows, -1)
    start = at = 0
    for length in (n,) if segments is None else segments:
        out[:, start : start + length] = values[:, at : at + length]
        start += length
        at += groups_per_row(length, group_size) * group_size


# ---------------------------------------------------------------- Triton kernels

if triton is not None:
    from fsdp_ext.kernels.codec_common import absmax_rows, bf16_bits_rne, div_round_half_up

    @triton.jit
    def _tile_of(tiles_ptr, unit, GROUP: tl.constexpr, GROUPS: tl.constexpr):
        """This program's tile: its groups' columns in the flat row, a mask of the groups
        and values that belong to its segment, and the payload index of its first group.

        A table row is ``(start, left, group0)``: the tile's first element in the row and
        the elements of its segment from there, both in units of ``unit`` (16 where every
        segment is 16-aligned, which lets the compiler prove 16-byte vector accesses), and
        the unit-wide index of its first group."""
        at = tiles_ptr + tl.program_id(0).to(tl.int64) * 3
        start = tl.load(at).to(tl.int64) * unit
        left = tl.load(at + 1).to(tl.int64) * unit
        group0 = tl.load(at + 2).to(tl.int64)
        lane = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        group_ok = tl.arange(0, GROUPS) * GROUP < left
        return start + lane, group_ok, lane < left, group0

    @triton.jit
    def _quantize_blockwise_kernel(
        x_ptr,
        x_row_stride,
        tiles_ptr,
        unit,
        codes_ptr,
        scale_ptr,
        payload_row_stride,
        groups,
        scale_slots,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        # One program quantises one tile of GROUPS groups of one segment of row `row`;
        # every segment of every row in one launch; 64-bit offsets.
        row = tl.program_id(1).to(tl.int64)
        col, group_ok, in_x, group0 = _tile_of(tiles_ptr, unit, GROUP, GROUPS)
        x = tl.load(x_ptr + row * x_row_stride + col, mask=in_x, other=0).to(tl.float32)
        absmax, bad = absmax_rows(x)
        scale = tl.math.div_rn(absmax, 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        q = div_round_half_up(x, safe)  # one IEEE division per group, not per value
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        q = tl.where(bad[:, None], 0.0, q)
        code_at = group0 * GROUP + tl.arange(0, GROUPS)[:, None] * GROUP
        code_at += tl.arange(0, GROUP)[None, :]
        tl.store(
            codes_ptr + row * payload_row_stride + code_at, q.to(tl.int8), mask=group_ok[:, None]
        )
        # scale_ptr points at the first scale of row 0; rows are payload_row_stride bytes apart.
        # Slots from `groups` to `scale_slots` are the zero scales that pad the row (the
        # table's last tile, with no values, covers them).
        g = group0 + tl.arange(0, GROUPS)
        scale = tl.where(bad, float("nan"), scale)
        write = (g < scale_slots) & (group_ok | (g >= groups))
        tl.store(
            scale_ptr + row * (payload_row_stride // 4) + g,
            tl.where(group_ok, scale, 0.0),
            mask=write,
        )

    @triton.jit
    def _dequantize_blockwise_kernel(
        codes_ptr,
        scale_ptr,
        payload_row_stride,
        tiles_ptr,
        unit,
        out_ptr,
        out_row_stride,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        OUT_KIND: tl.constexpr,
    ):
        # One program dequantises one tile of one segment of payload row `row`; 64-bit offsets.
        row = tl.program_id(1).to(tl.int64)
        col, group_ok, in_out, group0 = _tile_of(tiles_ptr, unit, GROUP, GROUPS)
        code_at = group0 * GROUP + tl.arange(0, GROUPS)[:, None] * GROUP
        code_at += tl.arange(0, GROUP)[None, :]
        code = tl.load(
            codes_ptr + row * payload_row_stride + code_at, mask=group_ok[:, None], other=0
        )
        g = group0 + tl.arange(0, GROUPS)  # int64, so the pointer offsets are too
        scale = tl.load(scale_ptr + row * (payload_row_stride // 4) + g, mask=group_ok, other=0)
        value = code.to(tl.float32) * scale[:, None]
        out_at = out_ptr + row * out_row_stride + col
        if OUT_KIND == 0:
            tl.store(out_at, value, mask=in_out)
        elif OUT_KIND == 1:
            tl.store(out_at, bf16_bits_rne(value), mask=in_out)
        else:
            tl.store(out_at, value.to(tl.float16), mask=in_out)


def _tile(group_size: int) -> int:
    if group_size not in TRITON_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {TRITON_GROUP_SIZES} for the Triton kernels "
            f"(the torch reference takes any power of two), got {group_size}"
        )
    return max(1, TILE_ELEMENTS // group_size)


class _TileTables:
    """Tile tables by (segments, group size, scale slots, device), built once per unit.

    Building one reads Python ints only, and the one host-to-device copy happens the first
    time a unit gathers on a device; every later step reuses the device tensor, so the
    per-step path never waits on the host. Bounded (FIFO) so that a program that gathers
    ever-new shapes does not grow it without end."""

    LIMIT = 1024

    def __init__(self):
        self._tables: dict[tuple, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()
        self.built = 0

    def get(self, segments, group_size: int, scale_slots: int, device) -> tuple[torch.Tensor, int]:
        key = (tuple(segments), group_size, scale_slots, torch.device(device))
        table = self._tables.get(key)
        if table is None:
            table = _tile_table(segments, group_size, scale_slots)
            table = (table[0].to(device), table[1])
            with self._lock:
                if len(self._tables) >= self.LIMIT:
                    self._tables.pop(next(iter(self._tables)))
                self._tables[key] = table
                self.built += 1
        return table


TILE_TABLES = _TileTables()


def _tile_table(segments, group_size: int, scale_slots: int) -> tuple[torch.Tensor, int]:
    """``[tiles, 3]`` int64 rows ``(start, left, group0)`` (see ``_tile_of``) and the unit
    (``ALIGN`` if every segment start and length is a multiple of it, else 1)."""
    per_tile = _tile(group_size) * group_size
    unit = ALIGN if all(s % ALIGN == 0 for s in segments) else 1
    rows, start, group0 = [], 0, 0
    for length in segments:
        for at in range(0, length, per_tile):
            rows.append((start + at, length - at, group0 + at // group_size))
        start += length
        group0 += groups_per_row(length, group_size)
    # tiles with no values write the padding scales
    rows += [(start, 0, g) for g in range(group0, scale_slots, _tile(group_size))]
    table = torch.tensor(rows, dtype=torch.int64).view(-1, 3)
    table[:, :2] //= unit
    return table, unit


_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*i16", torch.float16: "*fp16"}


def compile_cases() -> list[CompileCase]:
    """The launchers' variants, with 16-aligned segments (``unit`` = 16, what FSDP units of
    real models give): every group size for bf16 (the usual mixed-precision param dtype),
    every dtype at the default group size; plus the unaligned fallback (``unit`` a plain
    int) of each kernel and dtype at the default group size. The group size changes
    constants only, the dtype one load or store."""
    cases = []
    for group_size in TRITON_GROUP_SIZES:
        for dtype, pointer in _POINTER.items():
            if dtype != torch.bfloat16 and group_size != AOT_GROUP_SIZE:
                continue
            quantize = {
                "x_ptr": "*bf16" if dtype == torch.bfloat16 else pointer,
                "x_row_stride": "i32",
                "tiles_ptr": "*i64",
                "unit": "i32",
                "codes_ptr": "*i8",
                "scale_ptr": "*fp32",
                "payload_row_stride": "i32",
                "groups": "i32",
                "scale_slots": "i32",
                "GROUP": "constexpr",
                "GROUPS": "constexpr",
            }
            dequantize = {
                "codes_ptr": "*i8",
                "scale_ptr": "*fp32",
                "payload_row_stride": "i32",
                "tiles_ptr": "*i64",
                "unit": "i32",
                "out_ptr": pointer,
                "out_row_stride": "i32",
                "GROUP": "constexpr",
                "GROUPS": "constexpr",
                "OUT_KIND": "constexpr",
            }
            tiles = {"GROUP": group_size, "GROUPS": _tile(group_size)}
            for kernel, signature, constexprs, streams in (
                (_quantize_blockwise_kernel, quantize, tiles, ("x_ptr", "codes_ptr")),
                (
                    _dequantize_blockwise_kernel,
                    dequantize,
                    {**tiles, "OUT_KIND": _DTYPE_KIND[dtype]},
                    ("codes_ptr", "out_ptr"),
                ),
            ):
                aligned = tuple(
                    k
                    for k, v in signature.items()
                    if v[0] == "*" or k.endswith("stride") or k == "unit"
                )
                units = (aligned, tuple(a for a in aligned if a != "unit"))
                for names in units[: 2 if group_size == AOT_GROUP_SIZE else 1]:
                    cases.append(
                        CompileCase(
                            kernel, signature, constexprs, NUM_WARPS, names, streams, TILE_ELEMENTS
                        )
                    )
    return cases


def _launch_args(n: int, group_size: int, segments, device):
    segs = (n,) if segments is None else tuple(segments)
    groups = unit_groups(segs, group_size)
    slots = _scale_slots(segments, groups)
    table, unit = TILE_TABLES.get(segs, group_size, slots, device)
    return table, unit, groups, slots


def quantize_blockwise_triton(
    rows: torch.Tensor,
    payload: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Triton launcher (one launch for every segment of every row); same contract as
    :func:`quantize_blockwise_reference`."""
    _check(rows, payload, group_size, "rows", segments)
    require_triton()
    num_rows, n = rows.shape
    tile = _tile(group_size)
    table, unit, groups, slots = _launch_args(n, group_size, segments, rows.device)
    if num_rows == 0 or table.shape[0] == 0:
        return
    codes, scales = payload_parts(payload, n, group_size, segments)
    _quantize_blockwise_kernel[(table.shape[0], num_rows)](
        rows,
        rows.stride(0),
        table,
        unit,
        codes,
        scales,
        payload.stride(0),
        groups,
        slots,
        GROUP=group_size,
        GROUPS=tile,
        num_warps=NUM_WARPS,
        **launch_options(),
    )


def dequantize_blockwise_triton(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Triton launcher (one launch for every segment of every row); same contract as
    :func:`dequantize_blockwise_reference`."""
    _check(out, payload, group_size, "out", segments)
    require_triton()
    num_rows, n = out.shape
    tile = _tile(group_size)
    table, unit, _, _ = _launch_args(n, group_size, segments, out.device)
    if num_rows == 0 or table.shape[0] == 0:
        return
    codes, scales = payload_parts(payload, n, group_size, segments)
    _dequantize_blockwise_kernel[(table.shape[0], num_rows)](
        codes,
        scales,
        payload.stride(0),
        table,
        unit,
        as_int16_bits(out),
        out.stride(0),
        GROUP=group_size,
        GROUPS=tile,
        OUT_KIND=_DTYPE_KIND[out.dtype],
        num_warps=NUM_WARPS,
        **launch_options(),
    )


# ---------------------------------------------------------------- custom ops and dispatch


def _segments_arg(segments) -> list[int] | None:
    return None if segments is None else [int(s) for s in segments]


@torch.library.custom_op(
    "fsdp_ext::quantize_blockwise",
    mutates_args=("payload",),
    schema="(Tensor rows, Tensor(a!) payload, int group_size, int[]? segments) -> ()",
)
def _quantize_blockwise_op(
    rows: torch.Tensor, payload: torch.Tensor, group_size: int, segments: list[int] | None
) -> None:
    use = backend.use_triton(rows)
    fn = quantize_blockwise_triton if use else quantize_blockwise_reference
    fn(rows, payload, group_size=group_size, segments=segments)


@_quantize_blockwise_op.register_fake
def _(rows, payload, group_size, segments):
    return None


@torch.library.custom_op(
    "fsdp_ext::dequantize_blockwise",
    mutates_args=("out",),
    schema="(Tensor payload, Tensor(a!) out, int group_size, int[]? segments) -> ()",
)
def _dequantize_blockwise_op(
    payload: torch.Tensor, out: torch.Tensor, group_size: int, segments: list[int] | None
) -> None:
    use = backend.use_triton(payload)
    fn = dequantize_blockwise_triton if use else dequantize_blockwise_reference
    fn(payload, out, group_size=group_size, segments=segments)


@_dequantize_blockwise_op.register_fake
def _(payload, out, group_size, segments):
    return None


def quantize_blockwise(
    rows: torch.Tensor,
    payload: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Quantise each row of ``rows`` into ``payload``: the Triton kernel or the torch
    reference, as :mod:`fsdp_ext.kernels.backend` decides (the custom op
    ``torch.ops.fsdp_ext.quantize_blockwise``). ``segments``: see the module doc."""
    torch.ops.fsdp_ext.quantize_blockwise(rows, payload, group_size, _segments_arg(segments))


def dequantize_blockwise(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 256,
    segments: Sequence[int] | None = None,
) -> None:
    """Dequantise each payload row into ``out`` (the custom op
    ``torch.ops.fsdp_ext.dequantize_blockwise``)."""
    torch.ops.fsdp_ext.dequantize_blockwise(payload, out, group_size, _segments_arg(segments))
