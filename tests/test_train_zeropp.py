"""The main job with the ZeRO++ stack: resume is bit-exact, and the flags refuse in one line.

``--zeropp`` is LoCo 4-bit hierarchical + qwZ + hpZ. On 4 gloo ranks as 2 emulated nodes of
2 (``--intra-node-size 2``): 4 steps, a DCP save through the project's writer, a new process
group, a load through its verified reader and 4 more steps give the 8 losses of a straight
run bit for bit.
"""

import math
from dataclasses import replace

import pytest

from examples.train import parse_args, train
from fsdp_ext import verify_checkpoint
from fsdp_ext.testing import run_distributed
from tests.test_train import TINY

ZEROPP = replace(
    TINY,
    steps=8,
    comm="loco",
    intra_node_size=2,
    qwz=True,
    qwz_group_size=32,
    hpz=True,
    zeropp=True,
)


def _train(cfg):
    return train(cfg)


def test_zeropp_resume_is_bitwise_exact(tmp_path):
    straight = run_distributed(_train, 4, replace(ZEROPP, out=str(tmp_path / "a")))[0]
    first = replace(ZEROPP, stop_after=4, ckpt_every=4, keep=1, out=str(tmp_path / "b"))
    head = run_distributed(_train, 4, first)[0]
    report = verify_checkpoint(tmp_path / "b" / "checkpoints" / "step-0000004")
    assert report.ok, report.problems
    tail = run_distributed(_train, 4, replace(first, stop_after=0, resume=True))[0]
    assert tail["start_step"] == 4
    # hpZ resume: every loss after the checkpoint is the straight run's, bit for bit (the
    # node-local copies are rebuilt from the loaded shards at each forward; DeepSpeed's hpZ
    # jumps there, microsoft/DeepSpeed#7606), and hpZ is on in the resumed run too
    assert head["losses"] + tail["losses"] == straight["losses"]
    assert tail["val_loss"] == straight["val_loss"]
    assert tail["weight_stats"]["intra_node_gathers"] > 0
    # every part ran: int8 forward gathers, node-local backward gathers, 4-bit LoCo
    w, g = straight["weight_stats"], straight["comm_stats"]
    assert w["quantized_gathers"] > 0 and w["intra_node_gathers"] > 0
    assert w["full_precision_gathers"] == 0
    assert g["bytes_sent"] > 0 and g["intra_node_bytes"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hpz", "--ep", "2", "--nproc-per-node", "2"], "argument --hpz: torch cannot reshard"),
        (["--zeropp", "--comm", "q4"], "argument --zeropp: it is --comm loco"),
        (
            ["--qwz", "--qwz-group-size", "48"],
            "argument --qwz-group-size: WeightQuantConfig: group_size must be a power of two",
        ),
    ],
)
def test_zeropp_flags_refuse_in_one_line(args, needle, capsys, monkeypatch):
    """Checked by the parser, before any worker starts: one line, exit code 2."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.slow
def test_qwz_with_expert_parallel_experts():
    """Experts split over ep=2 (DTensors, their own units on the efsdp mesh) gather in int8
    like every other unit: every gather quantised, training finite, ranks agree."""
    cfg = replace(TINY, steps=2, ep=2, qwz=True, qwz_group_size=32, comm="stock")
    ranks = run_distributed(_train, 4, cfg)
    w = ranks[0]["weight_stats"]
    assert w["quantized_gathers"] > 0 and w["full_precision_gathers"] == 0
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert all(math.isfinite(loss) for loss in ranks[0]["losses"])
