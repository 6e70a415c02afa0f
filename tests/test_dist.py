"""The harness itself: results come back, errors carry the failing rank, hangs end."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_ext.testing import RankError, RankTimeout, run_distributed


def _all_reduce_rank(scale, *, offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t * scale}


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(world_size):
    out = run_distributed(_all_reduce_rank, world_size, 2.0, offset=1)
    expected_sum = 2.0 * sum(r + 1 for r in range(world_size))
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size for o in out)
    for o in out:
        torch.testing.assert_close(o["sum"], torch.tensor([expected_sum]))


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from the test")
    dist.barrier()  # rank 0 would hang here forever without the harness
    return "unreachable"


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_exception_is_reraised_with_its_traceback(world_size):
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_one, world_size, timeout=60)
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert "boom from the test" in str(err)
    assert "_raise_on_rank_one" in err.remote_traceback


def _hang_on_last_rank():
    dist.barrier()  # both ranks are up, so only the hang can use up the timeout
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(3600)
    return dist.get_rank()


def test_hang_times_out_and_names_stuck_rank():
    with pytest.raises(RankTimeout) as info:
        run_distributed(_hang_on_last_rank, 2, timeout=15)
    assert info.value.stuck == [1]
    assert info.value.finished == [0]
    assert "ranks [1] did not finish" in str(info.value)


def _die_silently():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def test_silent_death_is_an_error_not_a_hang():
    with pytest.raises(RankError) as info:
        run_distributed(_die_silently, 2, timeout=60)
    assert info.value.rank == 0
    assert "exit code 3" in str(info.value)


def test_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_all_reduce_rank, 0, 1.0, offset=0)
