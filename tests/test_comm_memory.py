"""Smoke test of benchmarks/comm_memory.py: real buffers on 2 ranks, a tiny model."""

import pytest

from benchmarks.comm_memory import main


@pytest.mark.slow
def test_memory_table_measures_every_setting():
    result = main(["--world", "2", "--node-size", "2", "--small"])
    rows = {(r["error_dtype"], r["intra_node_size"]): r for r in result["rows"]}
    assert len(rows) == 6
    flat = {d: rows[(d, None)]["bytes_per_param_per_rank"] for d in ("int8", "bf16", "fp32")}
    # one error value per gradient element on every rank (+ padding, + int8 group scales)
    assert 1.0 <= flat["int8"] < 1.2 and 2.0 <= flat["bf16"] < 2.2 and 4.0 <= flat["fp32"] < 4.4
    # one node holding both ranks: nothing crosses nodes, so no error is kept at all
    assert all(rows[(d, 2)]["error_bytes_per_rank"] == 0 for d in ("int8", "bf16", "fp32"))
