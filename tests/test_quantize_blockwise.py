"""The qwZ weight kernels: Triton (interpreted on CPU) against the torch reference, bit for
bit, and the round trip against an independent fp64 computation of the absmax bound."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_ext.kernels.backend import use_backend
from fsdp_ext.kernels.quantize_blockwise import (
    TILE_ELEMENTS,
    TRITON_GROUP_SIZES,
    dequantize_blockwise,
    dequantize_blockwise_reference,
    dequantize_blockwise_triton,
    payload_parts,
    payload_row_bytes,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_blockwise_triton,
    unit_payload_row_bytes,
)
from fsdp_ext.testing import KernelLaunches

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered"),
]
FEW = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def weights(draw, group_sizes=TRITON_GROUP_SIZES, special=True):
    """``[R, n]`` rows (n any length, across tile boundaries), outliers, zero groups, tiny
    values and, if ``special``, NaN and Inf; the group size and a dtype."""
    group_size = draw(st.sampled_from(group_sizes))
    rows = draw(st.integers(1, 3))
    tile = max(1, TILE_ELEMENTS // group_size) * group_size
    n = draw(st.one_of(st.integers(1, 3 * group_size), st.integers(tile - 3, tile + group_size)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(rows, n, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    kinds = ["plain", "zero", "outlier", "tiny"] + (["nan", "inf"] if special else [])
    for r in range(rows):
        for start in range(0, n, group_size):
            kind = draw(st.sampled_from(kinds))
            end = min(start + group_size, n)
            pos = start + int(torch.randint(end - start, (1,), generator=gen))
            if kind == "zero":
                x[r, start:end] = 0
            elif kind == "outlier":
                x[r, pos] = 5e3
            elif kind == "tiny":
                x[r, start:end] *= 1e-4
            elif kind == "nan":
                x[r, pos] = float("nan")
            elif kind == "inf":
                x[r, pos] = float("-inf") if pos % 2 else float("inf")
    dtype = draw(st.sampled_from(DTYPES))
    return x.to(dtype), group_size


def _same(a, b):
    """Same dtype and shape, equal values, NaN exactly where the other has NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _payload(x, group_size, fill=0xAB):
    return torch.full(
        (x.shape[0], payload_row_bytes(x.shape[1], group_size)), fill, dtype=torch.uint8
    )


@pytest.mark.usefixtures("triton_interpreter_fma")
@FEW
@given(weights(), st.sampled_from(DTYPES))
def test_triton_matches_reference_bit_for_bit(w, out_dtype):
    x, group_size = w
    p_ref, p_tri = _payload(x, group_size), _payload(x, group_size)
    quantize_blockwise_reference(x, p_ref, group_size=group_size)
    quantize_blockwise_triton(x, p_tri, group_size=group_size)
    assert torch.equal(p_ref, p_tri)  # codes, padding codes and scales (NaN bits included)
    out_ref = torch.full(x.shape, 7.0, dtype=out_dtype)
    out_tri = out_ref.clone()
    dequantize_blockwise_reference(p_ref, out_ref, group_size=group_size)
    dequantize_blockwise_triton(p_ref, out_tri, group_size=group_size)
    assert _same(out_ref, out_tri)


def _fp64_bound(x: torch.Tensor, group_size: int):
    """Per element, from fp64 arithmetic alone: the group's absmax / 127 / 2 (half a step),
    and whether the element's group is finite."""
    rows, n = x.shape
    groups = -(-n // group_size)
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float64)
    padded[:, :n] = x.double()
    g = padded.view(rows, groups, group_size)
    finite = torch.isfinite(g).all(dim=2, keepdim=True).expand_as(g)
    absmax = g.abs().nan_to_num(posinf=0).amax(dim=2, keepdim=True).expand_as(g)
    flat = lambda t: t.reshape(rows, -1)[:, :n]  # noqa: E731
    return flat(absmax) / 127 / 2, flat(finite)


@FEW
@given(weights(group_sizes=(4, 32, 256, 2048)), st.sampled_from(DTYPES))
def test_round_trip_within_half_a_step_of_fp64_absmax(w, out_dtype):
    """Every dequantised value is within absmax/127/2 of its input (fp64 arithmetic), up to
    the fp32 rounding of the scale, the division and the product, and the output dtype's
    half ulp; codes are in [-127, 127]; non-finite groups come back all NaN, zero ones zero."""
    x, group_size = w
    payload = _payload(x, group_size)
    quantize_blockwise(x, payload, group_size=group_size)
    out = torch.empty(x.shape, dtype=out_dtype)
    dequantize_blockwise(payload, out, group_size=group_size)
    codes, scales = payload_parts(payload, x.shape[1], group_size)
    assert codes.min() >= -127 and codes.max() <= 127
    half_step, finite = _fp64_bound(x, group_size)
    exact = x.double()
    back = out.double()
    out_ulp = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out_dtype]
    bound = half_step * (1 + 2**-20) + exact.abs() * (2**-22 + out_ulp)
    if out_dtype == torch.float16:
        bound = bound + 2**-25  # fp16 subnormal spacing
    err = (back - exact).abs()
    assert bool((err[finite] <= bound[finite]).all()), float((err - bound)[finite].max())
    assert bool(back[~finite].isnan().all())
    # the fp32 scale is the exact absmax / 127, rounded once to fp32; NaN for non-finite
    rows, n = x.shape
    groups = scales.shape[1]
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float64)
    padded[:, :n] = x.double()
    g = padded.view(rows, groups, group_size)
    group_finite = torch.isfinite(g).all(dim=2)
    want = (g.abs().nan_to_num(posinf=0).amax(dim=2) / 127).float()
    assert torch.equal(scales[group_finite], want[group_finite])
    assert bool(scales[~group_finite].isnan().all())


def test_scale_is_absmax_over_127_and_codes_round_half_up():
    """A hand-checked group: absmax 127 gives scale 1, so codes are x rounded half up."""
    x = torch.tensor([[127.0, -127.0, 0.5, -0.5, 1.49, -2.5, 3.0, 0.0]])
    payload = _payload(x, 8)
    quantize_blockwise_reference(x, payload, group_size=8)
    codes, scales = payload_parts(payload, 8, 8)
    assert scales.tolist() == [[1.0]]
    assert codes.tolist() == [[127, -127, 1, 0, 1, -2, 3, 0]]


def test_bad_arguments_are_refused():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        quantize_blockwise_reference(x, _payload(x, 8), group_size=6)
    with pytest.raises(ValueError, match="payload must be a uint8 tensor of shape"):
        quantize_blockwise_reference(x, _payload(x, 8)[:, :-1], group_size=8)
    with pytest.raises(TypeError, match=r"rows\.dtype must be float32, bfloat16 or float16"):
        quantize_blockwise_reference(x.double(), _payload(x, 8), group_size=8)
    with pytest.raises(ValueError, match="for the Triton kernels"):
        quantize_blockwise_triton(x, _payload(x, 8), group_size=8)


@pytest.mark.usefixtures("triton_interpreter_fma")
def test_custom_ops_compile_without_graph_break():
    """``torch.compile(fullgraph=True)`` traces through both ops (custom ops with fake
    implementations) and equals eager, the in-place payload and output included."""

    def round_trip(x, payload, out):
        quantize_blockwise(x * 2, payload, group_size=64)
        dequantize_blockwise(payload, out, group_size=64)
        return (out.sum(),)

    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(0))
    args = [x, _payload(x, 64), torch.zeros(2, 100)]
    eager_args = [a.clone() for a in args]
    torch._dynamo.reset()
    with use_backend("triton"):
        compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager")(*args)
    with use_backend("reference"):
        eager = round_trip(*eager_args)
    for a, b in zip([*eager_args, *eager], [*args, *compiled], strict=True):
        assert torch.equal(a, b)
    assert args[2].abs().max() > 0


@st.composite
def units(draw):
    """``[R, n]`` rows cut into segments (one FSDP unit's parameters): empty, tiny, group-
    and tile-crossing pieces, all 16-aligned or not (the kernel's two variants), values
    with outliers, zeros and non-finite groups; the group size and the dtype."""
    group_size = draw(st.sampled_from(TRITON_GROUP_SIZES))
    tile = max(1, TILE_ELEMENTS // group_size) * group_size
    aligned = draw(st.booleans())
    piece = st.one_of(
        st.just(0),
        st.integers(1, 2 * group_size),
        st.integers(tile - 2, tile + group_size),
    )
    segments = [
        -(-s // 16) * 16 if aligned else s for s in draw(st.lists(piece, min_size=1, max_size=4))
    ]
    n = sum(segments)
    rows = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(rows, n, generator=gen) * torch.rand(rows, n, generator=gen).pow(8) * 30
    if n:
        for kind in draw(st.lists(st.sampled_from(["zero", "nan", "inf", "outlier"]), max_size=3)):
            r, at = draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))
            x[r, at : at + 5] = {"zero": 0.0, "nan": float("nan"), "inf": float("inf")}.get(
                kind, 5e3
            )
    return x.to(draw(st.sampled_from(DTYPES))), group_size, segments


def _unit_payload(x, group_size, segments, fill=0xAB):
    width = unit_payload_row_bytes(segments, group_size)
    return torch.full((x.shape[0], width), fill, dtype=torch.uint8)


@pytest.mark.usefixtures("triton_interpreter_fma")
@FEW
@given(units(), st.sampled_from(DTYPES))
def test_unit_kernels_match_reference_bit_for_bit_in_one_launch_each(unit, out_dtype):
    """A whole unit, every segment, every row: one launch each way, every payload byte
    (codes, scales, the zero scales that round rows to 16 bytes) and every output equal."""
    x, group_size, segments = unit
    p_ref, p_tri = _unit_payload(x, group_size, segments), _unit_payload(x, group_size, segments, 1)
    quantize_blockwise_reference(x, p_ref, group_size=group_size, segments=segments)
    with KernelLaunches() as launches:
        quantize_blockwise_triton(x, p_tri, group_size=group_size, segments=segments)
    assert torch.equal(p_ref, p_tri)
    assert p_ref.shape[1] % 16 == 0
    out_ref = torch.full(x.shape, 7.0, dtype=out_dtype)
    out_tri = out_ref.clone()
    dequantize_blockwise_reference(p_ref, out_ref, group_size=group_size, segments=segments)
    with launches:
        dequantize_blockwise_triton(p_ref, out_tri, group_size=group_size, segments=segments)
    assert _same(out_ref, out_tri)
    want = ["_quantize_blockwise_kernel", "_dequantize_blockwise_kernel"] if x.numel() else []
    assert launches.names == want


@FEW
@given(units())
def test_a_unit_payload_is_each_segment_quantised_on_its_own(unit):
    """The unit layout against the one-row spec applied to each segment alone: codes
    segment after segment, then the scales in the same order, then zero scales."""
    x, group_size, segments = unit
    payload = _unit_payload(x, group_size, segments)
    quantize_blockwise(x, payload, group_size=group_size, segments=segments)
    codes, scales = payload_parts(payload, x.shape[1], group_size, segments)
    start = group = 0
    for length in segments:
        alone = _payload(x[:, start : start + length], group_size)
        quantize_blockwise_reference(x[:, start : start + length], alone, group_size=group_size)
        c, s = payload_parts(alone, length, group_size)
        g = s.shape[1]
        assert torch.equal(codes[:, group * group_size : (group + g) * group_size], c)
        assert torch.equal(
            scales[:, group : group + g].view(torch.int32), s.contiguous().view(torch.int32)
        )
        start, group = start + length, group + g
    assert group == scales.shape[1]
    assert torch.count_nonzero(payload[:, codes.shape[1] + 4 * group :]) == 0
