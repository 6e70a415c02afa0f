"""The expert-major permutation kernel equals its reference (Triton via the interpreter)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_ext.kernels.permute_indices import (
    permute_indices,
    permute_indices_reference,
    permute_indices_triton,
)
from fsdp_ext.testing import KernelLaunches


def _by_hand(counts):
    """Spell the layout out with loops: received blocks (r, e) -> expert-major (e, r)."""
    num_ranks, experts = counts.shape
    start, src = 0, {}
    for r in range(num_ranks):
        for e in range(experts):
            src[r, e] = start
            start += int(counts[r, e])
    out = []
    for e in range(experts):
        for r in range(num_ranks):
            out.extend(range(src[r, e], src[r, e] + int(counts[r, e])))
    return torch.tensor(out, dtype=torch.int64)


counts_strategy = st.integers(1, 4).flatmap(
    lambda ranks: st.integers(1, 5).flatmap(
        lambda experts: st.lists(
            st.one_of(st.just(0), st.integers(0, 300)),
            min_size=ranks * experts,
            max_size=ranks * experts,
        ).map(lambda v: torch.tensor(v, dtype=torch.int64).view(ranks, experts))
    )
)


@pytest.mark.usefixtures("triton_interpreter")
@settings(max_examples=25, deadline=None)
@given(counts=counts_strategy, int32=st.booleans())
def test_triton_equals_reference_and_loops(counts, int32):
    counts = counts.to(torch.int32) if int32 else counts
    expected = _by_hand(counts)
    reference = permute_indices_reference(counts)
    assert torch.equal(reference, expected)
    assert torch.equal(permute_indices_triton(counts), expected)


@settings(max_examples=15, deadline=None)
@given(counts=counts_strategy)
def test_indices_are_a_permutation_that_groups_by_expert(counts):
    idx = permute_indices(counts)
    total = int(counts.sum())
    assert torch.equal(idx.sort().values, torch.arange(total))
    # Label every received row with its expert; after the gather labels must be sorted.
    experts = counts.shape[1]
    labels = torch.arange(experts).repeat(counts.shape[0]).repeat_interleave(counts.flatten())
    assert torch.equal(labels[idx], labels.sort(stable=True).values)


def test_all_zero_counts_give_empty_indices():
    counts = torch.zeros(2, 3, dtype=torch.int64)
    assert permute_indices_triton(counts).numel() == 0
    assert permute_indices_reference(counts).numel() == 0


def test_bad_counts_are_rejected():
    import pytest

    with pytest.raises(ValueError, match="counts"):
        permute_indices_reference(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="counts"):
        permute_indices_reference(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="non-negative"):
        permute_indices_triton(torch.tensor([[1, -1]]))


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize(
    ("shape", "high"),
    [((40, 30), 50), ((8, 16), 700), ((2, 3), 5000)],  # scan chunks; many tiles; few blocks
)
def test_triton_crosses_tiles_and_scan_chunks_in_two_launches(shape, high):
    """More blocks than one scan chunk, tiles that start inside blocks and span several,
    empty blocks: still the loops' order, in two launches (plan, fill) whatever the size."""
    gen = torch.Generator().manual_seed(shape[0])
    counts = torch.randint(0, high, shape, generator=gen)
    counts[0, 0] = counts[-1, -1] = 0
    with KernelLaunches() as launches:
        got = permute_indices_triton(counts)
    assert torch.equal(got, _by_hand(counts))
    assert launches.names == ["_permute_plan_kernel", "_permute_fill_kernel"]
