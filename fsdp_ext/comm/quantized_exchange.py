"""The compressed reduce-scatter step shared by every LoCo comm: quantise, all-to-all, reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.error_feedback import ErrorFeedback
from triton_kernels.dequantize_reduce import dequantize_reduce
from triton_kernels.quantize_ef import quantize_ef


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_columns(chunks: torch.Tensor, width: int) -> torch.Tensor:
    """``[W, n]`` -> contiguous ``[W, width]``, zero-padded, so no group straddles two chunks."""
    if chunks.shape[1] == width and chunks.is_contiguous():
        return chunks
    padded = chunks.new_zeros(chunks.shape[0], width)
    padded[:, : chunks.shape[1]] = chunks
    return padded


def quantize_to_payload(
    flat: torch.Tensor, num_chunks: int, config: LoCoConfig, feedback: ErrorFeedback | None
) -> torch.Tensor:
    """Quantise ``flat`` (with error feedback) into ``[num_chunks, codes + scale bytes]``."""
    error, error_scales = (None, None)
    if feedback is not None:
        error, error_scales = feedback.next(flat.numel(), flat.device)
    packed, scales = quantize_ef(
        flat,
        error,
        error_scales,
        group_size=config.group_size,
        bits=config.bits,
        beta=config.err_beta,
    )
    return torch.cat(
        [packed.view(num_chunks, -1), scales.view(num_chunks, -1).view(torch.uint8)], dim=1
    )


def split_payload(payload: torch.Tensor, config: LoCoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the concatenation in :func:`quantize_to_payload`: (codes, fp32 scales)."""
    per_group = config.group_size * config.bits // 8 + 4
    num_groups = payload.shape[1] // per_group
    code_bytes = payload.shape[1] - 4 * num_groups
    codes = payload[:, :code_bytes].contiguous()
    scales = payload[:, code_bytes:].contiguous().view(torch.float32)
    return codes, scales


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

    ``chunks`` is ``[W, n]`` with ``n`` a multiple of ``group_size``. The result is
    ``out_scale * sum_w deQ(Q(chunks_w + e_w))`` in ``out_dtype``.
    """
    num_chunks = chunks.shape[0]
    payload = quantize_to_payload(chunks.reshape(-1), num_chunks, config, feedback)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    codes, scales = split_payload(received, config)
    reduced = dequantize_reduce(
        codes,
        scales,
        group_size=config.group_size,
        bits=config.bits,
        out_scale=out_scale,
        out_dtype=out_dtype,
    )
    return reduced, (num_chunks - 1) * payload.shape[1]
