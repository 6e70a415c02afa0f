"""Receiver side of the quantised reduce-scatter: dequantise W chunks, sum, scale.

``packed[w]`` and ``scales[w]`` are chunk ``w`` as produced by ``quantize_ef``. The output is
``(sum_w deQ(packed[w], scales[w])) * out_scale`` in ``out_dtype``. The sum runs in fp32 in
chunk order ``w = 0, 1, ...``, so the reference and the kernel agree bit for bit, and a NaN
scale (a non-finite group on some sender) makes that group non-finite in the output.
"""

from __future__ import annotations

import torch

from triton_kernels.codec_common import (
    as_int16_bits,
    bytes_per_group,
    qmax,
    require_triton,
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


def dequantize_reference(
    packed: torch.Tensor, scales: torch.Tensor, *, group_size: int, bits: int
) -> torch.Tensor:
    """``[W, bytes]`` codes and ``[W, G]`` scales -> ``[W, G, group_size]`` fp32 values."""
    offset = qmax(bits) + 1
    if bits == 4:
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
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


if triton is not None:
    from triton_kernels.codec_common import bf16_bits_rne

    @triton.jit
    def _dequantize_reduce_kernel(
        packed_ptr,
        scale_ptr,
        out_ptr,
        num_chunks,
        chunk_bytes,
        groups_per_chunk,
        out_scale,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        OFFSET: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        group = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, GROUP // 2)
        acc_even = tl.zeros((GROUP // 2,), tl.float32)
        acc_odd = tl.zeros((GROUP // 2,), tl.float32)
        for w in range(0, num_chunks):
            scale = tl.load(scale_ptr + w * groups_per_chunk + group)
            row = packed_ptr + w * chunk_bytes
            if BITS == 4:
                byte = tl.load(row + group * (GROUP // 2) + half).to(tl.int32)
                code_even = byte & 0xF
                code_odd = byte >> 4
            else:
                code_even = tl.load(row + group * GROUP + 2 * half).to(tl.int32)
                code_odd = tl.load(row + group * GROUP + 2 * half + 1).to(tl.int32)
            acc_even = acc_even + (code_even - OFFSET).to(tl.float32) * scale
            acc_odd = acc_odd + (code_odd - OFFSET).to(tl.float32) * scale
        acc_even = acc_even * out_scale
        acc_odd = acc_odd * out_scale
        even = group * GROUP + 2 * half
        if OUT_BF16:
            tl.store(out_ptr + even, bf16_bits_rne(acc_even))
            tl.store(out_ptr + even + 1, bf16_bits_rne(acc_odd))
        else:
            tl.store(out_ptr + even, acc_even)
            tl.store(out_ptr + even + 1, acc_odd)


def dequantize_reduce_triton(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton launcher; same contract as :func:`dequantize_reduce_reference`."""
    require_triton()
    _check_args(packed, scales, group_size, bits, out_dtype)
    packed, scales = packed.contiguous(), scales.contiguous()
    num_groups = scales.shape[1]
    out = torch.empty(num_groups * group_size, dtype=out_dtype, device=packed.device)
    if num_groups:
        _dequantize_reduce_kernel[(num_groups,)](
            packed,
            scales,
            as_int16_bits(out),
            packed.shape[0],
            packed.shape[1],
            num_groups,
            float(out_scale),
            GROUP=group_size,
            BITS=bits,
            OFFSET=qmax(bits) + 1,
            OUT_BF16=out_dtype == torch.bfloat16,
        )
    return out


def dequantize_reduce(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int = 128,
    bits: int = 4,
    out_scale: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    fn = dequantize_reduce_triton if packed.is_cuda else dequantize_reduce_reference
    return fn(
        packed, scales, group_size=group_size, bits=bits, out_scale=out_scale, out_dtype=out_dtype
    )
