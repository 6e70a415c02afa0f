"""fsdp_ext.name_straggler: who is slow, judged on each rank's own time, not on a mean.

Pure function, no process group: the default run takes milliseconds. The lab run (a node's
CPU share cut from outside) is tests/test_lab_straggler.py.
"""

from __future__ import annotations

import pytest

from fsdp_ext import Straggler, name_straggler

NODES = [0, 0, 1, 1, 2, 2]  # 3 nodes x 2 ranks
STEP_S = [[1.0] * 10 for _ in NODES]


def test_a_steady_straggler_is_named_not_a_rank_with_one_slow_step():
    """Rank 1 had one 5 s step (a garbage collection, a page fault) and is fast otherwise;
    rank 4 is 3x slower on every step. A mean per rank would name rank 1 (0.59 s against
    0.3 s); its own median names rank 4."""
    own = [[0.1] * 10 for _ in NODES]
    own[1][3] = 5.0
    own[4] = [0.3] * 10
    found = name_straggler(own, STEP_S, NODES, first_step=11)
    assert found is not None
    assert (found.rank, found.node) == (4, 2)
    assert (found.first_step, found.last_step) == (11, 20)
    assert found.share == pytest.approx(0.3) and found.median_share == pytest.approx(0.1)
    assert found.ratio == pytest.approx(3.0)


def test_a_slow_node_of_two_ranks_does_not_raise_the_yardstick():
    """Both ranks of node 2 are slow. Against the mean rank (1.31 s) the slower, 1.96 s, is
    under 1.5x and nobody would be named; against the median rank (1.0 s) it is 1.96x."""
    own = [[1.0] * 5, [1.0] * 5, [1.0] * 5, [1.0] * 5, [1.9] * 5, [1.96] * 5]
    step = [[4.0] * 5 for _ in NODES]
    found = name_straggler(own, step, NODES, first_step=1)
    assert found is not None and (found.rank, found.node) == (5, 2)
    assert found.line() == (
        "straggler: rank 5 on node 2 (steps 1-5): its own work is 49% of its step time "
        "against 25% for the median rank (2.0x the median rank's own time)"
    )


def test_even_ranks_have_no_straggler():
    own = [[0.1 + 0.01 * ((r + s) % 3) for s in range(10)] for r in range(6)]
    assert name_straggler(own, STEP_S, NODES, first_step=1) is None


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="own_s"):
        name_straggler([[]], [[]], [0], first_step=1)
    with pytest.raises(ValueError, match="factor must be > 1"):
        name_straggler([[1.0]], [[1.0]], [0], first_step=1, factor=1.0)
    assert isinstance(
        name_straggler([[1.0], [1.0], [9.0]], [[9.0]] * 3, [0, 1, 2], first_step=1), Straggler
    )
