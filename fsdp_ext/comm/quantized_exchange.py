"""The compressed reduce-scatter step shared by every LoCo comm: quantise, all-to-all, reduce.

Single pass over gradient-sized data on each side:

- the sender quantises its ``[W, n]`` chunks (``h = g + e``, padding to whole groups done in
  the kernel) straight into the all-to-all send buffer, destination-major, codes then scales;
- the receiver dequantise-reduces the received buffer in place, writing straight into the
  caller's output tensor.

Nothing else touches gradient-sized memory: no padding copy, no ``cat``, no ``contiguous``,
no final copy (``tests/test_kernels_on_path.py`` counts it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.error_feedback import ErrorFeedback
from triton_kernels.codec_common import payload_chunk_bytes
from triton_kernels.dequantize_reduce import dequantize_reduce_from_payload
from triton_kernels.quantize_ef import quantize_ef_to_payload


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_columns(chunks: torch.Tensor, width: int) -> torch.Tensor:
    """``[W, n]`` -> contiguous ``[W, width]``, zero-padded, so no group straddles two chunks."""
    if chunks.shape[1] == width and chunks.is_contiguous():
        return chunks
    padded = chunks.new_zeros(chunks.shape[0], width)
    padded[:, : chunks.shape[1]] = chunks
    return padded


def quantize_rows_to_payload(
    rows: torch.Tensor, config: LoCoConfig, feedback: ErrorFeedback | None
) -> torch.Tensor:
    """Quantise ``[W, n]`` rows (with error feedback) into a new ``[W, chunk_bytes]`` payload.

    Each row is padded with zeros to whole groups inside the kernel; the error buffer covers
    the padded rows (``W * round_up(n, group_size)`` elements).
    """
    num_rows, n = rows.shape
    groups = -(-n // config.group_size)
    error, error_scales = (None, None)
    if feedback is not None:
        error, error_scales = feedback.next(num_rows * groups * config.group_size, rows.device)
    payload = torch.empty(
        num_rows,
        payload_chunk_bytes(groups, config.group_size, config.bits),
        dtype=torch.uint8,
        device=rows.device,
    )
    quantize_ef_to_payload(
        rows,
        payload,
        error,
        error_scales,
        group_size=config.group_size,
        bits=config.bits,
        beta=config.err_beta,
    )
    return payload


def quantize_to_payload(
    flat: torch.Tensor, num_chunks: int, config: LoCoConfig, feedback: ErrorFeedback | None
) -> torch.Tensor:
    """Quantise ``flat`` (with error feedback) into ``[num_chunks, codes + scale bytes]``."""
    return quantize_rows_to_payload(flat.view(num_chunks, -1), config, feedback)


def split_payload(payload: torch.Tensor, config: LoCoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the layout of :func:`quantize_to_payload`: (codes, fp32 scales)."""
    per_group = config.group_size * config.bits // 8 + 4
    num_groups = payload.shape[1] // per_group
    code_bytes = payload.shape[1] - 4 * num_groups
    codes = payload[:, :code_bytes].contiguous()
    scales = payload[:, code_bytes:].contiguous().view(torch.float32)
    return codes, scales


def quantized_reduce_scatter_into(
    output: torch.Tensor,
    chunks: torch.Tensor,
    group: dist.ProcessGroup,
    config: LoCoConfig,
    feedback: ErrorFeedback | None,
    *,
    out_scale: float,
) -> int:
    """``chunks[r]`` goes to rank r of ``group``; this rank's reduction lands in ``output``.

    ``chunks`` is ``[W, n]`` with unit column stride (any ``n``; rows are padded to whole
    groups inside the kernel) and ``output`` a contiguous ``[n]`` fp32 or bf16 tensor that
    receives ``out_scale * sum_w deQ(Q(chunks_w + e_w))``. Returns the bytes sent to peers.
    """
    payload = quantize_rows_to_payload(chunks, config, feedback)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    dequantize_reduce_from_payload(
        received, output, group_size=config.group_size, bits=config.bits, out_scale=out_scale
    )
    return (chunks.shape[0] - 1) * payload.shape[1]


def quantized_reduce_scatter(
    chunks: torch.Tensor,
    group: dist.ProcessGroup,
    config: LoCoConfig,
    feedback: ErrorFeedback | None,
    *,
    out_scale: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, int]:
    """``chunks[r]`` goes to rank r of ``group``; returns (this rank's reduced chunk, bytes sent).

    ``chunks`` is ``[W, n]``. The result is ``out_scale * sum_w deQ(Q(chunks_w + e_w))`` in
    ``out_dtype``; :func:`quantized_reduce_scatter_into` writes it into a given tensor instead.
    """
    reduced = torch.empty(chunks.shape[1], dtype=out_dtype, device=chunks.device)
    sent = quantized_reduce_scatter_into(
        reduced, chunks, group, config, feedback, out_scale=out_scale
    )
    return reduced, sent
