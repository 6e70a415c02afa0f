"""Fused error-feedback quantisation (the sender side of LoCo).

One pass over the gradient ``g`` and the error ``e`` (updated in place):

    h      = g + e
    s      = absmax(h over the group) / qmax,   q = clamp(floor(h / s + 0.5), -qmax - 1, qmax)
    e_new  = beta * e + (1 - beta) * (h - q * s)

``e`` is stored as fp32, bf16, or int8 with one fp32 scale per group (``e ~ e_q * e_s``,
``e_s = absmax(e_new) / 127``). Without ``error`` this is plain absmax quantisation. A group
with a non-finite ``h`` is sent as ``q = 0`` with scale NaN and its error is reset to zero
(see :mod:`fsdp_ext.kernels.codec_common`).

Three implementations (chosen by :mod:`fsdp_ext.kernels.backend`): the torch reference (the
spec), the Triton kernel, and a fast CPU path, bit-exact with the reference
(``tests/test_codec_cpu.py``). On the CPU the sender is C compiled on the machine
(:mod:`fsdp_ext.kernels.cpu_native`: the reference's operations group by group, 3x faster than
torch ops can be); where no C compiler is found, plain torch makes the reference's passes
block by block over cache-resident buffers, with the same IEEE operations in the same order.

The entry point, :func:`quantize_ef_to_payload`, takes ``[W, n]`` rows (any ``n``; each row
is zero-padded to whole groups inside the kernel) and writes each row's codes and scales into
row ``w`` of an all-to-all send buffer (layout in :mod:`fsdp_ext.kernels.codec_common`), so
the sender makes one pass: read ``g``, read and write ``e``, write the payload.
:func:`quantize_ef_reference` (a flat ``x`` -> ``(packed, scales)``) is the spec the payload
reference is built on and checked against; it has no fast path of its own.
"""

from __future__ import annotations

import math

import torch

from fsdp_ext.kernels import backend
from fsdp_ext.kernels.codec_common import (
    AOT_ALL_STORAGES,
    ERROR_QMAX,
    LITTLE_ENDIAN,
    QMAX,
    SMALLEST_NORMAL,
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
from fsdp_ext.kernels.cpu_native import native_sender

_ERROR_KINDS = {None: 0, torch.int8: 1, torch.bfloat16: 2, torch.float32: 3}


def _check_error(error, error_scales, numel: int, group_size: int) -> None:
    if error is None:
        if error_scales is not None:
            raise ValueError("error_scales is required with an int8 error, and only then")
        return
    if error.dtype not in _ERROR_KINDS:
        raise TypeError(f"error.dtype must be int8, bfloat16 or float32, got {error.dtype}")
    if error.dim() != 1 or error.numel() != numel or not error.is_contiguous():
        raise ValueError(f"error must be contiguous and 1-D with {numel} elements")
    if (error.dtype == torch.int8) != (error_scales is not None):
        raise ValueError("error_scales is required with an int8 error, and only then")
    if error_scales is not None and (
        error_scales.dtype != torch.float32
        or error_scales.numel() != numel // group_size
        or not error_scales.is_contiguous()
    ):
        raise ValueError(
            f"error_scales must be contiguous float32 with {numel // group_size} entries"
        )


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
    _check_error(error, error_scales, x.numel(), group_size)


def _check_rows(rows, error, error_scales, group_size, bits) -> int:
    """Validate ``[W, n]`` rows for :func:`quantize_ef_to_payload`; returns groups per row."""
    qmax(bits)
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"rows must be 2-D with unit column stride, got {tuple(rows.shape)}")
    if rows.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"rows.dtype must be float32 or bfloat16, got {rows.dtype}")
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 2, got {group_size}")
    groups = -(-rows.shape[1] // group_size)
    _check_error(error, error_scales, rows.shape[0] * groups * group_size, group_size)
    return groups


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


def quantize_ef_to_payload_reference(
    rows: torch.Tensor,
    payload: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> None:
    """The spec of :func:`quantize_ef_to_payload`: pad, quantise flat, scatter into rows."""
    groups = _check_rows(rows, error, error_scales, group_size, bits)
    num_rows = rows.shape[0]
    check_payload(payload, num_rows, groups, group_size, bits)
    padded = rows.new_zeros(num_rows, groups * group_size)
    padded[:, : rows.shape[1]] = rows
    packed, scales = quantize_ef_reference(
        padded.view(-1), error, error_scales, group_size=group_size, bits=bits, beta=beta
    )
    codes, payload_scales = payload_views(payload, groups, group_size, bits)
    codes.copy_(packed.view(num_rows, -1))
    payload_scales.copy_(scales.view(num_rows, -1))


def _quantize_rows_cpu(rows, codes, scales, error, error_scales, group_size, bits, beta) -> None:
    """The fast CPU path's core: ``[W, n]`` rows -> ``codes`` ``[W, G * bytes per group]`` and
    ``scales`` ``[W, G]`` (both with unit column stride), error updated in place.

    Row by row, block by block of whole groups, the operations of
    :func:`quantize_ef_reference` run in its order on a few fp32 block buffers that stay in
    cache, so every value is rounded exactly as there. Fewer passes, same arithmetic:

    - ``h = x + e`` is one mixed-dtype op (``x`` bf16 or fp32, ``e`` decoded by one
      ``int8 * fp32`` op), which converts exactly and then adds in fp32;
    - a group's non-finite test reads its absmax (``amax`` propagates NaN and Inf), and the
      rare non-finite groups are masked after the fact; the clamps run only where a scale
      is subnormal (see :func:`_block_checks`);
    - an fp32 error buffer is updated in place, without a copy;
    - codes go through int8: ``q`` converted exactly, then ``+ qmax + 1`` in uint8; 4-bit
      pairs through an int16 view of the codes, ``v = c0 + 256 c1`` (little-endian), so
      ``v | v >> 4`` holds ``c0 | c1 << 4`` in its low byte.
    """
    num_rows, n = rows.shape
    groups = -(-n // group_size)
    if num_rows == 0 or groups == 0:
        return
    sender = native_sender()
    if sender is not None and _native_layout(rows, codes, scales, error, error_scales):
        work = torch.empty(3, group_size, dtype=torch.float32)
        sender(
            rows.data_ptr(),
            int(rows.dtype == torch.bfloat16),
            num_rows,
            n,
            rows.stride(0),
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            None if error is None else error.data_ptr(),
            _ERROR_KINDS[None if error is None else error.dtype],
            None if error_scales is None else error_scales.data_ptr(),
            group_size,
            bits,
            beta,  # ctypes rounds to fp32, as the reference's beta32
            1.0 - beta,  # and 1 - beta computed in double, then rounded, as there
            *(buffer.data_ptr() for buffer in work),
        )
        return
    q_max = qmax(bits)
    per_block = cpu_block_groups(group_size)
    k_max = min(per_block, groups)
    work = cpu_workspace(rows.device, k_max, group_size)
    beta32 = torch.tensor(beta, dtype=torch.float32)
    one_minus_beta32 = torch.tensor(1.0 - beta, dtype=torch.float32)
    per_group = bytes_per_group(group_size, bits)
    for w in range(num_rows):
        row = rows[w]
        for g0 in range(0, groups, per_block):
            k = min(groups, g0 + per_block) - g0
            lo, hi = g0 * group_size, min((g0 + k) * group_size, n)
            hb, qb, eb, rb = work.h[:k], work.q[:k], work.e[:k], work.r[:k]
            am, sf, one = work.absmax[:k], work.safe[:k], work.ones[:k]
            if hi - lo == k * group_size:
                x = row[lo:hi].view(k, group_size)
            else:  # the row's last block: padded to whole groups, as the reference pads
                x = hb
                x.view(-1)[: hi - lo].copy_(row[lo:hi])
                x.view(-1)[hi - lo :].zero_()
            if error is not None:
                start = (w * groups + g0) * group_size
                err = error[start : start + k * group_size].view(k, group_size)
                if error_scales is not None:
                    err_scales = error_scales[w * groups + g0 : w * groups + g0 + k].view(k, 1)
                    torch.mul(err, err_scales, out=eb)
                elif err.dtype == torch.float32:
                    eb = err  # updated in place below
                else:
                    eb.copy_(err)
                torch.add(x, eb, out=hb)
            elif x.dtype == torch.float32:
                hb = x  # only read from here on
            else:
                hb.copy_(x)
            torch.abs(hb, out=qb)
            torch.amax(qb, dim=1, keepdim=True, out=am)
            sc = scales[w, g0 : g0 + k].view(k, 1)
            torch.div(am, q_max, out=sc)
            torch.where(sc > 0, sc, one, out=sf)
            any_bad, clamp = _block_checks(am, sf)
            torch.div(hb, sf, out=qb)
            qb.add_(0.5).floor_()
            if clamp:
                qb.clamp_(-q_max - 1, q_max)
            if any_bad:
                bad = ~torch.isfinite(am)
                qb.masked_fill_(bad, 0.0)
            if error is not None:
                # the residual h - q s, as h + q (-s): negation is exact, and IEEE
                # subtraction is addition of the negated operand
                torch.neg(sc, out=sf)
                torch.mul(qb, sf, out=rb)
                rb.add_(hb)
                rb.mul_(one_minus_beta32)
                eb.mul_(beta32).add_(rb)
                if any_bad:
                    eb.masked_fill_(bad, 0.0)
                if error_scales is not None:
                    torch.abs(eb, out=rb)
                    torch.amax(rb, dim=1, keepdim=True, out=am)
                    torch.div(am, ERROR_QMAX, out=err_scales)
                    torch.where(err_scales > 0, err_scales, one, out=sf)
                    torch.div(eb, sf, out=rb)
                    rb.add_(0.5).floor_()
                    if float(sf.amin()) < SMALLEST_NORMAL:
                        rb.clamp_(-ERROR_QMAX, ERROR_QMAX)
                    err.copy_(rb)
                elif eb is not err:
                    err.copy_(eb)  # bf16: round to nearest even, as the reference
            if any_bad:
                sc.masked_fill_(bad, float("nan"))
            out = codes[w, g0 * per_group : (g0 + k) * per_group]
            if bits == 8:
                out.view(torch.int8).copy_(qb.view(-1))
                out.add_(q_max + 1)  # uint8 arithmetic: q + 128, from q's two's complement
                continue
            c = work.code_bytes[: k * group_size]
            c.view(torch.int8).copy_(qb.view(-1))
            c.add_(q_max + 1)
            if not LITTLE_ENDIAN:
                out.copy_(c[0::2] | (c[1::2] << 4))
                continue
            v = c.view(torch.int16)
            packed = work.pairs[: k * group_size // 2]
            torch.bitwise_right_shift(v, 4, out=packed)
            out.copy_(packed.bitwise_or_(v))  # int16 -> uint8 keeps the low byte


def _native_layout(rows, codes, scales, error, error_scales) -> bool:
    """Whether the compiled sender can take these tensors as they are: on the CPU, unit
    column strides, flat contiguous error state (what the library always passes)."""
    return (
        rows.device.type == "cpu"
        and rows.dtype in (torch.float32, torch.bfloat16)
        and rows.stride(1) == 1
        and codes.stride(1) == 1
        and scales.stride(1) == 1
        and (error is None or error.is_contiguous())
        and (error_scales is None or error_scales.is_contiguous())
    )


def _block_checks(absmax: torch.Tensor, safe: torch.Tensor) -> tuple[bool, bool]:
    """(whether a group of the block is non-finite, whether the clamp can bite), in one sync.

    A NaN or Inf makes the sum of the absmaxes non-finite (a finite sum that overflows only
    sends the block down the masking path, which then masks nothing). The clamp of
    ``floor(h / s + 0.5)`` to ``[-qmax - 1, qmax]`` is a no-op unless a scale is subnormal:
    with a normal ``s = fl(absmax / qmax)``, ``|fl(h / s)| <= qmax (1 + 2^-23)``, which
    rounds half up to at most ``qmax``.
    """
    total, smallest = torch.stack((absmax.sum(), safe.amin())).tolist()
    return not math.isfinite(total), smallest < SMALLEST_NORMAL


def quantize_ef_to_payload_cpu(
    rows: torch.Tensor,
    payload: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> None:
    """Fast CPU path; same contract and bits as :func:`quantize_ef_to_payload_reference`."""
    groups = _check_rows(rows, error, error_scales, group_size, bits)
    check_payload(payload, rows.shape[0], groups, group_size, bits)
    codes, scales = payload_views(payload, groups, group_size, bits)
    _quantize_rows_cpu(rows, codes, scales, error, error_scales, group_size, bits, beta)


if triton is not None:
    from fsdp_ext.kernels.codec_common import (
        absmax_rows,
        bf16_bits_rne,
        bf16_bits_to_fp32,
        div_round_half_up,
    )

    @triton.jit
    def _quantize_tile(h, absmax, Q_MAX: tl.constexpr):
        """``[GROUPS, GROUP]`` -> integer-valued q, and the scale of each group (row)."""
        scale = tl.math.div_rn(absmax, Q_MAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        q = div_round_half_up(h, safe)
        q = tl.minimum(tl.maximum(q, -Q_MAX - 1.0), Q_MAX * 1.0)
        return q, scale

    @triton.jit
    def _quantize_ef_kernel(
        x_ptr,
        x_row_stride,
        n_cols,
        error_ptr,
        error_scale_ptr,
        codes_ptr,
        codes_row_stride,
        scale_ptr,
        scale_row_stride,
        groups_per_row,
        beta,
        one_minus_beta,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        BITS: tl.constexpr,
        Q_MAX: tl.constexpr,
        ERROR_KIND: tl.constexpr,
        ERROR_QMAX_: tl.constexpr,
    ):
        # One program quantises a [GROUPS, GROUP] tile of row `row`; 64-bit offsets throughout.
        row = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        lane = tl.arange(0, GROUP)
        group_ok = g < groups_per_row
        col = g[:, None] * GROUP + lane[None, :]
        in_x = group_ok[:, None] & (col < n_cols)
        h = tl.load(x_ptr + row * x_row_stride + col, mask=in_x, other=0).to(tl.float32)

        flat_group = row * groups_per_row + g
        e_offs = flat_group[:, None] * GROUP + lane[None, :]
        if ERROR_KIND == 1:
            e_scale = tl.load(error_scale_ptr + flat_group, mask=group_ok, other=0)
            e_code = tl.load(error_ptr + e_offs, mask=group_ok[:, None], other=0)
            e = e_code.to(tl.float32) * e_scale[:, None]
        elif ERROR_KIND == 2:
            e = bf16_bits_to_fp32(tl.load(error_ptr + e_offs, mask=group_ok[:, None], other=0))
        elif ERROR_KIND == 3:
            e = tl.load(error_ptr + e_offs, mask=group_ok[:, None], other=0)
        if ERROR_KIND != 0:
            h = h + e
        absmax, bad = absmax_rows(h)
        q, scale = _quantize_tile(h, absmax, Q_MAX)
        q = tl.where(bad[:, None], 0.0, q)
        scale_at = scale_ptr + row * scale_row_stride + g
        tl.store(scale_at, tl.where(bad, float("nan"), scale), mask=group_ok)
        code = (q.to(tl.int32) + Q_MAX + 1).to(tl.uint8)
        codes_row = codes_ptr + row * codes_row_stride
        if BITS == 4:
            # contiguous load above; the even/odd lanes are split here, in registers
            lo, hi = tl.split(tl.reshape(code, (GROUPS, GROUP // 2, 2)))
            byte_offs = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
            tl.store(codes_row + byte_offs, lo | (hi << 4), mask=group_ok[:, None])
        else:
            tl.store(codes_row + col, code, mask=group_ok[:, None])

        if ERROR_KIND != 0:
            new = beta * e + one_minus_beta * (h - q * scale[:, None])
            new = tl.where(bad[:, None], 0.0, new)
            if ERROR_KIND == 1:
                e_q, new_scale = _quantize_tile(new, absmax_rows(new)[0], ERROR_QMAX_)
                e_q = tl.maximum(e_q, -ERROR_QMAX_ * 1.0)
                tl.store(error_ptr + e_offs, e_q.to(tl.int8), mask=group_ok[:, None])
                tl.store(error_scale_ptr + flat_group, new_scale, mask=group_ok)
            elif ERROR_KIND == 2:
                tl.store(error_ptr + e_offs, bf16_bits_rne(new), mask=group_ok[:, None])
            else:
                tl.store(error_ptr + e_offs, new, mask=group_ok[:, None])


def _kernel_config(group_size: int, bits: int, error_dtype) -> tuple[dict, int]:
    """The constexprs and num_warps of a launch: shared by the launcher and compile_cases."""
    tile_groups, num_warps = tile_config("quantize_ef", group_size, bits)
    constexprs = dict(
        GROUP=group_size,
        GROUPS=tile_groups,
        BITS=bits,
        Q_MAX=qmax(bits),
        ERROR_KIND=_ERROR_KINDS[error_dtype],
        ERROR_QMAX_=ERROR_QMAX,
    )
    return constexprs, num_warps


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int8: "*i8"}


def compile_cases() -> list[CompileCase]:
    """The launchers' variants: group size x bits x error dtype x input dtype, all of them up
    to groups of 256; above, int8 errors (the default) on bf16 gradients (see
    ``AOT_ALL_STORAGES``: the others differ only in one load and one store)."""
    cases = []
    for group_size in TRITON_GROUP_SIZES:
        for bits in QMAX:
            every = group_size in AOT_ALL_STORAGES
            for error_dtype in _ERROR_KINDS if every else (torch.int8,):
                for x_dtype in (torch.float32, torch.bfloat16) if every else (torch.bfloat16,):
                    constexprs, num_warps = _kernel_config(group_size, bits, error_dtype)
                    x_type = _POINTER_TYPES[x_dtype]
                    error_type = {None: x_type, torch.bfloat16: "*i16"}.get(
                        error_dtype, _POINTER_TYPES.get(error_dtype)
                    )
                    signature = {
                        "x_ptr": x_type,
                        "x_row_stride": "i32",
                        "n_cols": "i32",
                        "error_ptr": error_type,
                        "error_scale_ptr": "*fp32",
                        "codes_ptr": "*u8",
                        "codes_row_stride": "i32",
                        "scale_ptr": "*fp32",
                        "scale_row_stride": "i32",
                        "groups_per_row": "i32",
                        "beta": "fp32",
                        "one_minus_beta": "fp32",
                    }
                    signature.update(dict.fromkeys(constexprs, "constexpr"))
                    aligned = tuple(
                        k for k, v in signature.items() if v[0] == "*" or k[-6:] == "stride"
                    )
                    cases.append(
                        CompileCase(
                            _quantize_ef_kernel,
                            signature,
                            constexprs,
                            num_warps,
                            aligned=(*aligned, "n_cols"),
                            streams=("x_ptr", "codes_ptr")
                            + (("error_ptr",) if error_dtype is not None else ()),
                            values=constexprs["GROUPS"] * group_size,
                        )
                    )
    return cases


def _launch(
    rows,
    error,
    error_scales,
    codes,
    codes_row_stride,
    scales,
    scale_row_stride,
    groups,
    group_size,
    bits,
    beta,
) -> None:
    require_triton()
    num_rows = rows.shape[0]
    if num_rows == 0 or groups == 0:
        return
    constexprs, num_warps = _kernel_config(group_size, bits, None if error is None else error.dtype)
    grid = (triton.cdiv(groups, constexprs["GROUPS"]), num_rows)
    _quantize_ef_kernel[grid](
        rows,
        rows.stride(0),
        rows.shape[1],
        rows if error is None else as_int16_bits(error),
        scales if error_scales is None else error_scales,
        codes,
        codes_row_stride,
        scales,
        scale_row_stride,
        groups,
        float(beta),
        float(1.0 - beta),
        **constexprs,
        num_warps=num_warps,
        **launch_options(),
    )


def quantize_ef_to_payload_triton(
    rows: torch.Tensor,
    payload: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> None:
    """Triton launcher; same contract as :func:`quantize_ef_to_payload_reference`."""
    groups = _check_rows(rows, error, error_scales, group_size, bits)
    check_payload(payload, rows.shape[0], groups, group_size, bits)
    codes, scales = payload_views(payload, groups, group_size, bits)
    _launch(
        rows,
        error,
        error_scales,
        codes,
        codes.stride(0),
        scales,
        scales.stride(0),
        groups,
        group_size,
        bits,
        beta,
    )


_QUANTIZE_EF_TO_PAYLOAD = {
    "triton": quantize_ef_to_payload_triton,
    "cpu": quantize_ef_to_payload_cpu,
    "reference": quantize_ef_to_payload_reference,
}


# Explicit schemas: the same registration on every torch from 2.4 (the GPU machines' 2.11
# included), whatever its reading of string annotations.
@torch.library.custom_op(
    "fsdp_ext::quantize_ef_to_payload",
    mutates_args=("payload", "error", "error_scales"),
    schema="(Tensor rows, Tensor(a!) payload, Tensor(b!)? error, Tensor(c!)? error_scales, "
    "int group_size, int bits, float beta) -> ()",
)
def _quantize_ef_to_payload_op(
    rows: torch.Tensor,
    payload: torch.Tensor,
    error: torch.Tensor | None,
    error_scales: torch.Tensor | None,
    group_size: int,
    bits: int,
    beta: float,
) -> None:
    fn = _QUANTIZE_EF_TO_PAYLOAD[backend.implementation(rows, cpu_path=True)]
    fn(rows, payload, error, error_scales, group_size=group_size, bits=bits, beta=beta)


@_quantize_ef_to_payload_op.register_fake
def _(rows, payload, error, error_scales, group_size, bits, beta):
    return None


def quantize_ef_to_payload(
    rows: torch.Tensor,
    payload: torch.Tensor,
    error: torch.Tensor | None = None,
    error_scales: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    beta: float = 0.0,
) -> None:
    """Quantise ``rows[w] + e`` (``e`` updated in place) straight into ``payload[w]``.

    The custom op ``torch.ops.fsdp_ext.quantize_ef_to_payload``.
    """
    torch.ops.fsdp_ext.quantize_ef_to_payload(
        rows, payload, error, error_scales, group_size, bits, beta
    )
