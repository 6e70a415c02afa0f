"""benchmarks/quality.py: the paired statistics checked by hand, and a smoke run on real ranks."""

from __future__ import annotations

import math
from dataclasses import replace

from benchmarks.quality import comm_choices, main, modes, summarize
from examples.train import TrainConfig


def _seed(stock, q4, loco, zeropp):
    return {
        m: {"val": v, "train_tail": v + 0.5}
        for m, v in (("stock", stock), ("q4", q4), ("loco", loco), ("zeropp", zeropp))
    }


def test_gaps_are_paired_by_seed_with_their_standard_error():
    # stock spreads 2.0-3.0 across seeds; q4 sits +1 % above its own seed's stock each time
    main_runs = [
        _seed(2.0, 2.02, 2.0, 1.98),
        _seed(3.0, 3.03, 3.03, 3.0),
        _seed(2.5, 2.525, 2.5, 2.5),
    ]
    low = [{m: r[m] for m in ("stock", "q4", "loco")} for r in main_runs]
    out = summarize(main_runs, low, ["q4", "loco", "zeropp"])
    assert out["gap_q4_pct"] == 1.0 and out["gap_q4_se"] == 0.0  # paired: no seed spread
    # loco: 0, +1, 0 % -> mean 1/3, sample sd sqrt(1/3), se = sd / sqrt(3) = 1/3
    assert math.isclose(out["gap_loco_pct"], 1 / 3, abs_tol=1e-3)
    assert math.isclose(out["gap_loco_se"], 1 / 3, abs_tol=1e-3)
    # zeropp: -1, 0, 0 %; loco - q4 (in % of stock): -1, 0, -1
    assert math.isclose(out["gap_zeropp_pct"], -1 / 3, abs_tol=1e-3)
    assert math.isclose(out["loco_minus_q4_pct"], -2 / 3, abs_tol=1e-3)
    assert out["within_target_q4"] and out["within_target_loco"]
    assert out["loco_le_q4_lowlr"] is True and out["q4_degrades_lowlr"] is True
    keys = list(out)
    assert keys[-4:] == [
        "gap_q4_pct_lowlr",
        "gap_q4_se_lowlr",
        "loco_minus_q4_pct_lowlr",
        "loco_minus_q4_se_lowlr",
    ]
    assert keys.index("gap_q4_pct") > keys.index("within_target_q4")
    # a 3 % gap with a small standard error misses the target, so the check can fail
    bad = [_seed(s, 1.03 * s + 0.001 * i, s, s) for i, s in enumerate((2.0, 3.0, 2.5))]
    assert summarize(bad, [], ["q4", "loco", "zeropp"])["within_target_q4"] is False


def test_auto_joins_the_modes_once_train_offers_it():
    names = set(modes(TrainConfig(verbose=False)))
    assert names >= {"stock", "q4", "loco", "zeropp"}
    assert ("auto" in names) == ("auto" in comm_choices())
    assert modes(replace(TrainConfig(verbose=False), lr=1e-4))["zeropp"].qwz is True


def test_quick_smoke_on_real_ranks():
    out = main(["--quick", "--no-lowlr"])
    assert out["smoke"] is True and out["seeds"] == 1
    for mode in ("q4", "loco", "zeropp"):
        assert math.isfinite(out[f"gap_{mode}_pct"])
    assert list(out)[-1] == "loco_minus_q4_se"
