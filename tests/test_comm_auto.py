"""--comm auto: the cost model against a hand formula, the choices it makes on synthetic
links, the same decision on every rank, the user's flags winning, and the main job with it."""

import json
import math
import sys
from pathlib import Path

import pytest

import fsdp_ext
from fsdp_ext.comm.auto import (
    Candidate,
    CodecSpeed,
    Hop,
    Layout,
    Measurements,
    Prediction,
    auto_config,
    candidates,
    choose,
    codec_keys,
    codec_speed,
    measure,
    pick,
    predict,
    slowest,
    time_codecs,
)
from fsdp_ext.testing import run_distributed
from tests.train_flags import train_in_ranks

REPO = Path(__file__).resolve().parent.parent
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def _measurements(link_mbit: float, ns_per_element: float = 2.0, per_call_us: float = 20.0):
    codec = CodecSpeed(per_call_us * 1e-6, ns_per_element * 1e-9)
    return Measurements(
        intra=Hop(2e9, 30e-6),
        inter=Hop(link_mbit * MBIT, 200e-6),
        codecs=dict.fromkeys(codec_keys(), codec),
    )


# a model of four 1M-parameter units (one parameter each), plus a root with none
UNITS = [[0]] + [[1 << 20]] * 4
LAYOUT = Layout(world=4, node_size=2)  # 2 nodes x 2 ranks


def _hand_formula(c: Candidate, m: Measurements) -> float:
    """Seconds per step, written out from bytes / bandwidth + latency x messages + codec
    time, for UNITS on LAYOUT (W = 4 ranks, k = 2 per node, N = 2 nodes). A ring over all
    ranks moves each step over a node link and, beside it, inside the nodes: the slower wins."""
    w, k, n = 4, 2, 2
    p = 1 << 20
    s = p // w  # shard per rank
    x, i = m.inter, m.intra
    q4 = math.ceil(s / 128) * (64 + 4)  # 4-bit codes + one fp32 scale per 128
    q8 = math.ceil(s / 256) * (256 + 4)  # int8 codes + one fp32 scale per 256
    enc_w, dec_w = m.codecs["int8_encode"], m.codecs["int8_decode"]
    enc_g, dec_g = m.codecs.get(f"{c.gradients}_encode"), m.codecs.get(f"{c.gradients}_decode")

    def ring_step(nbytes):
        return max(nbytes / x.bandwidth, nbytes / i.bandwidth) + x.latency

    total = 0.0
    for backward in (False, True):
        if backward and c.hpz:
            # inside the node: k - 1 ring steps of the node-local shard p / k, fp32
            total += (k - 1) * (p / k * 4 / i.bandwidth + i.latency)
        elif c.weights == "int8" or (c.weights == "int8_forward" and not backward):
            total += (w - 1) * ring_step(q8)
            total += enc_w.per_call + s * enc_w.per_element + dec_w.per_call + p * dec_w.per_element
        else:
            total += (w - 1) * ring_step(s * 4)
    if c.gradients == "stock":  # gloo: a ring all-reduce of the whole input
        total += 2 * (w - 1) * ring_step(s * 4)
    elif c.hierarchical:
        total += n * 2 * (k - 1) * (s * 4 / i.bandwidth + i.latency)  # fp32 in each node
        total += k * (n - 1) * q4 / x.bandwidth + x.latency  # k ranks' 4-bit rows share it
        total += enc_g.per_call + n * s * enc_g.per_element
        total += dec_g.per_call + n * s * dec_g.per_element
    else:
        # direct, to every peer: the node's k ranks send to w - k remote ones over the link
        total += max(k * (w - k) * q4 / x.bandwidth, (k - 1) * q4 / i.bandwidth) + x.latency
        total += enc_g.per_call + w * s * enc_g.per_element
        total += dec_g.per_call + w * s * dec_g.per_element
    return 4 * total  # four units


@pytest.mark.parametrize("link_mbit", [50, 1000, 100_000])
def test_cost_model_matches_the_hand_formula(link_mbit):
    m = _measurements(link_mbit)
    for c in candidates(LAYOUT):
        got = predict(c, LAYOUT, m, UNITS).total
        assert got == pytest.approx(_hand_formula(c, m), rel=1e-9), c.name


@pytest.mark.parametrize("param_bytes", [4, 2])
def test_cost_model_bytes_are_the_collectives_choices(param_bytes):
    """At 1 byte/s, no latency and free codecs, the predicted seconds are the bytes sent:
    they equal what the collectives themselves choose to send (``wire_for`` of a real
    ``LoCoReduceScatter``; ``choose_wire`` of the weight codec on FSDP's padded shards), for
    units that compress, units too small to, and several parameters per unit."""
    import torch

    from fsdp_ext.comm import (
        LoCoConfig,
        LoCoReduceScatter,
        WeightQuantConfig,
        choose_wire,
        make_codec,
    )

    w = 2
    layout = Layout(world=w, node_size=w, param_bytes=param_bytes)
    free = CodecSpeed(0.0, 0.0)
    m = Measurements(intra=Hop(1.0, 0.0), inter=None, codecs=dict.fromkeys(codec_keys(), free))
    grads = LoCoReduceScatter(LoCoConfig(group_size=layout.grad_group_size))
    weights = make_codec(WeightQuantConfig(group_size=layout.weight_group_size))
    for params in ([100], [64], [1000, 3], [1 << 16, 7, 7, 300], [513] * 5):
        shards = [-(-p // w) for p in params]  # FSDP pads each parameter to whole shards
        pred = predict(Candidate("int8", False, "q4"), layout, m, [[], params]).seconds
        weight_wire = choose_wire(weights, shards, param_bytes)
        assert pred["weights"] == 2 * (w - 1) * weight_wire.wire_bytes, params
        grad_wire = grads.wire_for(sum(shards), torch.float32)
        # a compressed row goes to each peer once; a plain one by gloo's ring all-reduce
        sent = grad_wire.payload_bytes if grad_wire.compressed else 2 * grad_wire.plain_bytes
        assert pred["grads"] == (w - 1) * sent, params


def test_candidates_cover_each_collective_and_hop():
    names = {c.name for c in candidates(LAYOUT)}
    assert len(names) == 25  # 5 weight settings x 5 gradient settings
    one_node = candidates(Layout(world=4, node_size=4))
    assert not any(c.hpz or c.hierarchical for c in one_node) and len(one_node) == 9


def test_slow_link_chooses_zeropp():
    d = choose(LAYOUT, _measurements(50), UNITS)
    assert d.choice == Candidate("int8", True, "loco", True)
    # the whole choice as the one config everything downstream takes, in the same names
    assert d.comm_config() == fsdp_ext.CommConfig(
        gradients="loco", weights="int8", hpz=True, hierarchical=True, node_size=2
    )
    assert d.comm_config().gradients == fsdp_ext.LoCoConfig()


def test_fast_link_with_slow_codec_chooses_stock():
    # 100 Gbit/s and a codec at 50 ns per element: nothing is worth encoding
    d = choose(LAYOUT, _measurements(100_000, ns_per_element=50), UNITS)
    assert d.choice.weights == "stock" and d.choice.gradients == "stock"
    assert d.comm_config().gradients is None and d.comm_config().weights is None
    # hpZ quantises nothing: it stays where its node-local backward gather is the faster
    assert d.choice.hpz == (
        d.predicted_ms(Candidate(hpz=True)) < d.predicted_ms(Candidate(hpz=False))
    )


def test_ties_go_to_the_least_quantised():
    # q4 and LoCo cost the same here: LoCo (error feedback) wins the tie
    d = choose(LAYOUT, _measurements(50), UNITS)
    q4 = Candidate("int8", True, "q4", True)
    assert d.predicted_ms(q4) == pytest.approx(d.predicted_ms())
    # a tolerance of 0 still takes the exact minimum
    assert choose(LAYOUT, _measurements(50), UNITS, tolerance=0.0).choice.gradients == "loco"


def test_a_unit_whose_payload_exceeds_fp32_goes_raw():
    """The codecs' rule, counted: a 64-element unit's int8 payload (64 + 4 B) is not smaller
    than... its fp32 bytes per rank (16 x 4 B): it is gathered raw, with no codec time."""
    tiny = [[0], [64]]
    m = _measurements(50)
    raw = predict(Candidate(), LAYOUT, m, tiny)
    qwz = predict(Candidate("int8"), LAYOUT, m, tiny)
    assert qwz.seconds["weights"] == raw.seconds["weights"]
    assert "weights_codec" not in qwz.seconds
    loco = predict(Candidate(gradients="loco"), LAYOUT, m, tiny)
    assert loco.seconds["grads"] == raw.seconds["grads"] and "grads_codec" not in loco.seconds


def test_the_root_is_gathered_once():
    m = _measurements(50)
    once = predict(Candidate(), LAYOUT, m, [[1 << 20]], root=0).seconds["weights"]
    twice = predict(Candidate(), LAYOUT, m, [[1 << 20]], root=None).seconds["weights"]
    assert twice == pytest.approx(2 * once)


def test_fixed_choices_win_and_bad_ones_are_named():
    m = _measurements(50)
    d = choose(LAYOUT, m, UNITS, fixed={"weights": "stock", "hpz": False})
    assert d.choice.weights == "stock" and not d.choice.hpz
    assert d.choice.gradients == "loco" and d.choice.hierarchical
    with pytest.raises(ValueError, match="no candidate has"):
        choose(Layout(world=2, node_size=2), m, UNITS, fixed={"hpz": True})


def test_explain_shows_every_candidate_and_the_choice():
    d = choose(LAYOUT, _measurements(50), UNITS)
    text = d.explain()
    assert text.count("\n->") == 1 and f"->{d.choice.name}" in text
    assert all(c.name in text for c in candidates(LAYOUT))
    assert "inter-node link" in text and "6.2 MB/s" in text
    assert f"chosen: {d.choice.name}" in text


# ------------------------------------------------ decision edges (each fails a known mutant)

ZEROPP = Candidate("int8", True, "loco", True)  # the most quantised of the three below
LOCO_FLAT = Candidate(gradients="loco")
STOCK = Candidate()


def _predictions(totals: dict[Candidate, float]) -> list[Prediction]:
    return [Prediction(c, {"weights": t}) for c, t in totals.items()]


def _scaled(m: Measurements, k: float) -> Measurements:
    """Every measured time ``k`` times as long: every prediction scales by exactly ``k``."""
    return Measurements(
        intra=Hop(m.intra.bandwidth / k, m.intra.latency * k),
        inter=Hop(m.inter.bandwidth / k, m.inter.latency * k),
        codecs={key: CodecSpeed(s.per_call * k, s.per_element * k) for key, s in m.codecs.items()},
    )


def test_near_ties_just_inside_and_just_outside_the_tolerance():
    """Within 5 % of the fastest the least quantised wins, however much faster the most
    quantised is; just past 5 % it is out. (Fails if ties go fastest-first.)"""
    inside = pick(_predictions({ZEROPP: 1.0, LOCO_FLAT: 1.03, STOCK: 1.0499}), 0.05)
    assert inside == STOCK
    outside = pick(_predictions({ZEROPP: 1.0, LOCO_FLAT: 1.03, STOCK: 1.0501}), 0.05)
    assert outside == LOCO_FLAT  # the least quantised of what is left
    assert pick(_predictions({ZEROPP: 1.0, LOCO_FLAT: 1.0501, STOCK: 1.06}), 0.05) == ZEROPP
    # equally quantised (2 parts each): the faster one
    fwd = Candidate("int8_forward")
    assert fwd.lossy_parts == LOCO_FLAT.lossy_parts
    assert pick(_predictions({fwd: 1.01, LOCO_FLAT: 1.02}), 0.05) == fwd
    assert pick(_predictions({fwd: 1.02, LOCO_FLAT: 1.01}), 0.05) == LOCO_FLAT


@pytest.mark.parametrize("link_mbit", [50, 1000])
def test_near_ties_in_the_cost_model_switch_exactly_at_the_tolerance(link_mbit):
    """The same through ``choose`` on real predictions: with the tolerance a hair above the
    ratio of the fastest stock candidate to the fastest one, stock wins; a hair below, not."""
    m = _measurements(link_mbit)
    preds = [predict(c, LAYOUT, m, UNITS) for c in candidates(LAYOUT)]
    best = min(preds, key=lambda p: p.total)
    stock = min((p for p in preds if p.candidate.lossy_parts == 0), key=lambda p: p.total)
    assert best.candidate.lossy_parts > 0  # quantising is the fastest on these links
    ratio = stock.total / best.total - 1
    assert choose(LAYOUT, m, UNITS, tolerance=ratio * (1 + 1e-6)).choice == stock.candidate
    assert choose(LAYOUT, m, UNITS, tolerance=ratio * (1 - 1e-6)).choice.lossy_parts > 0


@pytest.mark.parametrize("scale_s", [1e-3, 1.0, 1e3])
def test_the_tolerance_is_relative_at_fast_and_slow_steps(scale_s):
    """4 % slower is inside 5 % and 6 % outside, on a millisecond step as on a 1000 s one.
    (Fails if the tolerance is taken as absolute seconds.)"""
    assert pick(_predictions({ZEROPP: scale_s, STOCK: 1.04 * scale_s}), 0.05) == STOCK
    assert pick(_predictions({ZEROPP: scale_s, STOCK: 1.06 * scale_s}), 0.05) == ZEROPP


@pytest.mark.parametrize("link_mbit", [50, 1000])
def test_the_choice_does_not_depend_on_the_time_scale(link_mbit):
    """Every measured time 1000x shorter or longer scales every prediction alike, so the
    choice stays (the cost model and the rule together)."""
    m = _measurements(link_mbit)
    choice = choose(LAYOUT, m, UNITS).choice
    for k in (1e-3, 1e3):
        d = choose(LAYOUT, _scaled(m, k), UNITS)
        assert d.choice == choice, (k, d.choice.name, choice.name)
        assert d.predicted_ms() == pytest.approx(k * choose(LAYOUT, m, UNITS).predicted_ms())


def test_the_decision_follows_the_slowest_ranks_codec():
    """At 1 Gbit/s a codec at 2 ns per element pays (int8 weights, LoCo) and one at 50 ns
    does not. One slow rank sets the pace, so the decision is the slow rank's, whichever
    rank it is. (Fails if ``slowest`` takes the fastest rank's per-element time.)"""
    fast = _measurements(1000, ns_per_element=2)
    slow = _measurements(1000, ns_per_element=50)
    quantised = choose(LAYOUT, fast, UNITS).choice
    stock = choose(LAYOUT, slow, UNITS).choice
    assert quantised.weights == "int8" and stock.weights == "stock"
    assert stock.gradients == "stock"
    for views in ([fast, slow, fast, fast], [slow, fast, fast, fast], [fast, fast, fast, slow]):
        combined = slowest(views)
        for key in codec_keys():
            assert combined.codecs[key].per_element == pytest.approx(50e-9)
        assert choose(LAYOUT, combined, UNITS).choice == stock
    # per call and per element are each the worst of any rank, even from different ranks
    mixed = _measurements(1000, ns_per_element=2, per_call_us=90)
    combined = slowest([mixed, slow])
    loco = combined.codecs["loco_encode"]
    assert (loco.per_call, loco.per_element) == pytest.approx((90e-6, 50e-9))


def _constant_time(seconds: float):
    return lambda fn, reps: seconds


def test_a_codec_never_measures_as_free():
    """A noisy probe can time the large call no slower than the tiny one (or faster): each
    codec still costs a tenth of the large call's own rate per element, never 0 or less.
    (Fails if the probe's floor on per-element time is removed.)"""
    sample = 1 << 18
    for per_call, whole in ((1e-3, 1e-3), (2e-3, 1e-3), (1e-3, 1.01e-3)):
        speed = codec_speed(per_call, whole, sample)
        assert speed.per_call == per_call
        assert speed.per_element == pytest.approx(max(whole - per_call, 0.1 * whole) / sample)
        assert speed.per_element >= 0.1 * whole / sample > 0
    # an honest probe is not floored: 1 ms per call, 1 ms + 2 ns x sample in all
    honest = codec_speed(1e-3, 1e-3 + 2e-9 * sample, sample)
    assert honest.per_element == pytest.approx(2e-9)
    with pytest.raises(ValueError, match="sample must be an int >= 1"):
        codec_speed(1e-3, 1e-3, 0)


def test_a_faked_probe_where_the_large_call_is_no_slower_than_the_tiny_one():
    """The probe's timing loop with a fake clock: every call, tiny or large, takes 1 ms.
    Every codec comes out at 1 ms per call plus a floor per element; on a 100 Gbit/s link
    the weights then stay in fp32, where codecs measured as free would quantise them."""
    sample = 1 << 18
    calls = dict.fromkeys(codec_keys(), lambda: None)
    timed = []

    def fake(fn, reps):
        timed.append(reps)
        return 1e-3

    codecs = time_codecs(calls, calls, sample, time_call=fake)
    assert sorted(codecs) == sorted(codec_keys()) and len(timed) == 2 * len(codec_keys())
    for speed in codecs.values():
        assert speed.per_call == 1e-3
        assert speed.per_element == pytest.approx(1e-4 / sample)
    units = [[0]] + [[1 << 22]] * 4

    def choice(codecs):
        m = Measurements(intra=Hop(2e9, 30e-6), inter=Hop(100_000 * MBIT, 200e-6), codecs=codecs)
        return choose(LAYOUT, m, units).choice

    assert choice(codecs).weights == "stock"
    assert choice(dict.fromkeys(codec_keys(), CodecSpeed(1e-3, 0.0))).weights == "int8"


# ------------------------------------------------------------------ on real gloo ranks


def _decide(views):
    import torch.distributed as dist

    me = views[dist.get_rank()]
    d = auto_config(UNITS, node_size=2, measurements=me)
    fixed = auto_config(UNITS, node_size=2, measurements=me, weights="stock", hpz=False)
    return d, fixed


def test_every_rank_gets_rank_0s_decision_from_the_slowest_view():
    """Each rank passes deliberately different measurements; rank 1 alone sees a slow link
    (on its own it would choose ZeRO++, the others stock). Every rank returns the same
    decision: the one made from the slowest view of each measurement."""
    views = [_measurements(100_000, ns_per_element=50)] * 4
    views[1] = _measurements(50, ns_per_element=50)
    views[2] = _measurements(100_000, ns_per_element=60, per_call_us=40)
    alone = [choose(LAYOUT, v, UNITS).choice for v in views]
    assert alone[0].weights == alone[0].gradients == "stock"
    assert alone[1].weights == "int8" and alone[1].gradients == "loco"
    results = run_distributed(_decide, 4, views)
    expected = choose(LAYOUT, slowest(views), UNITS)
    for d, fixed in results:
        assert d.choice == expected.choice == alone[1]
        assert [p.total for p in d.predictions] == [p.total for p in expected.predictions]
        assert d.measurements.inter.bandwidth == 50 * MBIT
        assert d.measurements.codecs["int8_encode"].per_call == pytest.approx(40e-6)
        assert fixed.choice.weights == "stock" and not fixed.choice.hpz


def _probe():
    m = measure(1, target_s=0.02, codec_sample=1 << 16)
    return m


def test_the_probe_measures_the_hops_and_codecs():
    """Two ranks, one per node: an inter-node hop (loopback here) and the codecs."""
    for m in run_distributed(_probe, 2):
        assert m.intra is None and m.inter.bandwidth > 1e6 and m.inter.latency > 0
        assert all(m.codecs[k].per_element > 0 for k in codec_keys())
        assert 0 < m.probe_s < 30


def _bad_hpz():
    try:
        auto_config([[1 << 20]], node_size=2, measurements=_measurements(50), hpz=True)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_bad_choice_raises_on_every_rank():
    """Rank 0 cannot decide (hpZ on one node): every rank raises its message, none waits
    for a decision (nor dies of a broken connection)."""
    for message in run_distributed(_bad_hpz, 2, timeout=60):
        assert message is not None and "no candidate has" in message


# ------------------------------------------------------------------ the main job


def test_train_comm_auto_explains_and_keeps_the_users_flags(tmp_path):
    """2 gloo ranks as 2 nodes of 1 (--intra-node-size 1), --qwz given: auto chooses the
    rest, --explain prints the table, and the job trains with int8 weights. train.py's main
    on the harness's ranks (the launch is tested elsewhere: test_train.py)."""
    args = ["--comm", "auto", "--explain", "--qwz"]
    args += ["--intra-node-size", "1", "--steps", "2", "--val-batches", "1", "--batch-size", "4"]
    args += ["--no-plot"]
    args += ["--seq-len", "32", "--dim", "32", "--n-layers", "1", "--n-heads", "2"]
    args += ["--hidden-dim", "64", "--out", str(tmp_path)]
    summary = train_in_ranks(args, 2, stdout=str(tmp_path / "stdout"))
    out = (tmp_path / "stdout.0").read_text()
    assert "comm auto: 2 ranks, 1 per node, 2 nodes" in out
    assert "fixed by the user: weights=int8" in out
    chosen = [line for line in out.splitlines() if line.startswith("->")]
    assert len(chosen) == 1 and "weights=int8 " in chosen[0]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["comm_auto"].startswith("weights=int8 ") and result["steps"] == 2
    assert summary["steps"] == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--explain"], "--explain: only with --comm auto, got --comm loco"),
        (["--comm", "auto", "--pp", "2", "--n-layers", "2"], "--comm: auto is not under --pp"),
        (["--comm", "auto", "--zeropp"], "--zeropp: it is --comm loco --qwz --hpz; drop --comm"),
    ],
)
def test_auto_flags_refuse_in_one_line(argv, needle, capsys):
    from examples.config import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=4)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_hpz_given_on_one_node_is_refused_before_any_collective():
    from examples.config import ConfigError, TrainConfig, decide_comm

    cfg = TrainConfig(comm="auto", hpz=True, intra_node_size=2, verbose=False)
    with pytest.raises(ConfigError, match="--hpz: needs ranks on more than one node"):
        decide_comm(cfg, None, 2)


def test_auto_keys_compare_auto_with_the_best_fixed_configuration():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cluster import auto_keys

    rows = [
        {"layout": "2x2", "rate_mbit": 50, "config": "stock_fp32", "step_ms": 6000.0},
        {"layout": "2x2", "rate_mbit": 50, "config": "zeropp", "step_ms": 600.0},
        {"layout": "2x2", "rate_mbit": 50, "config": "auto", "step_ms": 615.0, "comm_auto": "x"},
        {"layout": "3x2", "rate_mbit": 1000, "config": "q4", "step_ms": 400.0},
        {"layout": "3x2", "rate_mbit": 1000, "config": "zeropp", "step_ms": 500.0},
        {"layout": "3x2", "rate_mbit": 1000, "config": "auto", "step_ms": 380.0, "comm_auto": "y"},
    ]
    keys = auto_keys(rows)
    assert keys["auto_over_best_2x2_50"] == 1.025 and keys["auto_choice_2x2_50"] == "x"
    assert keys["auto_over_best_3x2_1000"] == 0.95 and keys["best_fixed_3x2_1000"] == "q4"
    assert keys["auto_over_best_max"] == 1.025


def test_a_resume_keeps_the_choice_the_run_started_with(tmp_path):
    """The run record holds auto's choice; decide_comm on --resume fixes every part to it."""
    from dataclasses import replace

    from examples.config import RUN_RECORD, TrainConfig, _decided_before, run_record

    cfg = TrainConfig(comm="auto", out=str(tmp_path), verbose=False)
    decided = replace(cfg, auto=choose(LAYOUT, _measurements(50), UNITS))
    record = run_record(decided, 4)
    assert record["comm_auto"] == {
        "weights": "int8",
        "hpz": True,
        "gradients": "loco",
        "hierarchical": True,
    }
    cfg.checkpoint_root.mkdir(parents=True)
    (cfg.checkpoint_root / RUN_RECORD).write_text(json.dumps(record))
    assert _decided_before(cfg) == {}  # a fresh run measures and chooses
    fixed = _decided_before(replace(cfg, resume=True))
    assert choose(LAYOUT, _measurements(100_000, 50), UNITS, fixed=fixed).choice == (
        decided.auto.choice
    )
