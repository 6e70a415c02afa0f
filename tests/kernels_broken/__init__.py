"""Deliberately broken kernels for ``tests/test_kernels_compile.py``: the compile check must
report each of them (never imported by the library)."""

import triton
import triton.language as tl

from triton_kernels.codec_common import CompileCase


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
        )
    ]
