"""Gather indices that put all-to-all-received tokens into expert-major order.

After the dispatch all-to-all, a rank holds its tokens grouped by *source rank*, and
within each source rank by local expert: blocks ``(r, e)`` laid out row-major over a
``counts[num_ranks, experts_per_rank]`` table. The grouped expert compute wants them
grouped by *expert*, and within each expert by source rank: blocks ``(e, r)``.

``permute_indices(counts)[i]`` is the received-buffer row that goes to row ``i`` of the
expert-major buffer, so ``x[permute_indices(counts)]`` does the reorder. A zero count is a
legal, empty block. Same contract as torchtitan's ``generate_permute_indices`` without
the alignment padding (our expert compute loops over experts and needs none).
"""

from __future__ import annotations

import torch

from triton_kernels import backend
from triton_kernels.codec_common import CompileCase, launch_options, tl, triton

# Fixed block sizes: the kernel has one compiled variant per counts dtype, whatever the
# number of ranks and experts.
SCAN_BLOCK = 1024
FILL_BLOCK = 128


def _check_counts(counts: torch.Tensor) -> None:
    if not isinstance(counts, torch.Tensor) or counts.dim() != 2:
        raise ValueError(
            f"counts must be a 2-D [num_ranks, experts_per_rank] tensor, got {counts!r}"
        )
    if counts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"counts must be int32 or int64, got {counts.dtype}")


def permute_indices_reference(counts: torch.Tensor) -> torch.Tensor:
    """The spec, in vectorised torch: int64 indices of length ``counts.sum()``."""
    _check_counts(counts)
    counts = counts.to(torch.int64)
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    src_start = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    by_expert = counts.t().flatten()  # blocks in destination order (e, r)
    total = int(by_expert.sum())
    block = torch.repeat_interleave(torch.arange(by_expert.numel()), by_expert)
    dst_start = by_expert.cumsum(0) - by_expert
    offset_in_block = torch.arange(total) - dst_start[block]
    return src_start.t().flatten()[block] + offset_in_block


if triton is not None:

    @triton.jit
    def _permute_indices_kernel(
        counts_ptr,
        out_ptr,
        num_ranks,
        experts_per_rank,
        SCAN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per local expert: it writes that expert's contiguous output segment.
        expert = tl.program_id(0)
        num_blocks = num_ranks * experts_per_rank
        # Destination start: every token of a lower-numbered expert comes first.
        dst = tl.zeros((), tl.int64)
        for base in range(0, num_blocks, SCAN):
            flat = base + tl.arange(0, SCAN)  # row-major block id r * E + e
            c = tl.load(counts_ptr + flat, mask=flat < num_blocks, other=0).to(tl.int64)
            dst += tl.sum(tl.where((flat % experts_per_rank) < expert, c, 0), axis=0)
        for rank in range(num_ranks):
            block_id = rank * experts_per_rank + expert
            src = tl.zeros((), tl.int64)
            for base in range(0, block_id, SCAN):
                flat = base + tl.arange(0, SCAN)
                c = tl.load(counts_ptr + flat, mask=flat < block_id, other=0).to(tl.int64)
                src += tl.sum(c, axis=0)
            count = tl.load(counts_ptr + block_id).to(tl.int64)
            for start in range(0, count, BLOCK):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(out_ptr + dst + offs, src + offs, mask=offs < count)
            dst += count


def compile_cases() -> list[CompileCase]:
    """The launcher's variants: one per counts dtype (block sizes are fixed)."""
    return [
        CompileCase(
            _permute_indices_kernel,
            {
                "counts_ptr": counts_type,
                "out_ptr": "*i64",
                "num_ranks": "i32",
                "experts_per_rank": "i32",
                "SCAN": "constexpr",
                "BLOCK": "constexpr",
            },
            {"SCAN": SCAN_BLOCK, "BLOCK": FILL_BLOCK},
            num_warps=4,
            aligned=("counts_ptr", "out_ptr"),
        )
        for counts_type in ("*i32", "*i64")
    ]


def permute_indices_triton(counts: torch.Tensor) -> torch.Tensor:
    """Triton launcher; same contract as :func:`permute_indices_reference`."""
    if triton is None:
        raise RuntimeError("permute_indices_triton needs triton installed")
    _check_counts(counts)
    counts = counts.contiguous()
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    num_ranks, experts_per_rank = counts.shape
    total = int(counts.sum())
    out = torch.empty(total, dtype=torch.int64, device=counts.device)
    if total == 0:
        return out
    _permute_indices_kernel[(experts_per_rank,)](
        counts,
        out,
        num_ranks,
        experts_per_rank,
        SCAN=SCAN_BLOCK,
        BLOCK=FILL_BLOCK,
        num_warps=4,
        **launch_options(),
    )
    return out


@torch.library.custom_op(
    "triton_kernels::permute_indices", mutates_args=(), schema="(Tensor counts) -> Tensor"
)
def _permute_indices_op(counts: torch.Tensor) -> torch.Tensor:
    use = backend.use_triton(counts)
    return permute_indices_triton(counts) if use else permute_indices_reference(counts)


@_permute_indices_op.register_fake
def _(counts):
    _check_counts(counts)
    # the length is counts.sum(), known only at run time
    return counts.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)


def permute_indices(counts: torch.Tensor) -> torch.Tensor:
    """Expert-major gather indices: the Triton kernel or the reference, as
    :mod:`triton_kernels.backend` decides (the custom op ``triton_kernels::permute_indices``)."""
    return torch.ops.triton_kernels.permute_indices(counts)
