"""Receiver side of the quantised reduce-scatter: dequantise W chunks, sum, scale.

``packed[w]`` and ``scales[w]`` are chunk ``w`` as produced by ``quantize_ef_to_payload``. The
output is ``(sum_w deQ(packed[w], scales[w])) * out_scale`` in ``out_dtype``. The sum runs in
fp32 in chunk order ``w = 0, 1, ...``, so the reference and the kernel agree bit for bit, and a NaN
scale (a non-finite group on some sender) makes that group non-finite in the output.

Three implementations (chosen by :mod:`fsdp_ext.kernels.backend`): the torch reference, the
Triton kernel, and a fast CPU path, bit-exact with the reference (same operations, same
order, block by block in cache).

The entry point, :func:`dequantize_reduce_from_payload`, reads a received all-to-all buffer
in place (layout in :mod:`fsdp_ext.kernels.codec_common`) and writes the first
``out.numel()`` values straight into ``out`` (FSDP's reduce-scatter output): one read of the
payload, one write of the output. :func:`dequantize_reduce_reference` (``[W, bytes]`` codes
and ``[W, G]`` scales -> a new flat tensor) is the spec the payload reference is built on.
"""

from __future__ import annotations

import torch

from fsdp_ext.kernels import backend
from fsdp_ext.kernels.codec_common import (
    AOT_ALL_STORAGES,
    LITTLE_ENDIAN,
    QMAX,
    TRITON_GROUP_SIZES,
    CompileCase,
    as_int16_bits,
    bytes_per_group,
    check_payload,
    cpu_block_groups,
    cpu_workspace,
    launch_options,
    payload_views,
    qmax,
    require_triton,
    tile_config,
    tl,
    triton,
)


def _check_args(packed, scales, group_size, bits, out_dtype) -> None:
    qmax(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {packed.shape}")
    if scales.dtype != torch.float32 or scales.dim() != 2:
        raise ValueError(f"scales must be a 2-D float32 tensor, got {scales.dtype} {scales.shape}")
    if packed.shape[1] != scales.shape[1] * bytes_per_group(group_size, bits):
        raise ValueError(
            f"packed has {packed.shape[1]} bytes per chunk but scales imply "
            f"{scales.shape[1] * bytes_per_group(group_size, bits)}"
        )
    if packed.shape[0] != scales.shape[0]:
        raise ValueError("packed and scales must hold the same number of chunks")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")


def _check_payload_args(payload, out, group_size, bits) -> int:
    """Validate the payload entry point's arguments; returns groups per chunk."""
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D tensor, got shape {tuple(out.shape)}")
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out.dtype must be float32 or bfloat16, got {out.dtype}")
    if payload.dim() != 2:
        raise ValueError(f"payload must be 2-D [chunks, bytes], got {tuple(payload.shape)}")
    groups = -(-out.numel() // group_size)
    check_payload(payload, payload.shape[0], groups, group_size, bits)
    return groups


def dequantize_reference(
    packed: torch.Tensor, scales: torch.Tensor, *, group_size: int, bits: int
) -> torch.Tensor:
    """``[W, bytes]`` codes and ``[W, G]`` scales -> ``[W, G, group_size]`` fp32 values."""
    offset = qmax(bits) + 1
    if bits == 4:
        pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)
        codes = pairs.view(packed.shape[0], 2 * packed.shape[1])
    else:
        codes = packed
    q = codes.float() - offset
    return q.view(scales.shape[0], scales.shape[1], group_size) * scales.unsqueeze(-1)


def dequantize_reduce_reference(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sum of the dequantised chunks times ``out_scale``, flat, in ``out_dtype``."""
    _check_args(packed, scales, group_size, bits, out_dtype)
    values = dequantize_reference(packed, scales, group_size=group_size, bits=bits)
    acc = torch.zeros(values.shape[1:], dtype=torch.float32, device=packed.device)
    for chunk in values:
        acc = acc + chunk
    return (acc * torch.tensor(out_scale, dtype=torch.float32)).view(-1).to(out_dtype)


def dequantize_reduce_from_payload_reference(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
) -> None:
    """The spec of :func:`dequantize_reduce_from_payload`: split, reduce, copy the prefix."""
    groups = _check_payload_args(payload, out, group_size, bits)
    codes, scales = payload_views(payload, groups, group_size, bits)
    reduced = dequantize_reduce_reference(
        codes.contiguous(),
        scales.contiguous(),
        group_size=group_size,
        bits=bits,
        out_scale=out_scale,
        out_dtype=out.dtype,
    )
    out.copy_(reduced[: out.numel()])


def _dequantize_rows_cpu(codes, scales, out, group_size, bits, out_scale) -> None:
    """The fast CPU path's core: ``codes`` ``[W, G * bytes per group]`` and ``scales``
    ``[W, G]`` (unit column stride) -> the first ``out.numel()`` values of the reduction.

    Block by block of whole groups: every chunk's codes are unpacked into an fp32 block
    buffer, ``q - offset`` times the group's scale, and added to the block's accumulator in
    chunk order, the operations of :func:`dequantize_reduce_reference` in its order. 4-bit
    bytes are split through int16: ``(b & 0xF) | (b & 0xF0) << 4`` is the byte pair
    ``[lo, hi]`` (little-endian), converted to fp32 in one pass.
    """
    num_chunks, groups = scales.shape
    n = out.numel()
    if n == 0:
        return
    offset = qmax(bits) + 1
    per_block = cpu_block_groups(group_size)
    k_max = min(per_block, groups)
    work = cpu_workspace(codes.device, k_max, group_size)
    acc, q, low, high = work.h, work.q, work.low, work.high
    out_scale32 = torch.tensor(out_scale, dtype=torch.float32)
    per_group = bytes_per_group(group_size, bits)
    for g0 in range(0, groups, per_block):
        k = min(groups, g0 + per_block) - g0
        lo, hi = g0 * group_size, min((g0 + k) * group_size, n)
        if lo >= n:
            break
        ab, qb = acc[:k], q[:k]
        ab.zero_()
        for w in range(num_chunks):
            b = codes[w, g0 * per_group : (g0 + k) * per_group]
            if bits == 8:
                qb.view(-1).copy_(b)
            elif LITTLE_ENDIAN:
                lb, hb = low[: b.numel()], high[: b.numel()]
                lb.copy_(b)
                torch.bitwise_and(lb, 0xF0, out=hb)
                lb.bitwise_and_(0x0F).bitwise_or_(hb.bitwise_left_shift_(4))
                qb.view(-1).copy_(lb.view(torch.uint8))
            else:
                qb.view(-1, 2).copy_(torch.stack([b & 0xF, b >> 4], dim=-1))
            qb.sub_(offset).mul_(scales[w, g0 : g0 + k].view(k, 1))
            ab.add_(qb)
        ab.mul_(out_scale32)
        out[lo:hi].copy_(ab.view(-1)[: hi - lo])


def dequantize_reduce_from_payload_cpu(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
) -> None:
    """Fast CPU path; same contract and bits as :func:`dequantize_reduce_from_payload_reference`."""
    groups = _check_payload_args(payload, out, group_size, bits)
    codes, scales = payload_views(payload, groups, group_size, bits)
    _dequantize_rows_cpu(codes, scales, out, group_size, bits, out_scale)


if triton is not None:
    from fsdp_ext.kernels.codec_common import bf16_bits_rne

    @triton.jit
    def _add_nibbles(acc_lo, acc_hi, byte, scale, OFFSET: tl.constexpr):
        """One chunk of 4-bit codes added to the accumulators, as the reference adds it."""
        byte = byte.to(tl.int32)
        acc_lo = acc_lo + ((byte & 0xF) - OFFSET).to(tl.float32) * scale[:, None]
        acc_hi = acc_hi + ((byte >> 4) - OFFSET).to(tl.float32) * scale[:, None]
        return acc_lo, acc_hi

    @triton.jit
    def _dequantize_reduce_kernel(
        codes_ptr,
        codes_row_stride,
        scale_ptr,
        scale_row_stride,
        out_ptr,
        n_out,
        num_chunks,
        groups_per_row,
        out_scale,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        BITS: tl.constexpr,
        OFFSET: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        # One program reduces a [GROUPS, GROUP] tile over every chunk; 64-bit offsets.
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        group_ok = g < groups_per_row
        codes_row = codes_ptr
        scale_row = scale_ptr
        # The next chunk's loads are issued before the current chunk's arithmetic, so each
        # thread keeps two 16-byte loads in flight: a loop that loads and then uses its load
        # waits a full memory latency per chunk, with 16 bytes per thread in flight.
        if BITS == 4:
            byte_offs = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
            acc_lo = tl.zeros((GROUPS, GROUP // 2), tl.float32)
            acc_hi = tl.zeros((GROUPS, GROUP // 2), tl.float32)
            scale = tl.load(scale_row + g, mask=group_ok, other=0)
            byte = tl.load(codes_row + byte_offs, mask=group_ok[:, None], other=0)
            for _ in range(1, num_chunks):
                codes_row += codes_row_stride
                scale_row += scale_row_stride
                next_scale = tl.load(scale_row + g, mask=group_ok, other=0)
                next_byte = tl.load(codes_row + byte_offs, mask=group_ok[:, None], other=0)
                acc_lo, acc_hi = _add_nibbles(acc_lo, acc_hi, byte, scale, OFFSET)
                scale, byte = next_scale, next_byte
            acc_lo, acc_hi = _add_nibbles(acc_lo, acc_hi, byte, scale, OFFSET)
            # the low nibble is element 2i, the high one 2i + 1: interleave in registers
            acc = tl.reshape(tl.join(acc_lo, acc_hi), (GROUPS, GROUP))
        else:
            code_offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            acc = tl.zeros((GROUPS, GROUP), tl.float32)
            scale = tl.load(scale_row + g, mask=group_ok, other=0)
            code = tl.load(codes_row + code_offs, mask=group_ok[:, None], other=0)
            for _ in range(1, num_chunks):
                codes_row += codes_row_stride
                scale_row += scale_row_stride
                next_scale = tl.load(scale_row + g, mask=group_ok, other=0)
                next_code = tl.load(codes_row + code_offs, mask=group_ok[:, None], other=0)
                acc = acc + (code.to(tl.int32) - OFFSET).to(tl.float32) * scale[:, None]
                scale, code = next_scale, next_code
            acc = acc + (code.to(tl.int32) - OFFSET).to(tl.float32) * scale[:, None]
        acc = acc * out_scale
        col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        in_out = group_ok[:, None] & (col < n_out)
        if OUT_BF16:
            tl.store(out_ptr + col, bf16_bits_rne(acc), mask=in_out)
        else:
            tl.store(out_ptr + col, acc, mask=in_out)


def _kernel_config(group_size: int, bits: int, out_dtype: torch.dtype) -> tuple[dict, int]:
    """The constexprs and num_warps of a launch: shared by the launcher and compile_cases."""
    tile_groups, num_warps = tile_config("dequantize_reduce", group_size, bits)
    constexprs = dict(
        GROUP=group_size,
        GROUPS=tile_groups,
        BITS=bits,
        OFFSET=qmax(bits) + 1,
        OUT_BF16=out_dtype == torch.bfloat16,
    )
    return constexprs, num_warps


def compile_cases() -> list[CompileCase]:
    """The launchers' variants: group size x bits x output dtype; above groups of 256 (see
    ``AOT_ALL_STORAGES``) fp32 outputs only (bf16 differs in the final store alone)."""
    cases = []
    for group_size in TRITON_GROUP_SIZES:
        for bits in QMAX:
            outs = ((torch.float32, "*fp32"), (torch.bfloat16, "*i16"))
            for out_dtype, out_type in outs if group_size in AOT_ALL_STORAGES else outs[:1]:
                constexprs, num_warps = _kernel_config(group_size, bits, out_dtype)
                signature = {
                    "codes_ptr": "*u8",
                    "codes_row_stride": "i32",
                    "scale_ptr": "*fp32",
                    "scale_row_stride": "i32",
                    "out_ptr": out_type,
                    "n_out": "i32",
                    "num_chunks": "i32",
                    "groups_per_row": "i32",
                    "out_scale": "fp32",
                }
                signature.update(dict.fromkeys(constexprs, "constexpr"))
                aligned = tuple(
                    k for k, v in signature.items() if v[0] == "*" or k[-6:] == "stride"
                )
                cases.append(
                    CompileCase(
                        _dequantize_reduce_kernel,
                        signature,
                        constexprs,
                        num_warps,
                        aligned=(*aligned, "n_out"),
                        streams=("codes_ptr", "out_ptr"),
                        values=constexprs["GROUPS"] * group_size,
                    )
                )
    return cases


def _launch(codes, scales, out, groups, group_size, bits, out_scale) -> None:
    require_triton()
    if groups == 0 or out.numel() == 0:
        return
    if codes.shape[0] == 0:
        out.zero_()
        return
    constexprs, num_warps = _kernel_config(group_size, bits, out.dtype)
    _dequantize_reduce_kernel[(triton.cdiv(groups, constexprs["GROUPS"]),)](
        codes,
        codes.stride(0),
        scales,
        scales.stride(0),
        as_int16_bits(out),
        out.numel(),
        codes.shape[0],
        groups,
        float(out_scale),
        **constexprs,
        num_warps=num_warps,
        **launch_options(),
    )


def dequantize_reduce_from_payload_triton(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
) -> None:
    """Triton launcher; same contract as :func:`dequantize_reduce_from_payload_reference`."""
    groups = _check_payload_args(payload, out, group_size, bits)
    codes, scales = payload_views(payload, groups, group_size, bits)
    _launch(codes, scales, out, groups, group_size, bits, out_scale)


_DEQUANTIZE_REDUCE_FROM_PAYLOAD = {
    "triton": dequantize_reduce_from_payload_triton,
    "cpu": dequantize_reduce_from_payload_cpu,
    "reference": dequantize_reduce_from_payload_reference,
}


@torch.library.custom_op(
    "fsdp_ext::dequantize_reduce_from_payload",
    mutates_args=("out",),
    schema="(Tensor payload, Tensor(a!) out, int group_size, int bits, float out_scale) -> ()",
)
def _dequantize_reduce_from_payload_op(
    payload: torch.Tensor, out: torch.Tensor, group_size: int, bits: int, out_scale: float
) -> None:
    fn = _DEQUANTIZE_REDUCE_FROM_PAYLOAD[backend.implementation(payload, cpu_path=True)]
    fn(payload, out, group_size=group_size, bits=bits, out_scale=out_scale)


@_dequantize_reduce_from_payload_op.register_fake
def _(payload, out, group_size, bits, out_scale):
    return None


def dequantize_reduce_from_payload(
    payload: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
) -> None:
    """``out = out_scale * sum_w deQ(payload[w])[:out.numel()]``, written in place.

    The custom op ``torch.ops.fsdp_ext.dequantize_reduce_from_payload``.
    """
    torch.ops.fsdp_ext.dequantize_reduce_from_payload(
        payload, out, group_size, bits, float(out_scale)
    )
