"""Deliberately broken kernels for ``tests/test_kernels_compile.py``: the compile check must
report each of them (never imported by the library): a compile error, a kernel without a
compile case, and the two patterns that held the LoCo kernels back on an H200."""

import triton
import triton.language as tl

from fsdp_ext.kernels.codec_common import CompileCase


@triton.jit
def _copy_with_runtime_arange_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # a copy of a plain copy kernel with one bug: tl.arange needs constexpr bounds, the
    # interpreter accepts a runtime one, the compiler does not
    offs = tl.program_id(0) * BLOCK + tl.arange(0, n)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def _kernel_without_compile_case(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)


def compile_cases():
    return [
        CompileCase(
            _copy_with_runtime_arange_kernel,
            {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": 128},
            num_warps=4,
        ),
        CompileCase(
            _divide_per_value_kernel,
            {"x_ptr": "*fp32", "s_ptr": "*fp32", "q_ptr": "*fp32"}
            | {"GROUP": "constexpr", "GROUPS": "constexpr"},
            {"GROUP": 128, "GROUPS": 16},
            num_warps=4,
            aligned=("x_ptr", "s_ptr", "q_ptr"),
            values=2048,
        ),
        CompileCase(
            _reduce_waiting_on_each_load_kernel,
            {"x_ptr": "*fp32", "out_ptr": "*fp32", "chunks": "i32", "stride": "i32"}
            | {"BLOCK": "constexpr"},
            {"BLOCK": 1024},
            num_warps=4,
            aligned=("x_ptr", "out_ptr", "stride"),
            values=1024,
        ),
    ]


@triton.jit
def _divide_per_value_kernel(x_ptr, s_ptr, q_ptr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    # the codec's quantiser as it was: one IEEE division per value (a reciprocal, its
    # refinement, a range check and a slow-path call each, in SASS)
    rows = tl.arange(0, GROUPS)
    at = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    q = tl.floor(tl.math.div_rn(tl.load(x_ptr + at), tl.load(s_ptr + rows)[:, None]) + 0.5)
    tl.store(q_ptr + at, q)


@triton.jit
def _reduce_waiting_on_each_load_kernel(x_ptr, out_ptr, chunks, stride, BLOCK: tl.constexpr):
    # the receiver's loop as it was: each iteration computes with the load it just issued
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, chunks):
        acc = acc + tl.load(x_ptr + c * stride + offs).to(tl.float32) * 0.5
    tl.store(out_ptr + offs, acc)
