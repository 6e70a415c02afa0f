"""examples/train.py --pp 2 on 4 ranks (pp=2 x dp=2): MoE with ep=2 inside the stages,
LoCo, checkpoints; a resumed run continues with exactly the straight run's losses."""

from dataclasses import replace

import pytest

from examples.model import ModelConfig
from examples.train import TrainConfig, parse_args, train
from fsdp_ext.testing import run_distributed

TINY_PP = TrainConfig(
    steps=4,
    batch_size=8,
    seq_len=16,
    model=ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_seq_len=16,
        num_experts=4,
        moe_hidden_dim=16,
    ),
    ep=2,
    pp=2,
    microbatches=2,
    comm="loco",
    warmup_steps=1,
    val_batches=1,
    verbose=False,
)


def _straight_then_split(root: str) -> dict:
    """One process tree: the straight run, then the same run stopped and resumed."""
    straight = train(replace(TINY_PP, out=f"{root}/a"))
    first = replace(TINY_PP, stop_after=2, ckpt_every=2, out=f"{root}/b")
    train(first)
    tail = train(replace(first, stop_after=0, resume=True))
    return {"straight": straight, "tail": tail}


def test_pp2_moe_ep2_loco_resumes_exactly(tmp_path):
    results = run_distributed(_straight_then_split, 4, str(tmp_path))
    for r in results:
        s, t = r["straight"], r["tail"]
        assert t["start_step"] == 2
        assert t["losses"] == s["losses"][2:]  # bitwise
        assert s["val_loss"] == t["val_loss"]
    assert len({r["straight"]["losses"][-1] for r in results}) == 1  # the global loss everywhere
    assert results[0]["straight"]["comm_stats"]["bytes_sent"] > 0  # LoCo ran


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pp", "3"], "--pp"),
        (["--pp", "2", "--microbatches", "3"], "--microbatches"),
        (["--pp", "4", "--n-layers", "2"], "--n-layers"),
    ],
)
def test_pp_arguments_fail_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4)
    assert needle in capsys.readouterr().err
