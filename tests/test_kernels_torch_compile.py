"""The kernels are custom ops (``torch.ops.fsdp_ext.*``) with fake implementations, so
``torch.compile(fullgraph=True)`` traces through them without a graph break and the compiled
function equals eager, in-place updates (error buffers, payload, output) included.

The ``aot_eager`` backend runs what matters for the registration (Dynamo, fake tensors,
functionalisation of the mutated arguments) without Inductor's C++ compile time; the ops
run the Triton kernels (interpreter) inside the compiled graph.
"""

import pytest
import torch

from fsdp_ext.kernels.backend import use_backend
from fsdp_ext.kernels.codec_common import payload_chunk_bytes
from fsdp_ext.kernels.dequantize_reduce import dequantize_reduce_from_payload
from fsdp_ext.kernels.permute_indices import permute_indices
from fsdp_ext.kernels.quantize_ef import quantize_ef_to_payload

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _compiled_equals_eager(fn, *args):
    eager_args = [a.clone() for a in args]
    compiled_args = [a.clone() for a in args]
    torch._dynamo.reset()
    with use_backend("triton"):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled_args)
    with use_backend("reference"):
        eager = fn(*eager_args)
    for a, b in zip([*eager_args, *eager], [*compiled_args, *compiled], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return eager


@pytest.mark.parametrize(("bits", "int8_error"), [(4, False), (8, True)])
def test_payload_ops_compile(bits, int8_error):
    """The codec's custom ops, their mutated arguments included: the error (and an int8
    error's scales), the payload and the output."""

    def exchange(rows, error, error_scales, payload, out):
        scales = error_scales if int8_error else None
        quantize_ef_to_payload(rows * 2, payload, error, scales, group_size=32, bits=bits, beta=0.8)
        dequantize_reduce_from_payload(payload, out, group_size=32, bits=bits, out_scale=0.5)
        return (out.sum(),)

    rows = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    error = torch.randint(-127, 128, (128,), dtype=torch.int8) if int8_error else torch.zeros(128)
    payload = torch.zeros(2, payload_chunk_bytes(2, 32, bits), dtype=torch.uint8)
    error_scales = torch.rand(4) * 0.01
    _compiled_equals_eager(exchange, rows, error, error_scales, payload, torch.zeros(50))


def test_permute_indices_compiles():
    def gather(x, counts):
        return (x[permute_indices(counts)] * 2,)

    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])
    (out,) = _compiled_equals_eager(gather, torch.arange(10.0), counts)
    # received rows by (rank, expert) blocks -> expert-major: e0 [0, 1, 5], e1 [6-9], e2 [2-4]
    assert out.tolist() == [0, 2, 10, 12, 14, 16, 18, 4, 6, 8]
