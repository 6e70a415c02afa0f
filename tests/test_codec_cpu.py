"""The fast CPU codec path: bit for bit equal to the torch reference (hypothesis over shapes,
group sizes, block sizes, outliers, zeros, tiny values, NaN/Inf, both bit widths, every error
dtype, with and without error feedback, the decode-reduce too, foreign payload bytes), checked
against an independent fp64 formula of the quantiser, and the library's default on CPU."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_ext.kernels.codec_common as codec_common
import fsdp_ext.kernels.dequantize_reduce as dequantize_reduce
import fsdp_ext.kernels.quantize_ef as quantize_ef
from fsdp_ext import LoCoConfig, LoCoReduceScatter
from fsdp_ext.kernels import backend
from fsdp_ext.kernels.codec_common import payload_chunk_bytes
from fsdp_ext.kernels.cpu_native import ENV as NATIVE_ENV
from fsdp_ext.kernels.cpu_native import native_sender
from fsdp_ext.kernels.dequantize_reduce import (
    dequantize_reduce_from_payload_cpu,
    dequantize_reduce_from_payload_reference,
    dequantize_reduce_reference,
)
from fsdp_ext.kernels.quantize_ef import (
    quantize_ef_reference,
    quantize_ef_to_payload_cpu,
    quantize_ef_to_payload_reference,
)
from fsdp_ext.testing import run_distributed
from tests.codec_cases import error_state, from_chunks, gradients, one_row

# the fast CPU paths, run with the flat reference's arguments and results (the library calls
# only their payload entry points; the flat references are the spec)
quantize_ef_cpu = one_row(quantize_ef_to_payload_cpu)
dequantize_reduce_cpu = from_chunks(dequantize_reduce_from_payload_cpu)

ERROR_DTYPES = [None, torch.int8, torch.bfloat16, torch.float32]
MANY = settings(
    max_examples=150,
    deadline=None,
    # the block-size fixture is set explicitly by every example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so -0.0 differs from 0.0, and NaN payloads must match)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_VIEW.get(a.dtype)
    return torch.equal(a.view(view), b.view(view)) if view else torch.equal(a, b)


def _clone(t):
    return None if t is None else t.clone()


@pytest.fixture
def block_elements(request):
    """Patch the CPU path's block size, so small shapes cross block boundaries."""
    saved = codec_common.CPU_BLOCK_ELEMENTS
    yield lambda n: setattr(codec_common, "CPU_BLOCK_ELEMENTS", n)
    codec_common.CPU_BLOCK_ELEMENTS = saved


@pytest.fixture(params=["native", "torch"])
def sender(request, monkeypatch):
    """The CPU sender under test: C compiled on this machine, or the plain-torch path."""
    if request.param == "torch":
        monkeypatch.setattr(quantize_ef, "native_sender", lambda: None)
    elif native_sender() is None:
        pytest.skip("no C compiler here (or FSDP_EXT_NATIVE_CPU=0): the torch path is tested")
    return request.param


# block sizes in elements: one group of 64 or more per block, a few groups, the default
BLOCKS = st.sampled_from([64, 256, 1024, codec_common.CPU_BLOCK_ELEMENTS])


@MANY
@given(
    gradients((8, 32, 64, 128, 256), "tiles", subnormal=True),
    st.sampled_from(ERROR_DTYPES),
    st.sampled_from([4, 8]),
    st.sampled_from([0.0, 0.8, 0.95]),
    BLOCKS,
)
def test_quantize_ef_cpu_is_bit_exact(sender, block_elements, grad, error_dtype, bits, beta, block):
    block_elements(block)
    x, group_size, seed = grad
    e_ref, s_ref = error_state(error_dtype, x.numel(), group_size, seed)
    e_cpu, s_cpu = _clone(e_ref), _clone(s_ref)
    kw = dict(group_size=group_size, bits=bits, beta=beta)
    packed_ref, scales_ref = quantize_ef_reference(x, e_ref, s_ref, **kw)
    packed_cpu, scales_cpu = quantize_ef_cpu(x, e_cpu, s_cpu, **kw)
    assert bitwise_equal(packed_ref, packed_cpu)
    assert bitwise_equal(scales_ref, scales_cpu)
    if e_ref is not None:
        assert bitwise_equal(e_ref, e_cpu)
    if s_ref is not None:
        assert bitwise_equal(s_ref, s_cpu)


@MANY
@given(
    gradients((8, 32, 64, 128), "tiles", subnormal=True),
    st.integers(1, 4),
    st.integers(0, 300),
    st.integers(0, 5),
    st.sampled_from(ERROR_DTYPES),
    st.sampled_from([4, 8]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    BLOCKS,
)
def test_payload_paths_cpu_are_bit_exact(
    sender, block_elements, grad, rows, cut, row_gap, error_dtype, bits, out_dtype, block
):
    """Rows of any length (padded to whole groups inside), with a row stride wider than the
    row, codes and scales in one buffer, and the reduction written into a given output."""
    block_elements(block)
    x, group_size, seed = grad
    n = max(1, x.numel() // rows - cut)
    wide = torch.full((rows, n + row_gap), 3.0, dtype=x.dtype)
    wide[:, :n] = x.repeat(-(-rows * n // x.numel()))[: rows * n].view(rows, n)
    chunks = wide[:, :n]  # rows with a stride wider than the row
    groups = -(-n // group_size)
    e_ref, s_ref = error_state(error_dtype, rows * groups * group_size, group_size, seed)
    e_cpu, s_cpu = _clone(e_ref), _clone(s_ref)
    width = payload_chunk_bytes(groups, group_size, bits)
    p_ref = torch.full((rows, width), 0xAB, dtype=torch.uint8)
    p_cpu = p_ref.clone()
    kw = dict(group_size=group_size, bits=bits, beta=0.8)
    quantize_ef_to_payload_reference(chunks, p_ref, e_ref, s_ref, **kw)
    quantize_ef_to_payload_cpu(chunks, p_cpu, e_cpu, s_cpu, **kw)
    assert torch.equal(p_ref, p_cpu)
    if e_ref is not None:
        assert bitwise_equal(e_ref, e_cpu)
    if s_ref is not None:
        assert bitwise_equal(s_ref, s_cpu)
    out_ref = torch.full((n,), 7.0, dtype=out_dtype)
    out_cpu = out_ref.clone()
    kw = dict(group_size=group_size, bits=bits, out_scale=1 / 3)
    dequantize_reduce_from_payload_reference(p_ref, out_ref, **kw)
    dequantize_reduce_from_payload_cpu(p_ref, out_cpu, **kw)
    assert bitwise_equal(out_ref, out_cpu)


@st.composite
def foreign_payloads(draw):
    """Payload bytes no encoder wrote: every code, and scales that are negative, zero, -0.0,
    subnormal, huge, Inf or NaN."""
    group_size = draw(st.sampled_from([8, 32, 128]))
    bits = draw(st.sampled_from([4, 8]))
    chunks = draw(st.integers(0, 4))
    groups = draw(st.integers(1, 20))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    codes = torch.randint(0, 256, (chunks, groups * group_size * bits // 8), generator=gen)
    pool = torch.tensor(
        [0.0, -0.0, 1e-42, -3e-39, 1.0, -2.5, 3e38, float("inf"), float("-inf"), float("nan")]
    )
    picks = torch.randint(0, len(pool) + 3, (chunks, groups), generator=gen)
    scales = torch.where(
        picks < len(pool),
        pool[picks.clamp(max=len(pool) - 1)],
        torch.rand(chunks, groups, generator=gen) * 1e-3,
    )
    return codes.to(torch.uint8), scales, group_size, bits


@MANY
@given(
    foreign_payloads(),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from([1.0, 0.5, 1 / 3, -2.0, 1e-30]),
    BLOCKS,
)
def test_dequantize_reduce_cpu_is_bit_exact(block_elements, payload, out_dtype, out_scale, block):
    block_elements(block)
    codes, scales, group_size, bits = payload
    kw = dict(group_size=group_size, bits=bits, out_scale=out_scale, out_dtype=out_dtype)
    assert bitwise_equal(
        dequantize_reduce_reference(codes, scales, **kw), dequantize_reduce_cpu(codes, scales, **kw)
    )


@settings(MANY, max_examples=60)
@given(
    gradients((8, 32, 128), "tiles", subnormal=True),
    st.sampled_from([4, 8]),
    st.sampled_from([None, torch.float32]),
    st.sampled_from([0.0, 0.5, 0.8]),
    BLOCKS,
)
def test_quantize_ef_cpu_follows_the_fp64_formula(
    sender, block_elements, grad, bits, error_dtype, beta, block
):
    """An independent formula, in fp64 from the fp32 inputs: ``s = absmax(h) / qmax`` with
    ``h = x + e``; ``q = clamp(floor(h / s + 0.5), -qmax - 1, qmax)``; the nibble or byte is
    ``q + qmax + 1`` (element 2i low, 2i + 1 high); ``e <- beta e + (1 - beta)(h - q s)``; a
    group holding NaN/Inf is sent as ``q = 0`` with a NaN scale and its error is reset."""
    block_elements(block)
    x, group_size, seed = grad
    q_max = {4: 7, 8: 127}[bits]
    error, _ = error_state(error_dtype, x.numel(), group_size, seed)
    # h = g + e is one fp32 addition (the spec's arithmetic is fp32); the rest is fp64
    h = (x.float() if error is None else x.float() + error).double()
    error_before = _clone(error)
    packed, scales = quantize_ef_cpu(x, error, group_size=group_size, bits=bits, beta=beta)
    # unpack by hand
    b = packed.long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).view(-1) if bits == 4 else b
    q = (codes - (q_max + 1)).double().view(-1, group_size)
    h = h.view(-1, group_size)
    absmax = h.abs().amax(dim=1)
    finite = torch.isfinite(h).all(dim=1)
    s = scales.double()
    assert bool(s[~finite].isnan().all()) and bool((q[~finite] == 0).all())
    hf, qf, sf, af = h[finite], q[finite], s[finite], absmax[finite]
    # the scale is absmax / qmax rounded once to fp32 (absolutely, for subnormal scales)
    assert bool(((sf - af / q_max).abs() <= af / q_max * 2**-24 + 2**-150).all())
    # q is h / s rounded half up, within the fp32 rounding of h / s
    ratio = torch.where(sf[:, None] > 0, hf / sf[:, None], torch.zeros_like(hf))
    want = torch.floor(ratio + 0.5).clamp(-q_max - 1, q_max)
    near_tie = ((ratio + 0.5) - torch.round(ratio + 0.5)).abs() < 1e-5 * (1 + ratio.abs())
    assert bool(((qf == want) | near_tie).all())
    assert bool(((qf >= -q_max - 1) & (qf <= q_max)).all())
    # with a normal scale the code is symmetric: -qmax - 1 occurs only under subnormal scales
    assert bool((qf[sf >= 2**-126].abs() <= q_max).all())
    if error is not None:
        e0 = (error_before.double() if error_before is not None else 0).view(-1, group_size)
        e_new = beta * e0 + (1 - beta) * (h - q * s[:, None])
        got = error.double().view(-1, group_size)
        assert bool((got[~finite] == 0).all())
        tol = 1e-6 * (af[:, None] + e0[finite].abs()) + 1e-30
        assert bool(((got[finite] - e_new[finite]).abs() <= tol).all())


def test_cpu_path_is_the_default_on_cpu_and_the_reference_stays_selectable():
    cpu = torch.empty(0)
    assert backend.implementation(cpu, cpu_path=True) == "cpu"
    assert backend.implementation(cpu) == "reference"  # kernels without a CPU path
    with backend.use_backend("reference"):
        assert backend.implementation(cpu, cpu_path=True) == "reference"
    with backend.use_backend("cpu"):
        assert backend.implementation(cpu, cpu_path=True) == "cpu"
    bad = pytest.raises(ValueError, match="backend must be one of auto, triton, cpu, reference")
    with bad, backend.use_backend("fast"):
        pass


def _recording(fn, name, ran):
    def run(*args, **kwargs):
        ran.append(name)
        return fn(*args, **kwargs)

    return run


def _which_paths_run():
    """One LoCo reduce-scatter on 2 gloo ranks, recording the implementations the ops ran."""
    ran = []
    for table in (
        quantize_ef._QUANTIZE_EF_TO_PAYLOAD,
        dequantize_reduce._DEQUANTIZE_REDUCE_FROM_PAYLOAD,
    ):
        for name, fn in list(table.items()):
            table[name] = _recording(fn, name, ran)
    comm = LoCoReduceScatter(LoCoConfig(group_size=32))
    out = torch.empty(100)
    x = torch.randn(200, generator=torch.Generator().manual_seed(dist.get_rank()))
    comm(output_tensor=out, input_tensor=x, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    return ran


def test_library_runs_the_cpu_path_by_default():
    for ran in run_distributed(_which_paths_run, 2):
        assert ran == ["cpu", "cpu"]


def test_a_failed_native_build_warns_once_and_the_torch_path_runs(tmp_path):
    """A C compiler that fails (here ``CC=false``): one warning naming the cause and the
    switch, then the plain-torch sender, still bit-exact."""
    code = (
        "import warnings, torch\n"
        "from fsdp_ext.kernels.cpu_native import native_sender\n"
        "from fsdp_ext.kernels.quantize_ef import quantize_ef_reference\n"
        "from fsdp_ext.kernels.quantize_ef import quantize_ef_to_payload_cpu\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    assert native_sender() is None and native_sender() is None\n"
        "print(len(caught), caught[0].message)\n"
        "x = torch.randn(1024, generator=torch.Generator().manual_seed(0))\n"
        "p = torch.empty(1, 8 * (64 + 4), dtype=torch.uint8)\n"
        "quantize_ef_to_payload_cpu(x.view(1, -1), p, group_size=128)\n"
        "a, b = quantize_ef_reference(x, group_size=128)\n"
        "assert torch.equal(p[0, :512], a)\n"
        "assert torch.equal(p[0, 512:].view(torch.float32), b)\n"
    )
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop(NATIVE_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("1 the native CPU codec did not build")
    assert "FSDP_EXT_NATIVE_CPU=0" in done.stdout
    assert not list(tmp_path.rglob("*.so*"))  # nothing half-built left in the cache


@pytest.mark.parametrize("beta", [0.8, 0.95])
def test_int8_error_with_subnormal_scales_is_clamped_as_the_reference(sender, beta):
    """Error feedback whose per-group scale is subnormal (a long run's error decays towards
    zero): ``floor(e / s + 0.5)`` can then exceed 127, since ``s = fl(absmax / 127)`` rounds
    to a step of 2^-149, and the stored int8 code must be clamped as the reference clamps it,
    not wrap around. The example checks that the clamp bites, so the test can fail."""
    group_size, groups = 128, 96
    gen = torch.Generator().manual_seed(7)
    # codes up to a per-group bound, so some groups' updated error peaks at 128-190 steps
    bound = torch.randint(40, 128, (groups, 1), generator=gen)
    codes = (torch.rand(groups, group_size, generator=gen) * (2 * bound + 1)).floor() - bound
    codes = codes.to(torch.int8).view(-1)
    step = 2.0**-149
    scales = torch.randint(1, 4, (groups,), generator=gen).float() * step  # 1-3 steps
    x = torch.zeros(groups * group_size)
    kw = dict(group_size=group_size, bits=4, beta=beta)
    # the updated error in fp32 (same arithmetic, stored unrounded), to see the clamp bite
    e_fp32 = (codes.float().view(groups, -1) * scales.view(-1, 1)).view(-1)
    quantize_ef_reference(x, e_fp32, None, **kw)
    per_group = e_fp32.view(groups, -1)
    s = per_group.abs().amax(dim=1, keepdim=True) / 127
    unclamped = torch.floor(per_group / torch.where(s > 0, s, torch.ones_like(s)) + 0.5)
    assert int((unclamped.abs() > 127).sum()) > 0, "no code beyond 127: the clamp never bites"
    e_ref, s_ref = codes.clone(), scales.clone()
    quantize_ef_reference(x, e_ref, s_ref, **kw)
    e_cpu, s_cpu = codes.clone(), scales.clone()
    quantize_ef_cpu(x, e_cpu, s_cpu, **kw)
    assert int(e_ref.abs().max()) <= 127
    assert bitwise_equal(s_cpu, s_ref)
    assert torch.equal(e_cpu, e_ref), int((e_cpu != e_ref).sum())
