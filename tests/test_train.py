"""The main job: it learns, it resumes exactly, and bad arguments fail in one line."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from examples.model import ModelConfig
from examples.train import TrainConfig, train
from tests.dist import run_distributed

REPO = Path(__file__).resolve().parent.parent
TINY = TrainConfig(
    steps=20,
    batch_size=8,
    seq_len=32,
    model=ModelConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=32),
    lr=3e-3,
    warmup_steps=5,
    val_batches=2,
    verbose=False,
)


def _train(cfg):
    return train(cfg)


def test_resume_is_bitwise_exact(tmp_path):
    straight = run_distributed(_train, 2, replace(TINY, out=str(tmp_path / "a")))[0]
    first = replace(TINY, stop_after=10, ckpt_every=10, out=str(tmp_path / "b"))
    head = run_distributed(_train, 2, first)[0]
    assert (tmp_path / "b" / "checkpoints" / "step-0000010" / ".metadata").is_file()
    tail = run_distributed(_train, 2, replace(first, stop_after=0, resume=True))[0]
    assert tail["start_step"] == 10
    assert len(straight["losses"]) == 20
    assert head["losses"] + tail["losses"] == straight["losses"]
    assert tail["val_loss"] == straight["val_loss"]


def test_two_ranks_learn():
    before = run_distributed(_train, 2, replace(TINY, steps=0))[0]
    ranks = run_distributed(_train, 2, replace(TINY, steps=40, lr=1e-2))
    after = ranks[0]
    assert before["val_loss"] > 5.0  # about ln(256) at init
    assert after["val_loss"] < before["val_loss"] - 1.5
    assert after["val_loss"] < after["unigram_entropy"] + 0.3
    # both ranks agree on every reported number
    assert (
        after["losses"] == run_distributed(_train, 2, replace(TINY, steps=40, lr=1e-2))[1]["losses"]
    )


def _cli(args, **env):
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "train.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--device", "tpu"], {}, "argument --device: invalid choice: 'tpu'"),
        (["--batch-size", "16"], {"WORLD_SIZE": "3"}, "not divisible by the world size 3"),
        (["--nproc-per-node", "3"], {}, "--batch-size: 16 is not divisible by the world size 3"),
        (["--steps", "0"], {}, "argument --steps: must be a positive integer"),
        (["--resume", "--out", "{tmp}"], {}, "argument --resume: no complete checkpoint"),
        (["--out", "{tmp}/old"], {}, "holds checkpoints of an earlier run; pass --resume"),
    ],
)
def test_bad_arguments_fail_in_one_line(tmp_path, args, env, needle):
    args = [a.format(tmp=tmp_path) for a in args]
    (tmp_path / "old" / "checkpoints" / "step-0000010").mkdir(parents=True)
    proc = _cli(args, **env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr
