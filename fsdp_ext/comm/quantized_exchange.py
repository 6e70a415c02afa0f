"""The compressed reduce-scatter step shared by every LoCo comm: encode, all-to-all, reduce.

Single pass over gradient-sized data on each side:

- the sender encodes its ``[W, n]`` chunks (``h = g + e``, padding to whole groups done in
  the codec) straight into the all-to-all send buffer, one row per destination;
- the receiver decode-reduces the received buffer in place, writing straight into the
  caller's output tensor.

Nothing else touches gradient-sized memory: no padding copy, no ``cat``, no ``contiguous``,
no final copy (``tests/test_kernels_on_path.py`` counts it). The wire format is the
codec's (:mod:`fsdp_ext.comm.codec`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_ext.comm.codec import Codec
from fsdp_ext.comm.error_feedback import ErrorFeedback, ErrorSubset


def pad_columns(chunks: torch.Tensor, width: int) -> torch.Tensor:
    """``[W, n]`` -> contiguous ``[W, width]``, zero-padded, so no group straddles two chunks."""
    if chunks.shape[1] == width and chunks.is_contiguous():
        return chunks
    padded = chunks.new_zeros(chunks.shape[0], width)
    padded[:, : chunks.shape[1]] = chunks
    return padded


def encode_rows(
    rows: torch.Tensor, codec: Codec, feedback: ErrorFeedback | ErrorSubset | None
) -> torch.Tensor:
    """Encode ``[W, n]`` rows (with error feedback) into a new ``[W, payload_bytes(n)]`` payload.

    The feedback covers the padded rows (``W * codec.padded(n)`` elements).
    """
    num_rows, n = rows.shape
    state = None
    if feedback is not None:
        state = feedback.next(num_rows * codec.padded(n), rows.device)
    payload = torch.empty(num_rows, codec.payload_bytes(n), dtype=torch.uint8, device=rows.device)
    codec.encode(rows, payload, state)
    return payload


def quantized_reduce_scatter_into(
    output: torch.Tensor,
    chunks: torch.Tensor,
    group: dist.ProcessGroup,
    codec: Codec,
    feedback: ErrorFeedback | ErrorSubset | None,
    *,
    out_scale: float,
    defer: Callable[[dist.Work, Callable[[], None]], None] | None = None,
) -> int:
    """``chunks[r]`` goes to rank r of ``group``; this rank's reduction lands in ``output``.

    ``chunks`` is ``[W, n]`` with unit column stride (any ``n``) and ``output`` a contiguous
    ``[n]`` fp32 or bf16 tensor that receives ``out_scale * sum_w decode(encode(chunks_w))``.
    With ``defer``, the all-to-all is started and handed over with the decode that fills
    ``output`` (:class:`~fsdp_ext.comm.deferred.DeferredExchanges`); the encode, and with it
    the error feedback's update, happens in the call either way. Returns the bytes sent to
    peers.
    """
    payload = encode_rows(chunks, codec, feedback)
    received = torch.empty_like(payload)

    def decode() -> None:
        codec.decode_reduce(received, output, out_scale=out_scale)

    if defer is None:
        dist.all_to_all_single(received, payload, group=group)
        decode()
    else:
        defer(dist.all_to_all_single(received, payload, group=group, async_op=True), decode)
    return (chunks.shape[0] - 1) * payload.shape[1]


def plain_reduce_scatter_into(
    output: torch.Tensor, chunks: torch.Tensor, group: dist.ProcessGroup, *, out_scale: float
) -> int:
    """:func:`quantized_reduce_scatter_into` without the codec, for units whose payload
    would be larger than their values (:func:`~fsdp_ext.comm.codec.choose_wire`): the rows
    go as they are, and are summed as ``decode_reduce`` sums them (float32, row order, one
    multiplication by ``out_scale``). Returns the bytes sent to peers."""
    rows = chunks.contiguous()
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows, group=group)
    total = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
    for row in received:
        total += row.float()
    output.copy_(total * torch.tensor(out_scale, dtype=torch.float32))
    return (rows.shape[0] - 1) * rows.shape[1] * rows.element_size()


def quantized_reduce_scatter(
    chunks: torch.Tensor,
    group: dist.ProcessGroup,
    codec: Codec,
    feedback: ErrorFeedback | ErrorSubset | None,
    *,
    out_scale: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, int]:
    """``chunks[r]`` goes to rank r of ``group``; returns (this rank's reduced chunk, bytes sent).

    ``chunks`` is ``[W, n]``. The result is ``out_scale * sum_w decode(encode(chunks_w))`` in
    ``out_dtype``; :func:`quantized_reduce_scatter_into` writes it into a given tensor instead.
    """
    reduced = torch.empty(chunks.shape[1], dtype=out_dtype, device=chunks.device)
    sent = quantized_reduce_scatter_into(
        reduced, chunks, group, codec, feedback, out_scale=out_scale
    )
    return reduced, sent
