"""The gradient codec kernels: Triton (interpreted on CPU) against the torch reference, and
the codec's own guarantees (round-trip bound, error bookkeeping, non-finite groups).

The library calls the kernels through their payload entry points only; the flat references
are the spec each payload path is held to (``tests/codec_cases.py``: ``one_row``,
``from_chunks``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_ext.kernels.codec_common import (
    TRITON_GROUP_SIZES,
    payload_chunk_bytes,
    qmax,
)
from fsdp_ext.kernels.dequantize_reduce import (
    dequantize_reduce_from_payload,
    dequantize_reduce_from_payload_reference,
    dequantize_reduce_from_payload_triton,
    dequantize_reduce_reference,
    dequantize_reference,
)
from fsdp_ext.kernels.quantize_ef import (
    quantize_ef_reference,
    quantize_ef_to_payload,
    quantize_ef_to_payload_reference,
    quantize_ef_to_payload_triton,
)
from tests.codec_cases import (
    PAYLOAD_GROUP_SIZES,
    error_state,
    from_chunks,
    gradients,
    one_row,
    same,
)

# the library's entry points (the dispatching custom ops) and the Triton launchers, each run
# with the flat reference's arguments and results
quantize_ef = one_row(quantize_ef_to_payload)
dequantize_reduce = from_chunks(dequantize_reduce_from_payload)
quantize_ef_triton = one_row(quantize_ef_to_payload_triton)
dequantize_reduce_triton = from_chunks(dequantize_reduce_from_payload_triton)

# numpy, under the Triton interpreter, warns on the NaN arithmetic of non-finite groups
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered"),
]

ERROR_DTYPES = [None, torch.int8, torch.bfloat16, torch.float32]
FEW = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@pytest.mark.usefixtures("triton_interpreter_fma")
@FEW
@given(
    gradients(TRITON_GROUP_SIZES, "tiles"),
    st.sampled_from(ERROR_DTYPES),
    st.sampled_from([4, 8]),
    st.sampled_from([0.0, 0.8, 0.95]),
)
def test_quantize_ef_triton_matches_reference(grad, error_dtype, bits, beta):
    x, group_size, seed = grad
    e_ref, s_ref = error_state(error_dtype, x.numel(), group_size, seed)
    e_tri = None if e_ref is None else e_ref.clone()
    s_tri = None if s_ref is None else s_ref.clone()
    kw = dict(group_size=group_size, bits=bits, beta=beta)
    packed_ref, scales_ref = quantize_ef_reference(x, e_ref, s_ref, **kw)
    packed_tri, scales_tri = quantize_ef_triton(x, e_tri, s_tri, **kw)
    assert torch.equal(packed_ref, packed_tri)
    assert same(scales_ref, scales_tri)
    if e_ref is not None:
        assert same(e_ref, e_tri)
    if s_ref is not None:
        assert same(s_ref, s_tri)


@pytest.mark.usefixtures("triton_interpreter_fma")
@FEW
@given(
    gradients(TRITON_GROUP_SIZES, "tiles"),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from([1.0, 0.5, 1 / 3]),
)
def test_dequantize_reduce_triton_matches_reference(grad, chunks, bits, out_dtype, out_scale):
    x, group_size, _ = grad
    rows = [
        quantize_ef_reference(x.roll(i), group_size=group_size, bits=bits) for i in range(chunks)
    ]
    packed = torch.stack([p for p, _ in rows])
    scales = torch.stack([s for _, s in rows])
    kw = dict(group_size=group_size, bits=bits, out_scale=out_scale, out_dtype=out_dtype)
    ref = dequantize_reduce_reference(packed, scales, **kw)
    tri = dequantize_reduce_triton(packed, scales, **kw)
    assert same(ref, tri)


@pytest.mark.usefixtures("triton_interpreter_fma")
@FEW
@given(
    gradients(TRITON_GROUP_SIZES, "tiles"),
    st.integers(1, 3),
    st.integers(0, 200),
    st.sampled_from(ERROR_DTYPES),
    st.sampled_from([4, 8]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_payload_kernels_match_reference(grad, rows, cut, error_dtype, bits, out_dtype):
    """The all-to-all entry points: rows of any length (padded inside the kernel), codes and
    scales written into one buffer, and the reduction written into a given output."""
    x, group_size, seed = grad
    n = max(1, x.numel() // rows - cut)  # usually not a multiple of group_size
    chunks = x[: rows * n].view(rows, n)
    groups = -(-n // group_size)
    e_ref, s_ref = error_state(error_dtype, rows * groups * group_size, group_size, seed)
    e_tri = None if e_ref is None else e_ref.clone()
    s_tri = None if s_ref is None else s_ref.clone()
    width = payload_chunk_bytes(groups, group_size, bits)
    p_ref = torch.full((rows, width), 0xAB, dtype=torch.uint8)
    p_tri = p_ref.clone()
    kw = dict(group_size=group_size, bits=bits, beta=0.8)
    quantize_ef_to_payload_reference(chunks, p_ref, e_ref, s_ref, **kw)
    quantize_ef_to_payload_triton(chunks, p_tri, e_tri, s_tri, **kw)
    assert torch.equal(p_ref, p_tri)
    if e_ref is not None:
        assert same(e_ref, e_tri)
    if s_ref is not None:
        assert same(s_ref, s_tri)
    out_ref = torch.full((n,), 7.0, dtype=out_dtype)
    out_tri = out_ref.clone()
    kw = dict(group_size=group_size, bits=bits, out_scale=0.25)
    dequantize_reduce_from_payload_reference(p_ref, out_ref, **kw)
    dequantize_reduce_from_payload_triton(p_ref, out_tri, **kw)
    assert same(out_ref, out_tri)


@FEW
@given(gradients(PAYLOAD_GROUP_SIZES), st.sampled_from([4, 8]))
def test_round_trip_error_at_most_half_a_step(grad, bits):
    x, group_size, _ = grad
    packed, scales = quantize_ef(x, group_size=group_size, bits=bits)
    back = dequantize_reduce(
        packed.view(1, -1), scales.view(1, -1), group_size=group_size, bits=bits
    ).view(-1, group_size)
    h = x.float().view(-1, group_size)
    finite = torch.isfinite(h).all(dim=1)
    # scale/2 of exact arithmetic, plus the fp32 rounding of q * s and of h / s
    bound = scales.view(-1, 1) / 2 * (1 + 2**-20) + h.abs() * 2**-22
    err = (back - h).abs()
    assert bool((err[finite] <= bound[finite]).all()), float((err - bound)[finite].max())
    # a group holding NaN/Inf dequantises to non-finite everywhere, never a finite value
    assert not torch.isfinite(back[~finite]).any()


@FEW
@given(gradients(PAYLOAD_GROUP_SIZES), st.sampled_from([4, 8]))
def test_beta_zero_error_is_the_residual_exactly(grad, bits):
    x, group_size, _ = grad
    error = torch.zeros(x.numel())
    packed, scales = quantize_ef(x, error, group_size=group_size, bits=bits, beta=0.0)
    deq = dequantize_reference(
        packed.view(1, -1), scales.view(1, -1), group_size=group_size, bits=bits
    ).view(-1)
    h = x.float()
    finite = torch.isfinite(h.view(-1, group_size)).all(dim=1).repeat_interleave(group_size)
    # bookkeeping: e == h - deQ(q) exactly, so h == deQ(q) + e up to one fp32 rounding
    assert torch.equal(error[finite], (h - deq)[finite])
    assert torch.allclose((deq + error)[finite], h[finite], rtol=2**-23, atol=0)
    # the error of a non-finite group is reset
    assert bool((error[~finite] == 0).all())


def test_error_feedback_accumulates_across_calls():
    """h = g + e: the second call quantises the gradient plus the stored error."""
    g = torch.linspace(-1, 1, 64)
    error = torch.zeros(64)
    quantize_ef(g, error, group_size=32, beta=0.0)
    first = error.clone()
    packed, scales = quantize_ef(g, error, group_size=32, beta=0.0)
    expected_packed, expected_scales = quantize_ef(g + first, group_size=32)
    assert torch.equal(packed, expected_packed) and torch.equal(scales, expected_scales)


@pytest.mark.parametrize("error_dtype", [torch.int8, torch.bfloat16])
def test_compact_error_storage_tracks_fp32_error(error_dtype):
    g = torch.randn(256, generator=torch.Generator().manual_seed(0))
    e32 = torch.zeros(256)
    e = torch.zeros(256, dtype=error_dtype)
    scales = torch.zeros(2) if error_dtype == torch.int8 else None
    quantize_ef(g, e32, group_size=128, beta=0.5)
    quantize_ef(g, e, scales, group_size=128, beta=0.5)
    decoded = e.float() * (scales.repeat_interleave(128) if scales is not None else 1)
    step = e32.abs().max() / (127 if error_dtype == torch.int8 else 2**7)
    assert (decoded - e32).abs().max() <= step


def test_nibble_layout_is_documented_one():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0] + [0.0] * 28)
    packed, scales = quantize_ef(x, group_size=32)
    assert scales[0] == 1.0
    # element 2i -> low nibble, 2i + 1 -> high nibble, value q stored as q + 8
    assert packed[0] == (7 + 8) | ((-7 + 8) << 4)
    assert packed[1] == (0 + 8) | ((1 + 8) << 4)
    assert qmax(4) == 7 and qmax(8) == 127


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(group_size=48), "group_size"),
        (dict(group_size=32, bits=3), "bits"),
        (dict(group_size=32, error=torch.zeros(64, dtype=torch.int8)), "error_scales"),
        (dict(group_size=32, error=torch.zeros(64, dtype=torch.float16)), "error.dtype"),
    ],
)
def test_quantize_ef_rejects_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_ef(torch.zeros(64), **kwargs)


def _loco_fp64(grads, beta, group_size, reset_interval=None):
    """LoCo re-derived by hand in fp64: h = g + e, 4-bit absmax, e <- beta e + (1-beta)(h - deQ).

    Independent of the library: returns, per step, what is sent (deQ) and the error after it.
    """
    e = torch.zeros(grads.shape[1], dtype=torch.float64)
    sent, errors, half_steps = [], [], []
    for t, g in enumerate(grads.double()):
        if reset_interval and t and t % reset_interval == 0:
            e = torch.zeros_like(e)
        h = (g + e).view(-1, group_size)
        s = h.abs().amax(dim=1, keepdim=True) / 7
        q = torch.floor(h / torch.where(s > 0, s, 1) + 0.5).clamp(-8, 7)
        d = (q * s).view(-1)
        e = beta * e + (1 - beta) * (h.view(-1) - d)
        sent.append(d)
        errors.append(e.clone())
        half_steps.append(float(s.max()) / 2)
    return sent, errors, half_steps


def test_beta_point_eight_matches_fp64_derivation_and_running_mean_bound():
    """beta = 0.8 over many steps: what is sent and the error follow the fp64 formula, and the
    running mean of what is sent approaches g as C / ((1 - beta) T), C = max half-step."""
    beta, group = 0.8, 32
    g = torch.randn(4 * group, generator=torch.Generator().manual_seed(5))
    g[7] = 9.0  # an outlier, so small entries are badly quantised without feedback
    steps = 128
    grads = g.expand(steps, -1)
    sent64, errors64, half_steps = _loco_fp64(grads, beta, group)
    error = torch.zeros_like(g)
    total = torch.zeros_like(g, dtype=torch.float64)
    for t in range(steps):
        packed, scales = quantize_ef(g, error, group_size=group, beta=beta)
        deq = dequantize_reference(
            packed.view(1, -1), scales.view(1, -1), group_size=group, bits=4
        ).view(-1)
        total += deq.double()
        c_now = max(half_steps[: t + 1])
        # fp32 arithmetic vs fp64: same codes, values within fp32 rounding
        assert torch.allclose(deq.double(), sent64[t], rtol=1e-5, atol=1e-6), t
        drift = float((error.double() - errors64[t]).abs().max())
        assert drift <= 1e-5 * c_now, (t, drift)
        if t + 1 in (8, 32, 128):
            c = max(half_steps[: t + 1])
            gap = float((total / (t + 1) - g.double()).abs().max())
            assert gap <= c / ((1 - beta) * (t + 1)) * (1 + 1e-4), (t + 1, gap, c)
    # without error feedback the same gradient keeps a fixed bias far above that bound
    packed, scales = quantize_ef(g, group_size=group)
    plain = dequantize_reference(packed.view(1, -1), scales.view(1, -1), group_size=group, bits=4)
    assert float((plain.view(-1) - g).abs().max()) > 20 * c / ((1 - beta) * steps)


def test_error_resets_exactly_every_reset_interval_reductions():
    """The library's error buffer, driven reduction by reduction, is zeroed before reductions
    reset_interval, 2 * reset_interval, ... and only then (checked against the fp64 model)."""
    from fsdp_ext.comm.absmax_codec import AbsmaxCodec, LoCoConfig
    from fsdp_ext.comm.error_feedback import ErrorFeedback
    from fsdp_ext.comm.quantized_exchange import encode_rows

    interval, group = 3, 32
    config = LoCoConfig(
        group_size=group, err_beta=0.5, reset_interval=interval, error_dtype=torch.float32
    )
    feedback = ErrorFeedback(AbsmaxCodec.from_config(config), config.reset_interval)
    gen = torch.Generator().manual_seed(9)
    grads = torch.randn(10, 2 * group, generator=gen)
    _, errors64, _ = _loco_fp64(grads, 0.5, group, reset_interval=interval)
    _, never_reset, _ = _loco_fp64(grads, 0.5, group)
    for t, g in enumerate(grads):
        encode_rows(g.clone().view(1, -1), AbsmaxCodec.from_config(config), feedback)
        assert torch.allclose(feedback.error.double(), errors64[t], rtol=1e-4, atol=1e-6), t
        if t >= interval:  # from the first reset on, the history differs from no reset
            assert not torch.allclose(feedback.error.double(), never_reset[t], atol=1e-3), t
    assert feedback.reductions == 10
