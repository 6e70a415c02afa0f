"""The example trains MoE layers; --ep 2 on 2 ranks trains the same model as --ep 1."""

from dataclasses import replace

import pytest

from examples.model import ModelConfig
from examples.train import TrainConfig, parse_args, train
from fsdp_ext import MoE
from fsdp_ext.testing import run_distributed

TINY = TrainConfig(
    steps=6,
    batch_size=8,
    seq_len=32,
    model=ModelConfig(
        dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=32, moe_hidden_dim=32
    ),
    lr=3e-3,
    warmup_steps=5,
    val_batches=2,
    comm="stock",  # exact reductions: 4-bit compression depends on the layout by design
    verbose=False,
)


def _train(cfg):
    return train(cfg)


def test_example_model_uses_moe_by_default():
    from examples.model import Transformer

    model = Transformer(TINY.model)
    assert all(isinstance(b.feed_forward, MoE) for b in model.layers)
    dense = Transformer(replace(TINY.model, num_experts=0))
    assert not any(isinstance(m, MoE) for m in dense.modules())


def test_ep2_trains_like_ep1(tmp_path):
    ep1 = run_distributed(_train, 2, replace(TINY, out=str(tmp_path / "a")))[0]
    ep2 = run_distributed(_train, 2, replace(TINY, ep=2, out=str(tmp_path / "b")))[0]
    assert len(ep2["losses"]) == 6
    for a, b in zip(ep1["losses"], ep2["losses"], strict=True):
        assert abs(a - b) <= 1e-5
    assert abs(ep1["val_loss"] - ep2["val_loss"]) <= 1e-5


def test_ep2_resumes_bitwise_exact(tmp_path):
    """DCP saves and loads expert DTensors on the (efsdp, ep) mesh like any other state."""
    cfg = replace(TINY, ep=2, steps=6)
    straight = run_distributed(_train, 2, replace(cfg, out=str(tmp_path / "a")))[0]
    first = replace(cfg, stop_after=3, ckpt_every=3, out=str(tmp_path / "b"))
    head = run_distributed(_train, 2, first)[0]
    tail = run_distributed(_train, 2, replace(first, stop_after=0, resume=True))[0]
    assert tail["start_step"] == 3
    assert head["losses"] + tail["losses"] == straight["losses"]


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        (["--ep", "3", "--num-experts", "6"], 2, "ep=3 must divide dp_shard=2"),
        (["--ep", "2"], 1, "ep=2 must divide dp_shard=1"),
        (["--ep", "2", "--num-experts", "3"], 2, "--ep: 2 does not divide --num-experts 3"),
        (["--num-experts", "-1"], 1, "--num-experts: must be >= 0"),
    ],
)
def test_bad_ep_arguments(argv, world, needle, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=world)
    assert needle in capsys.readouterr().err
