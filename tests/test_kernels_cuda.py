"""On a CUDA device (``scripts/gpu-check.sh``): every compiled variant of the Triton kernels,
run for real, equals the torch reference on CPU bit for bit. Skipped without CUDA.

Run with ``TRITON_INTERPRET=0`` (gpu-check does), else the interpreter would run them.
"""

import itertools

import pytest
import torch

from fsdp_ext.kernels.codec_common import TILE_ELEMENTS, TRITON_GROUP_SIZES, payload_chunk_bytes
from fsdp_ext.kernels.dequantize_reduce import (
    dequantize_reduce_from_payload_reference,
    dequantize_reduce_from_payload_triton,
)
from fsdp_ext.kernels.permute_indices import permute_indices_reference, permute_indices_triton
from fsdp_ext.kernels.quantize_blockwise import TILE_ELEMENTS as BLOCKWISE_TILE
from fsdp_ext.kernels.quantize_blockwise import TRITON_GROUP_SIZES as BLOCKWISE_GROUP_SIZES
from fsdp_ext.kernels.quantize_blockwise import (
    dequantize_blockwise_reference,
    dequantize_blockwise_triton,
    payload_row_bytes,
    quantize_blockwise_reference,
    quantize_blockwise_triton,
    unit_payload_row_bytes,
)
from fsdp_ext.kernels.quantize_ef import (
    quantize_ef_reference,
    quantize_ef_to_payload_reference,
    quantize_ef_to_payload_triton,
)
from tests.codec_cases import one_row

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (scripts/gpu-check.sh runs it)", allow_module_level=True)
ERROR_DTYPES = [None, torch.int8, torch.bfloat16, torch.float32]


def _same(a, b):
    a, b = a.cpu(), b.cpu()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(((a == b) | (a.isnan() & b.isnan())).all())
    )


def _gradient(numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(numel, generator=gen)
        * torch.logspace(-3, 3, numel)[torch.randperm(numel, generator=gen)]
    )
    x[7] = float("nan")
    x[-3] = float("inf")
    x[numel // 2 : numel // 2 + 300] = 0
    return x.to(dtype)


def _error(dtype, numel, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype is None:
        return None, None
    if dtype == torch.int8:
        return torch.randint(-127, 128, (numel,), generator=gen, dtype=torch.int8), torch.rand(
            numel // group_size, generator=gen
        ) * 0.01
    return (torch.randn(numel, generator=gen) * 0.1).to(dtype), None


def _cuda(t):
    return None if t is None else t.cuda()


@pytest.mark.parametrize(
    ("group_size", "bits", "error_dtype", "x_dtype"),
    list(
        itertools.product(TRITON_GROUP_SIZES, [4, 8], ERROR_DTYPES, [torch.float32, torch.bfloat16])
    ),
)
def test_quantize_ef_cuda_equals_reference(group_size, bits, error_dtype, x_dtype):
    """The payload kernel on one row, against the flat reference (the spec)."""
    numel = (2 * TILE_ELEMENTS["quantize_ef"] // group_size + 3) * group_size  # crosses tiles
    x = _gradient(numel, x_dtype, group_size + bits)
    e_ref, s_ref = _error(error_dtype, numel, group_size, 1)
    e_gpu, s_gpu = _cuda(e_ref), _cuda(s_ref)
    kw = dict(group_size=group_size, bits=bits, beta=0.8)
    ref = quantize_ef_reference(x, e_ref, s_ref, **kw)
    gpu = one_row(quantize_ef_to_payload_triton)(x.cuda(), e_gpu, s_gpu, **kw)
    assert all(_same(a, b) for a, b in zip(ref, gpu, strict=True))
    for a, b in ((e_ref, e_gpu), (s_ref, s_gpu)):
        assert a is None or _same(a, b)


@pytest.mark.parametrize(
    ("group_size", "bits", "out_dtype"),
    list(itertools.product(TRITON_GROUP_SIZES, [4, 8], [torch.float32, torch.bfloat16])),
)
def test_payload_path_cuda_equals_reference(group_size, bits, out_dtype):
    rows, n = 3, TILE_ELEMENTS["dequantize_reduce"] + 77  # padded rows crossing tiles
    chunks = _gradient(rows * n, torch.float32, 5).view(rows, n)
    groups = -(-n // group_size)
    e_ref, s_ref = _error(torch.int8, rows * groups * group_size, group_size, 2)
    e_gpu, s_gpu = _cuda(e_ref), _cuda(s_ref)
    p_ref = torch.zeros(rows, payload_chunk_bytes(groups, group_size, bits), dtype=torch.uint8)
    p_gpu = p_ref.cuda()
    kw = dict(group_size=group_size, bits=bits, beta=0.8)
    quantize_ef_to_payload_reference(chunks, p_ref, e_ref, s_ref, **kw)
    quantize_ef_to_payload_triton(chunks.cuda(), p_gpu, e_gpu, s_gpu, **kw)
    assert _same(p_ref, p_gpu) and _same(e_ref, e_gpu) and _same(s_ref, s_gpu)
    out_ref = torch.empty(n, dtype=out_dtype)
    out_gpu = out_ref.cuda()
    kw = dict(group_size=group_size, bits=bits, out_scale=1 / 3)
    dequantize_reduce_from_payload_reference(p_ref, out_ref, **kw)
    dequantize_reduce_from_payload_triton(p_gpu, out_gpu, **kw)
    assert _same(out_ref, out_gpu)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_permute_indices_cuda_equals_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 500, (8, 40), generator=gen)
    counts[3] = 0
    counts = counts.to(dtype)
    assert torch.equal(
        permute_indices_reference(counts), permute_indices_triton(counts.cuda()).cpu()
    )


WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weights(rows, n, group_size, dtype, seed):
    """Rows crossing tiles with a partial last group; a NaN group, an Inf group, a zero
    group and an outlier, as qwZ gathers them."""
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(rows, n, generator=gen)
        * torch.logspace(-2, 2, n)[torch.randperm(n, generator=gen)]
    )
    x[0, 3] = float("nan")
    x[1, group_size + 1] = float("-inf")
    x[2, 2 * group_size : 3 * group_size] = 0
    x[0, -2] = 5e3
    return x.to(dtype)


@pytest.mark.parametrize(
    ("group_size", "dtype", "out_dtype"),
    list(itertools.product(BLOCKWISE_GROUP_SIZES, WEIGHT_DTYPES, WEIGHT_DTYPES)),
)
def test_blockwise_cuda_equals_reference(group_size, dtype, out_dtype):
    """qwZ's weight kernels on CUDA against the references run on the CPU (a reference run
    on CUDA would divide by 127 through a reciprocal and differ in the last bit)."""
    rows, n = 3, 2 * BLOCKWISE_TILE + group_size + 5
    x = _weights(rows, n, group_size, dtype, group_size)
    p_ref = torch.full((rows, payload_row_bytes(n, group_size)), 0xAB, dtype=torch.uint8)
    p_gpu = p_ref.cuda()
    quantize_blockwise_reference(x, p_ref, group_size=group_size)
    quantize_blockwise_triton(x.cuda(), p_gpu, group_size=group_size)
    assert _same(p_ref, p_gpu)  # codes, padding codes and scales, NaN bits included
    out_ref = torch.full((rows, n), 7.0, dtype=out_dtype)
    out_gpu = out_ref.cuda()
    dequantize_blockwise_reference(p_ref, out_ref, group_size=group_size)
    dequantize_blockwise_triton(p_ref.cuda(), out_gpu, group_size=group_size)
    assert _same(out_ref, out_gpu)


@pytest.mark.parametrize(
    ("group_size", "dtype", "aligned"),
    list(
        itertools.product(
            BLOCKWISE_GROUP_SIZES,
            [torch.float32, torch.bfloat16, torch.float16],
            [True, False],
        )
    ),
)
def test_blockwise_unit_cuda_equals_reference(group_size, dtype, aligned):
    """qwZ's one-launch unit kernels on CUDA against the CPU reference: 16-aligned segments
    (vector loads) and unaligned ones, empty and tile-crossing pieces, non-finite groups."""
    segments = [4096 * 3 + 16, 0, 160, 2 * group_size + 48, 7 * 4096]
    if not aligned:
        segments = [s + 3 if s else 0 for s in segments]
    n = sum(segments)
    x = _gradient(3 * n, torch.float32, seed=group_size).view(3, n).to(dtype)
    width = unit_payload_row_bytes(segments, group_size)
    want = torch.full((3, width), 0xAB, dtype=torch.uint8)
    quantize_blockwise_reference(x, want, group_size=group_size, segments=segments)
    got = torch.full((3, width), 0x11, dtype=torch.uint8, device="cuda")
    quantize_blockwise_triton(x.cuda(), got, group_size=group_size, segments=segments)
    assert torch.equal(got.cpu(), want)
    back = torch.empty(3, n, dtype=dtype)
    dequantize_blockwise_reference(want, back, group_size=group_size, segments=segments)
    back_cuda = torch.empty(3, n, dtype=dtype, device="cuda")
    dequantize_blockwise_triton(want.cuda(), back_cuda, group_size=group_size, segments=segments)
    assert _same(back_cuda, back)


def test_one_division_per_group_rounds_as_ieee_division_on_cuda():
    """The codec's division (one IEEE division per group, then multiply and FMA) on the GPU
    against IEEE division on the CPU, on 64M pairs: ties, neighbours, subnormals."""
    from tests.test_codec_division import COLS, ROWS, _cases, _divide_kernel

    for seed in range(4):
        s, h = _cases(256, seed)
        q = torch.empty(h.shape, dtype=torch.float32, device="cuda")
        _divide_kernel[(256,)](
            torch.from_numpy(h).cuda(), torch.from_numpy(s).cuda(), q, ROWS, COLS
        )
        want = torch.floor(torch.from_numpy(h) / torch.from_numpy(s)[:, None] + 0.5)
        assert torch.equal(q.cpu().view(torch.int32), want.view(torch.int32)), seed
