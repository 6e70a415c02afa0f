"""The main job: it learns, it resumes exactly, and bad arguments fail in one line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from examples.model import ModelConfig
from examples.train import TrainConfig, train
from fsdp_ext import verify_checkpoint
from fsdp_ext.testing import run_distributed

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
    first = replace(TINY, stop_after=10, ckpt_every=5, keep=1, out=str(tmp_path / "b"))
    head = run_distributed(_train, 2, first)[0]
    # saved with SpreadFileSystemWriter: verified, and only the last --keep 1 is left
    ckpts = tmp_path / "b" / "checkpoints"
    report = verify_checkpoint(ckpts / "step-0000010")
    assert report.ok, report.problems
    # the link and its one version directory
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["run.json", "step-0000010", report.version]
    )
    assert sorted(report.bytes_per_rank) == [0, 1]
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


def test_resume_refuses_a_checkpoint_that_cannot_load(tmp_path):
    """A resume into another model, codec or (with LoCo) world size fails in one line."""
    out = str(tmp_path / "run")
    flags = ["--batch-size", "2", "--seq-len", "16", "--dim", "16", "--n-layers", "1"]
    flags += ["--n-heads", "2", "--hidden-dim", "16", "--num-experts", "2", "--val-batches", "1"]
    first = _cli([*flags, "--steps", "2", "--ckpt-every", "2", "--out", out])
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "checkpoints" / "run.json").read_text())
    assert record["comm"] == "loco" and record["world_size"] == 1
    assert record["model"]["dim"] == 16 and record["model"]["max_seq_len"] == 16
    resume = [*flags, "--steps", "4", "--resume", "--out", out]
    for extra, env, needle in [
        (["--dim", "32"], {}, "argument --dim: the run in"),
        (["--seq-len", "8"], {}, "started with --seq-len 16, got 8"),
        (["--comm", "default"], {}, "started with --comm loco, got default"),
        ([], {"WORLD_SIZE": "2"}, "started with world size 1, got 2"),
    ]:
        proc = _cli([*resume, *extra], **env)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (needle, proc.stderr)
    again = _cli(resume)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == 4
