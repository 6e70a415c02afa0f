"""Block-wise int8 weights for the quantised parameter all-gather (ZeRO++ qwZ).

Both sides of the all-gather, each with its torch reference (the spec) beside it:

- :func:`quantize_blockwise` (sender): ``[R, n]`` rows of fp32/bf16/fp16 weights -> one
  payload row each. A row is cut into groups of ``group_size`` consecutive values (the last
  one zero-padded inside the kernel, so a group never straddles two rows: two ranks' shards);
  a group's scale is ``s = absmax / 127`` (fp32) and its codes are
  ``q = clamp(floor(x / s + 0.5), -127, 127)`` as int8 (symmetric, -128 unused).
- :func:`dequantize_blockwise` (receiver): payload rows -> ``[R, n]`` rows ``q * s``, the
  fp32 product rounded once (to nearest even) into the output's dtype: fp32, bf16 or fp16.

The rounding is the gradient codec's (:mod:`triton_kernels.codec_common`): half-up via
``floor(x + 0.5)``, IEEE round-to-nearest division (``div_rn``), launches with FP fusion off,
bf16 rounded by hand, so kernel and reference agree bit for bit. A group of zeros gets
``s = 0`` and ``q = 0``; a group holding a NaN or Inf is sent as ``q = 0`` with ``s = NaN``,
so all of it dequantises to NaN and a non-finite weight can never come back finite.

Payload row layout (the codec's, with 8-bit codes): ``G * group_size`` int8 codes, then
``G`` fp32 scales, ``G = ceil(n / group_size)``: ``G * (group_size + 4)`` bytes per row.
"""

from __future__ import annotations

import torch

from triton_kernels import backend
from triton_kernels.codec_common import (
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
# ahead of time in the tests); the torch references take any power of two >= 2.
TRITON_GROUP_SIZES = (64, 128, 256, 512, 1024)
# A program covers TILE_ELEMENTS values (TILE_ELEMENTS // group_size groups) with 4 warps:
# 32 values per thread, so every load and store of a stream is a 16-byte vector.
TILE_ELEMENTS = 4096
NUM_WARPS = 4
_DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def groups_per_row(n: int, group_size: int) -> int:
    return -(-n // group_size)


def payload_row_bytes(n: int, group_size: int) -> int:
    """Bytes of one payload row for a row of ``n`` values: int8 codes, then fp32 scales."""
    return groups_per_row(n, group_size) * (group_size + 4)


def payload_parts(payload: torch.Tensor, n: int, group_size: int):
    """``([R, G * group_size]`` int8 codes, ``[R, G]`` fp32 scales), views of ``payload``."""
    code_bytes = groups_per_row(n, group_size) * group_size
    codes = payload[:, :code_bytes].view(torch.int8)
    scales = payload.view(torch.float32)[:, code_bytes // 4 :]
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


def _check_payload(payload: torch.Tensor, num_rows: int, n: int, group_size: int) -> None:
    want = (num_rows, payload_row_bytes(n, group_size))
    if payload.dtype != torch.uint8 or tuple(payload.shape) != want or not payload.is_contiguous():
        raise ValueError(
            f"payload must be a contiguous uint8 tensor of shape {want}, "
            f"got {payload.dtype} {tuple(payload.shape)}"
        )


def _check(rows: torch.Tensor, payload: torch.Tensor, group_size: int, name: str) -> None:
    _check_group_size(group_size)
    _check_rows(name, rows)
    _check_payload(payload, rows.shape[0], rows.shape[1], group_size)


# ---------------------------------------------------------------- references (the spec)


def quantize_blockwise_reference(
    rows: torch.Tensor, payload: torch.Tensor, *, group_size: int = 256
) -> None:
    """Quantise each row of ``rows`` into the same row of ``payload`` (layout above)."""
    _check(rows, payload, group_size, "rows")
    num_rows, n = rows.shape
    groups = groups_per_row(n, group_size)
    padded = torch.zeros(num_rows, groups * group_size, dtype=torch.float32, device=rows.device)
    padded[:, :n] = rows
    x = padded.view(num_rows, groups, group_size)
    bad = ~torch.isfinite(x).all(dim=2, keepdim=True)
    scale = x.abs().amax(dim=2, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe + 0.5).clamp_(-QMAX, QMAX)
    q = torch.where(bad, torch.zeros_like(q), q)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    codes, scales = payload_parts(payload, n, group_size)
    codes.copy_(q.to(torch.int8).view(num_rows, -1))
    scales.copy_(scale.view(num_rows, groups))


def dequantize_blockwise_reference(
    payload: torch.Tensor, out: torch.Tensor, *, group_size: int = 256
) -> None:
    """Write ``q * s`` of each payload row into the same row of ``out`` (its dtype)."""
    _check(out, payload, group_size, "out")
    num_rows, n = out.shape
    codes, scales = payload_parts(payload, n, group_size)
    values = codes.float().view(num_rows, -1, group_size) * scales.unsqueeze(-1)
    out.copy_(values.view(num_rows, -1)[:, :n])


# ---------------------------------------------------------------- Triton kernels

if triton is not None:
    from triton_kernels.codec_common import bf16_bits_rne

    @triton.jit
    def _quantize_blockwise_kernel(
        x_ptr,
        x_row_stride,
        n_cols,
        codes_ptr,
        scale_ptr,
        payload_row_stride,
        groups_per_row,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        # One program quantises a [GROUPS, GROUP] tile of row `row`; 64-bit offsets.
        row = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        group_ok = g < groups_per_row
        col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        in_x = group_ok[:, None] & (col < n_cols)
        x = tl.load(x_ptr + row * x_row_stride + col, mask=in_x, other=0).to(tl.float32)
        nonfinite = (x != x) | (tl.abs(x) == float("inf"))
        bad = tl.max(nonfinite.to(tl.int32), axis=1) > 0
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.floor(tl.math.div_rn(x, safe[:, None]) + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        q = tl.where(bad[:, None], 0.0, q)
        row_start = row * payload_row_stride
        tl.store(codes_ptr + row_start + col, q.to(tl.int8), mask=group_ok[:, None])
        # scale_ptr points at the first scale of row 0; rows are payload_row_stride bytes apart
        scale_at = scale_ptr + row * (payload_row_stride // 4) + g
        tl.store(scale_at, tl.where(bad, float("nan"), scale), mask=group_ok)

    @triton.jit
    def _dequantize_blockwise_kernel(
        codes_ptr,
        scale_ptr,
        payload_row_stride,
        out_ptr,
        out_row_stride,
        n_cols,
        groups_per_row,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        OUT_KIND: tl.constexpr,
    ):
        # One program dequantises a [GROUPS, GROUP] tile of row `row`; 64-bit offsets.
        row = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        group_ok = g < groups_per_row
        col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        code = tl.load(codes_ptr + row * payload_row_stride + col, mask=group_ok[:, None], other=0)
        scale_at = scale_ptr + row * (payload_row_stride // 4) + g
        scale = tl.load(scale_at, mask=group_ok, other=0)
        value = code.to(tl.float32) * scale[:, None]
        in_out = group_ok[:, None] & (col < n_cols)
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


_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*i16", torch.float16: "*fp16"}


def compile_cases() -> list[CompileCase]:
    """Every variant the launchers produce: group size x input (or output) dtype."""
    cases = []
    for group_size in TRITON_GROUP_SIZES:
        for dtype, pointer in _POINTER.items():
            quantize = {
                "x_ptr": "*bf16" if dtype == torch.bfloat16 else pointer,
                "x_row_stride": "i32",
                "n_cols": "i32",
                "codes_ptr": "*i8",
                "scale_ptr": "*fp32",
                "payload_row_stride": "i32",
                "groups_per_row": "i32",
                "GROUP": "constexpr",
                "GROUPS": "constexpr",
            }
            dequantize = {
                "codes_ptr": "*i8",
                "scale_ptr": "*fp32",
                "payload_row_stride": "i32",
                "out_ptr": pointer,
                "out_row_stride": "i32",
                "n_cols": "i32",
                "groups_per_row": "i32",
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
                    k for k, v in signature.items() if v[0] == "*" or k.endswith("stride")
                )
                cases.append(
                    CompileCase(
                        kernel,
                        signature,
                        constexprs,
                        NUM_WARPS,
                        aligned=(*aligned, "n_cols"),
                        streams=streams,
                    )
                )
    return cases


def quantize_blockwise_triton(
    rows: torch.Tensor, payload: torch.Tensor, *, group_size: int = 256
) -> None:
    """Triton launcher; same contract as :func:`quantize_blockwise_reference`."""
    _check(rows, payload, group_size, "rows")
    require_triton()
    num_rows, n = rows.shape
    groups = groups_per_row(n, group_size)
    if num_rows == 0 or groups == 0:
        return
    tile = _tile(group_size)
    codes, scales = payload_parts(payload, n, group_size)
    _quantize_blockwise_kernel[(triton.cdiv(groups, tile), num_rows)](
        rows,
        rows.stride(0),
        n,
        codes,
        scales,
        payload.stride(0),
        groups,
        GROUP=group_size,
        GROUPS=tile,
        num_warps=NUM_WARPS,
        **launch_options(),
    )


def dequantize_blockwise_triton(
    payload: torch.Tensor, out: torch.Tensor, *, group_size: int = 256
) -> None:
    """Triton launcher; same contract as :func:`dequantize_blockwise_reference`."""
    _check(out, payload, group_size, "out")
    require_triton()
    num_rows, n = out.shape
    groups = groups_per_row(n, group_size)
    if num_rows == 0 or groups == 0:
        return
    tile = _tile(group_size)
    codes, scales = payload_parts(payload, n, group_size)
    _dequantize_blockwise_kernel[(triton.cdiv(groups, tile), num_rows)](
        codes,
        scales,
        payload.stride(0),
        as_int16_bits(out),
        out.stride(0),
        n,
        groups,
        GROUP=group_size,
        GROUPS=tile,
        OUT_KIND=_DTYPE_KIND[out.dtype],
        num_warps=NUM_WARPS,
        **launch_options(),
    )


# ---------------------------------------------------------------- custom ops and dispatch


@torch.library.custom_op(
    "triton_kernels::quantize_blockwise",
    mutates_args=("payload",),
    schema="(Tensor rows, Tensor(a!) payload, int group_size) -> ()",
)
def _quantize_blockwise_op(rows: torch.Tensor, payload: torch.Tensor, group_size: int) -> None:
    use = backend.use_triton(rows)
    fn = quantize_blockwise_triton if use else quantize_blockwise_reference
    fn(rows, payload, group_size=group_size)


@_quantize_blockwise_op.register_fake
def _(rows, payload, group_size):
    return None


@torch.library.custom_op(
    "triton_kernels::dequantize_blockwise",
    mutates_args=("out",),
    schema="(Tensor payload, Tensor(a!) out, int group_size) -> ()",
)
def _dequantize_blockwise_op(payload: torch.Tensor, out: torch.Tensor, group_size: int) -> None:
    use = backend.use_triton(payload)
    fn = dequantize_blockwise_triton if use else dequantize_blockwise_reference
    fn(payload, out, group_size=group_size)


@_dequantize_blockwise_op.register_fake
def _(payload, out, group_size):
    return None


def quantize_blockwise(rows: torch.Tensor, payload: torch.Tensor, *, group_size: int = 256) -> None:
    """Quantise each row of ``rows`` into ``payload``: the Triton kernel or the torch
    reference, as :mod:`triton_kernels.backend` decides (the custom op
    ``torch.ops.triton_kernels.quantize_blockwise``)."""
    torch.ops.triton_kernels.quantize_blockwise(rows, payload, group_size)


def dequantize_blockwise(
    payload: torch.Tensor, out: torch.Tensor, *, group_size: int = 256
) -> None:
    """Dequantise each payload row into ``out`` (the custom op
    ``torch.ops.triton_kernels.dequantize_blockwise``)."""
    torch.ops.triton_kernels.dequantize_blockwise(payload, out, group_size)
