"""Fused error-feedback quantisation (the sender side of LoCo).

One pass over the gradient ``g`` and the error ``e`` (updated in place):

    h      = g + e
    s      = absmax(h over the group) / qmax,   q = clamp(floor(h / s + 0.5), -qmax - 1, qmax)
    e_new  = beta * e + (1 - beta) * (h - q * s)

``e`` is stored as fp32, bf16, or int8 with one fp32 scale per group (``e ~ e_q * e_s``,
``e_s = absmax(e_new) / 127``). Without ``error`` this is plain absmax quantisation. A group
with a non-finite ``h`` is sent as ``q = 0`` with scale NaN and its error is reset to zero
(see :mod:`triton_kernels.codec_common`).
"""

from __future__ import annotations

import torch

from triton_kernels.codec_common import (
    ERROR_QMAX,
    as_int16_bits,
    bytes_per_group,
    qmax,
    require_triton,
    tl,
    triton,
)

_ERROR_KINDS = {None: 0, torch.int8: 1, torch.bfloat16: 2, torch.float32: 3}


def _check_args(x, error, error_scales, group_size, bits) -> None:
    qmax(bits)
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x.dtype must be float32 or bfloat16, got {x.dtype}")
    if group_size < 2 or group_size & (group_size - 1) or x.numel() % group_size:
        raise ValueError(
            f"group_size must be a power of two >= 2 dividing x.numel()={x.numel()}, "
            f"got {group_size}"
        )
    if error is None:
        return
    if error.dtype not in _ERROR_KINDS:
        raise TypeError(f"error.dtype must be int8, bfloat16 or float32, got {error.dtype}")
    if error.shape != x.shape or not error.is_contiguous():
        raise ValueError(f"error must be contiguous with shape {tuple(x.shape)}")
    if (error.dtype == torch.int8) != (error_scales is not None):
        raise ValueError("error_scales is required with an int8 error, and only then")
    if error_scales is not None and (
        error_scales.dtype != torch.float32 or error_scales.numel() != x.numel() // group_size
    ):
        raise ValueError(f"error_scales must be float32 with {x.numel() // group_size} entries")


def _decode_error(error: torch.Tensor, error_scales, group_size: int) -> torch.Tensor:
    e = error.float().view(-1, group_size)
    if error.dtype == torch.int8:
        e = e * error_scales.view(-1, 1)
    return e


def _quantize_groups(h: torch.Tensor, q_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``h`` -> (integer-valued fp32 q, fp32 scale per row); the spec of the codec."""
    scale = h.abs().amax(dim=1, keepdim=True) / q_max
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(h / safe + 0.5).clamp_(-q_max - 1, q_max)
    return q, scale


def quantize_ef_reference(
    x: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x + error`` per group; update ``error`` in place. Returns (packed, scales)."""
    _check_args(x, error, error_scales, group_size, bits)
    q_max = qmax(bits)
    h = x.float().view(-1, group_size)
    if error is not None:
        e = _decode_error(error, error_scales, group_size)
        h = h + e
    bad = ~torch.isfinite(h).all(dim=1, keepdim=True)
    q, scale = _quantize_groups(h, q_max)
    q = torch.where(bad, torch.zeros_like(q), q)
    if error is not None:
        residual = h - q * scale
        beta32 = torch.tensor(beta, dtype=torch.float32)
        one_minus_beta32 = torch.tensor(1.0 - beta, dtype=torch.float32)
        e_new = beta32 * e + one_minus_beta32 * residual
        e_new = torch.where(bad, torch.zeros_like(e_new), e_new)
        if error.dtype == torch.int8:
            e_q, e_s = _quantize_groups(e_new, ERROR_QMAX)
            error.copy_(e_q.clamp_(-ERROR_QMAX, ERROR_QMAX).view(-1))
            error_scales.copy_(e_s.view(-1))
        else:
            error.copy_(e_new.view(-1))
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    codes = (q + (q_max + 1)).to(torch.uint8).view(-1)
    if bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, scale.view(-1)


if triton is not None:
    from triton_kernels.codec_common import bf16_bits_rne, bf16_bits_to_fp32

    @triton.jit
    def _quantize_group(h_even, h_odd, Q_MAX: tl.constexpr):
        absmax = tl.maximum(tl.max(tl.abs(h_even), axis=0), tl.max(tl.abs(h_odd), axis=0))
        scale = tl.math.div_rn(absmax, Q_MAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        q_even = tl.floor(tl.math.div_rn(h_even, safe) + 0.5)
        q_odd = tl.floor(tl.math.div_rn(h_odd, safe) + 0.5)
        q_even = tl.minimum(tl.maximum(q_even, -Q_MAX - 1.0), Q_MAX * 1.0)
        q_odd = tl.minimum(tl.maximum(q_odd, -Q_MAX - 1.0), Q_MAX * 1.0)
        return q_even, q_odd, scale

    @triton.jit
    def _quantize_ef_kernel(
        x_ptr,
        error_ptr,
        error_scale_ptr,
        packed_ptr,
        scale_ptr,
        beta,
        one_minus_beta,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        Q_MAX: tl.constexpr,
        ERROR_KIND: tl.constexpr,
        ERROR_QMAX_: tl.constexpr,
    ):
        group = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, GROUP // 2)
        even = group * GROUP + 2 * half
        h_even = tl.load(x_ptr + even).to(tl.float32)
        h_odd = tl.load(x_ptr + even + 1).to(tl.float32)
        if ERROR_KIND == 1:
            e_scale = tl.load(error_scale_ptr + group)
            e_even = tl.load(error_ptr + even).to(tl.float32) * e_scale
            e_odd = tl.load(error_ptr + even + 1).to(tl.float32) * e_scale
        elif ERROR_KIND == 2:
            e_even = bf16_bits_to_fp32(tl.load(error_ptr + even))
            e_odd = bf16_bits_to_fp32(tl.load(error_ptr + even + 1))
        elif ERROR_KIND == 3:
            e_even = tl.load(error_ptr + even)
            e_odd = tl.load(error_ptr + even + 1)
        if ERROR_KIND != 0:
            h_even = h_even + e_even
            h_odd = h_odd + e_odd
        inf = float("inf")
        nonfinite = (h_even != h_even) | (tl.abs(h_even) == inf)
        nonfinite = nonfinite | (h_odd != h_odd) | (tl.abs(h_odd) == inf)
        bad = tl.max(nonfinite.to(tl.int32), axis=0) > 0

        q_even, q_odd, scale = _quantize_group(h_even, h_odd, Q_MAX)
        q_even = tl.where(bad, 0.0, q_even)
        q_odd = tl.where(bad, 0.0, q_odd)
        tl.store(scale_ptr + group, tl.where(bad, float("nan"), scale))

        code_even = (q_even.to(tl.int32) + Q_MAX + 1).to(tl.uint8)
        code_odd = (q_odd.to(tl.int32) + Q_MAX + 1).to(tl.uint8)
        if BITS == 4:
            tl.store(packed_ptr + group * (GROUP // 2) + half, code_even | (code_odd << 4))
        else:
            tl.store(packed_ptr + even, code_even)
            tl.store(packed_ptr + even + 1, code_odd)

        if ERROR_KIND != 0:
            new_even = beta * e_even + one_minus_beta * (h_even - q_even * scale)
            new_odd = beta * e_odd + one_minus_beta * (h_odd - q_odd * scale)
            new_even = tl.where(bad, 0.0, new_even)
            new_odd = tl.where(bad, 0.0, new_odd)
            if ERROR_KIND == 1:
                eq_even, eq_odd, new_scale = _quantize_group(new_even, new_odd, ERROR_QMAX_)
                eq_even = tl.maximum(eq_even, -ERROR_QMAX_ * 1.0)
                eq_odd = tl.maximum(eq_odd, -ERROR_QMAX_ * 1.0)
                tl.store(error_ptr + even, eq_even.to(tl.int8))
                tl.store(error_ptr + even + 1, eq_odd.to(tl.int8))
                tl.store(error_scale_ptr + group, new_scale)
            elif ERROR_KIND == 2:
                tl.store(error_ptr + even, bf16_bits_rne(new_even))
                tl.store(error_ptr + even + 1, bf16_bits_rne(new_odd))
            else:
                tl.store(error_ptr + even, new_even)
                tl.store(error_ptr + even + 1, new_odd)


def quantize_ef_triton(
    x: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher; same contract as :func:`quantize_ef_reference`."""
    require_triton()
    _check_args(x, error, error_scales, group_size, bits)
    num_groups = x.numel() // group_size
    packed = torch.empty(
        num_groups * bytes_per_group(group_size, bits), dtype=torch.uint8, device=x.device
    )
    scales = torch.empty(num_groups, dtype=torch.float32, device=x.device)
    error_kind = _ERROR_KINDS[None if error is None else error.dtype]
    if num_groups:
        _quantize_ef_kernel[(num_groups,)](
            x,
            x if error is None else as_int16_bits(error),
            scales if error_scales is None else error_scales,
            packed,
            scales,
            float(beta),
            float(1.0 - beta),
            GROUP=group_size,
            BITS=bits,
            Q_MAX=qmax(bits),
            ERROR_KIND=error_kind,
            ERROR_QMAX_=ERROR_QMAX,
        )
    return packed, scales


def quantize_ef(
    x: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere."""
    fn = quantize_ef_triton if x.is_cuda else quantize_ef_reference
    return fn(x, error, error_scales, group_size=group_size, bits=bits, beta=beta)
