"""Shared pieces of the codec tests: hypothesis gradients with outliers, zeros, tiny values and
NaN/Inf; a random error state; and a comparison that treats NaN as equal to NaN."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fsdp_ext.kernels.codec_common import TILE_ELEMENTS, payload_chunk_bytes, payload_views


@st.composite
def gradients(draw, group_sizes=(2, 4, 32, 64, 128), max_groups=None, subnormal=False):
    """Small gradients with outliers, all-zero groups, tiny groups, and NaN/Inf.

    ``max_groups=None`` draws 1-4 groups; ``"tiles"`` draws up to three kernel tiles' worth,
    so shapes cross the tile boundaries of the Triton kernels. ``subnormal`` adds groups of
    subnormal values (whose scales are subnormal too; the Triton interpreter converts bf16
    subnormals differently from torch, so its tests leave them out).
    """
    group_size = draw(st.sampled_from(group_sizes))
    if max_groups == "tiles":
        per_tile = max(TILE_ELEMENTS.values()) // group_size  # the larger of the two tiles
        groups = draw(st.one_of(st.integers(1, 3), st.integers(per_tile - 1, 3 * per_tile + 1)))
    else:
        groups = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(groups * group_size, generator=gen) * draw(st.sampled_from([1e-6, 1.0, 1e4]))
    flat = x.view(groups, group_size)
    kinds = draw(
        st.lists(
            st.sampled_from(
                ["plain", "zero", "outlier", "nan", "inf", "tiny"] + ["subnormal"] * subnormal
            ),
            min_size=groups,
            max_size=groups,
        )
    )
    for g, kind in enumerate(kinds):
        pos = int(torch.randint(group_size, (1,), generator=gen))
        if kind == "zero":
            flat[g] = 0
        elif kind == "outlier":
            flat[g, pos] = 1e6
        elif kind == "nan":
            flat[g, pos] = float("nan")
        elif kind == "inf":
            flat[g, pos] = float("-inf") if pos % 2 else float("inf")
        elif kind == "tiny":
            flat[g] *= 1e-30
        elif kind == "subnormal":  # absmax of 10 or 140 steps of 2^-149, or near 2^-126
            amplitude = (1.4e-44, 2e-43, 1e-39)[pos % 3]
            flat[g] = flat[g] / flat[g].abs().amax().clamp_min(1e-30) * amplitude
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.to(dtype), group_size, seed


def error_state(dtype, numel, group_size, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    if dtype is None:
        return None, None
    if dtype == torch.int8:
        e = torch.randint(-127, 128, (numel,), generator=gen, dtype=torch.int8)
        return e, torch.rand(numel // group_size, generator=gen) * 0.01
    return (torch.randn(numel, generator=gen) * 0.1).to(dtype), None


def same(a, b):
    """Same dtype and shape, equal values, NaN exactly where the other has NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


# The library calls the codec kernels only through their payload entry points
# (``quantize_ef_to_payload``, ``dequantize_reduce_from_payload``); the flat references
# (``quantize_ef_reference``, ``dequantize_reduce_reference``) are the spec. These adapters
# run a payload entry point with the flat reference's signature and results, so that a test
# holds the payload path to the spec directly. The payload layout needs whole 4-byte words
# of codes per group: group sizes of 8 and up (16 and up would do for 2-bit codes).
PAYLOAD_GROUP_SIZES = (8, 32, 64, 128)


def one_row(to_payload):
    """``to_payload`` on ``x`` as one row: ``(packed, scales)`` as ``quantize_ef_reference``
    returns them (copies out of the payload row)."""

    def quantize(x, error=None, error_scales=None, *, group_size=128, bits=4, beta=0.0):
        groups = -(-x.numel() // group_size)
        width = payload_chunk_bytes(groups, group_size, bits)
        payload = torch.full((1, width), 0xAB, dtype=torch.uint8, device=x.device)
        to_payload(
            x.view(1, -1),
            payload,
            error,
            error_scales,
            group_size=group_size,
            bits=bits,
            beta=beta,
        )
        codes, scales = payload_views(payload, groups, group_size, bits)
        return codes.reshape(-1).clone(), scales.reshape(-1).clone()

    return quantize


def from_chunks(from_payload):
    """``from_payload`` on ``[W, bytes]`` codes and ``[W, G]`` scales laid out as a received
    payload: a new flat tensor, as ``dequantize_reduce_reference`` returns it."""

    def dequantize(
        packed, scales, *, group_size=128, bits=4, out_scale=1.0, out_dtype=torch.float32
    ):
        payload = torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=1)
        out = torch.full(
            (scales.shape[1] * group_size,), 7.0, dtype=out_dtype, device=packed.device
        )
        from_payload(payload, out, group_size=group_size, bits=bits, out_scale=out_scale)
        return out

    return dequantize
