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

from fsdp_ext.kernels import backend
from fsdp_ext.kernels.codec_common import CompileCase, launch_options, tl, triton

# Fixed block sizes: one compiled variant per counts dtype, whatever the ranks and experts.
# The plan kernel scans the counts SCAN_BLOCK at a time; each fill program writes FILL_BLOCK
# indices (16 per thread with 4 warps: 128 contiguous bytes, eight 16-byte stores).
SCAN_BLOCK = 1024
FILL_BLOCK = 2048


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
    def _permute_plan_kernel(counts_ptr, plan_ptr, num_ranks, experts_per_rank, SCAN: tl.constexpr):
        """One program: ``plan[b]`` = where destination block ``b = e * R + r`` starts in the
        output, ``plan[B + b]`` = where it starts in the received buffer (``B`` blocks)."""
        num_blocks = num_ranks * experts_per_rank
        carry = tl.zeros((), tl.int64)
        for base in range(0, num_blocks, SCAN):  # received (row-major) order: source starts
            flat = base + tl.arange(0, SCAN)
            ok = flat < num_blocks
            c = tl.load(counts_ptr + flat, mask=ok, other=0).to(tl.int64)
            start = carry + tl.cumsum(c, 0) - c
            dst_block = (flat % experts_per_rank) * num_ranks + flat // experts_per_rank
            tl.store(plan_ptr + num_blocks + dst_block, start, mask=ok)
            carry += tl.sum(c, 0)
        carry = tl.zeros((), tl.int64)
        for base in range(0, num_blocks, SCAN):  # expert-major order: destination starts
            block = base + tl.arange(0, SCAN)
            ok = block < num_blocks
            flat = (block % num_ranks) * experts_per_rank + block // num_ranks
            c = tl.load(counts_ptr + flat, mask=ok, other=0).to(tl.int64)
            tl.store(plan_ptr + block, carry + tl.cumsum(c, 0) - c, mask=ok)
            carry += tl.sum(c, 0)

    @triton.jit
    def _permute_fill_kernel(plan_ptr, out_ptr, total, num_blocks, steps, BLOCK: tl.constexpr):
        """Output tile ``[i0, i0 + BLOCK)``: find (binary search) the block holding ``i0``,
        then write ``src + (i - dst)`` block by block until the tile is full. Every program
        writes one contiguous tile, so the grid scales with the tokens, not the experts."""
        i0 = tl.program_id(0).to(tl.int64) * BLOCK
        i = i0 + tl.arange(0, BLOCK)
        lo = i0 * 0
        hi = lo + num_blocks
        for _ in range(steps):  # lo = blocks starting at or before i0
            mid = (lo + hi) // 2
            active = lo < hi
            start = tl.load(plan_ptr + mid, mask=active, other=0)
            right = active & (start <= i0)
            hi = tl.where(active & ~right, mid, hi)
            lo = tl.where(right, mid + 1, lo)
        b = lo - 1
        end = tl.minimum(i0 + BLOCK, total)
        start = tl.load(plan_ptr + b)
        while start < end:
            src = tl.load(plan_ptr + num_blocks + b)
            stop = tl.load(plan_ptr + b + 1, mask=b + 1 < num_blocks, other=total)
            tl.store(out_ptr + i, src + (i - start), mask=(i >= start) & (i < stop))
            b += 1
            start = stop


def compile_cases() -> list[CompileCase]:
    """The launcher's variants: the plan kernel per counts dtype, and the fill kernel."""
    plan = [
        CompileCase(
            _permute_plan_kernel,
            {
                "counts_ptr": counts_type,
                "plan_ptr": "*i64",
                "num_ranks": "i32",
                "experts_per_rank": "i32",
                "SCAN": "constexpr",
            },
            {"SCAN": SCAN_BLOCK},
            num_warps=4,
            aligned=("counts_ptr", "plan_ptr"),
        )
        for counts_type in ("*i32", "*i64")
    ]
    fill = CompileCase(
        _permute_fill_kernel,
        {
            "plan_ptr": "*i64",
            "out_ptr": "*i64",
            "total": "i64",
            "num_blocks": "i32",
            "steps": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": FILL_BLOCK},
        num_warps=4,
        aligned=("plan_ptr", "out_ptr"),
        streams=("out_ptr",),
    )
    return [*plan, fill]


def permute_indices_triton(counts: torch.Tensor) -> torch.Tensor:
    """Triton launchers (a one-program plan, then a fill over the tokens); same contract as
    :func:`permute_indices_reference`. Reads the total and the smallest count back to the
    host once (the output's length depends on them), the only sync."""
    if triton is None:
        raise RuntimeError("permute_indices_triton needs triton installed")
    _check_counts(counts)
    counts = counts.contiguous()
    num_ranks, experts_per_rank = counts.shape
    num_blocks = num_ranks * experts_per_rank
    if num_blocks == 0:
        return torch.empty(0, dtype=torch.int64, device=counts.device)
    total, smallest = torch.stack([counts.sum(), counts.min()]).tolist()
    if smallest < 0:
        raise ValueError("counts must be non-negative")
    out = torch.empty(total, dtype=torch.int64, device=counts.device)
    if total == 0:
        return out
    plan = torch.empty(2 * num_blocks, dtype=torch.int64, device=counts.device)
    _permute_plan_kernel[(1,)](
        counts,
        plan,
        num_ranks,
        experts_per_rank,
        SCAN=SCAN_BLOCK,
        num_warps=4,
        **launch_options(),
    )
    _permute_fill_kernel[(triton.cdiv(total, FILL_BLOCK),)](
        plan,
        out,
        total,
        num_blocks,
        num_blocks.bit_length() + 1,
        BLOCK=FILL_BLOCK,
        num_warps=4,
        **launch_options(),
    )
    return out


@torch.library.custom_op(
    "fsdp_ext::permute_indices", mutates_args=(), schema="(Tensor counts) -> Tensor"
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
    :mod:`fsdp_ext.kernels.backend` decides (the custom op ``fsdp_ext::permute_indices``)."""
    return torch.ops.fsdp_ext.permute_indices(counts)
