"""The main job: it learns, it resumes exactly, and bad arguments fail in one line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest

from examples.config import ConfigError, build_parser, check_world, comm_settings
from examples.model import ModelConfig
from examples.train import TrainConfig, parse_args, train
from fsdp_ext import CommConfig, verify_checkpoint
from fsdp_ext.testing import run_distributed
from tests.warm_helpers import forked_warm

REPO = Path(__file__).resolve().parent.parent
SLOW = pytest.mark.slow  # the same check runs in process below, by default
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
    # the checkpoint directory alone (a link and its version where directories cannot swap),
    # and the owner records (the released generation stays: generations only grow)
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        [".owner", "run.json", "step-0000010", *filter(None, [report.version])]
    )
    assert sorted(report.bytes_per_rank) == [0, 1]
    tail = run_distributed(_train, 2, replace(first, stop_after=0, resume=True))[0]
    assert tail["start_step"] == 10
    assert len(straight["losses"]) == 20
    assert head["losses"] + tail["losses"] == straight["losses"]
    assert tail["val_loss"] == straight["val_loss"]


def test_two_ranks_learn():
    # one warm-up step (lr 6e-4) barely moves the model: its loss is the initial one
    before = run_distributed(_train, 2, replace(TINY, steps=1))[0]
    ranks = run_distributed(_train, 2, replace(TINY, steps=40, lr=1e-2))
    after = ranks[0]
    assert before["val_loss"] > 5.0  # about ln(256) at init
    assert after["val_loss"] < before["val_loss"] - 1.5
    assert after["val_loss"] < after["unigram_entropy"] + 0.3
    # both ranks agree on every reported number
    assert after["losses"] == ranks[1]["losses"] and after["val_loss"] == ranks[1]["val_loss"]


PYTHON = [sys.executable]  # how train.py starts in _cli: forked warm (the fixture below)


@pytest.fixture(autouse=True, scope="module")
def _cli_forked_warm(warm_server_socket):
    """The CLI runs below are forks of the session's warm server (fsdp_ext/warm): the same
    train.py, its parse errors and its one-line messages, without torch's imports each."""
    with forked_warm(warm_server_socket, PYTHON):
        yield


def _cli(args, **env):
    return subprocess.run(
        [*PYTHON, str(REPO / "examples" / "train.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        pytest.param(
            ["--device", "tpu"], {}, "argument --device: invalid choice: 'tpu'", marks=SLOW
        ),
        pytest.param(
            ["--nproc-per-node", "3"], {}, "--batch-size: 16 is not divisible by", marks=SLOW
        ),
        pytest.param(
            ["--resume", "--out", "{tmp}"], {}, "argument --resume: no complete", marks=SLOW
        ),
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


def test_resume_refuses_a_checkpoint_that_cannot_load(tmp_path, capsys):
    """A resume into another model or codec fails in one line; another world size or node
    size passes the check (DCP reshards; see tests/test_recovery.py)."""
    out = str(tmp_path / "run")
    flags = ["--batch-size", "2", "--seq-len", "16", "--dim", "16", "--n-layers", "1"]
    flags += ["--n-heads", "2", "--hidden-dim", "16", "--num-experts", "2", "--val-batches", "1"]
    first = _cli([*flags, "--steps", "2", "--ckpt-every", "2", "--out", out])
    assert first.returncode == 0, first.stderr[-3000:]
    plot = tmp_path / "run" / "loss.png"
    assert plot.read_bytes()[:4] == b"\x89PNG"  # rank 0 drew the losses
    plot.unlink()
    record = json.loads((tmp_path / "run" / "checkpoints" / "run.json").read_text())
    assert record["comm"] == "loco" and record["world_size"] == 1
    assert record["model"]["dim"] == 16 and record["model"]["max_seq_len"] == 16
    resume = [*flags, "--steps", "4", "--resume", "--out", out]
    for extra, needle in [  # train.py's own parse_args, in process (the CLI's one line: above)
        (["--dim", "32"], "argument --dim: the run in"),
        (["--seq-len", "8"], "started with --seq-len 16, got 8"),
        (["--comm", "stock"], "started with --comm loco, got stock"),
        (["--steps", "2"], "is finished: its latest checkpoint is step 2 of --steps 2"),
    ]:
        with pytest.raises(SystemExit) as exc:
            parse_args([*resume, *extra], world_size=1)
        assert exc.value.code == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (needle, err)
    for env, extra in (({"WORLD_SIZE": "2"}, []), ({}, ["--intra-node-size", "1"])):
        with mock.patch.dict(os.environ, env):
            parse_args([*resume, *extra], world_size=int(env.get("WORLD_SIZE", 1)))
    again = _cli([*resume, "--no-plot"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == 4
    assert not plot.exists()  # --no-plot


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        (["--pp", "2", "--microbatches", "1"], 4, "--microbatches: 1F1B over --pp 2 stages needs"),
        (["--intra-node-size", "3"], 2, "--intra-node-size: 3 does not divide the world size 2"),
        (["--intra-node-size", "0"], 1, "--intra-node-size: must be an int >= 1 or 'auto'"),
        (["--intra-node-size", "two"], 1, "--intra-node-size: must be an int >= 1 or 'auto'"),
        (["--lr", "-1"], 1, "--lr: must be > 0, got -1.0"),
        (["--num-experts", "1"], 1, "--num-experts: 1 is fewer than the --top-k 2 experts"),
        (["--ckpt-every", "-5"], 1, "--ckpt-every: must be >= 0, got -5"),
        (["--stop-after", "-1"], 1, "--stop-after: must be >= 0, got -1"),
        (["--warmup-steps", "-1"], 1, "--warmup-steps: must be >= 0, got -1"),
        (["--comm", "stock", "--intra-node-size", "2"], 4, "--intra-node-size: only the gradient"),
        (["--pp", "2", "--intra-node-size", "4", "--batch-size", "24"], 12, "cut the 6-rank"),
        (["--pp", "3"], 4, "--pp: 3 does not divide the world size 4"),
        (["--batch-size", "16"], 3, "not divisible by the world size 3"),
        (["--steps", "0"], 1, "argument --steps: must be a positive integer"),
        (["--device", "tpu"], 1, "argument --device: invalid choice: 'tpu'"),
        (["--nproc-per-node", "3"], 1, "--batch-size: 16 is not divisible by the world size 3"),
        (["--resume", "--out", "{tmp}"], 1, "argument --resume: no complete checkpoint"),
    ],
)
def test_bad_settings_name_their_flag(argv, world, needle, capsys, tmp_path):
    """Each bad setting exits 2 with one line naming its flag, before any process group."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: argument "), err
    assert needle in err


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"lr": -1.0}, "--lr: must be > 0"),
        ({"ckpt_every": -5}, "--ckpt-every: must be >= 0"),
        ({"stop_after": -1}, "--stop-after: must be >= 0"),
        ({"model": replace(TINY.model, num_experts=1)}, "--num-experts: 1 is fewer than"),
        ({"comm": "stock", "intra_node_size": 2}, "--intra-node-size: only the gradient codecs"),
        ({"pp": 2, "microbatches": 1}, "--microbatches: 1F1B over --pp 2 stages"),
        ({"comm": "q8"}, r"--comm: must be one of \['stock', 'loco', 'q4', 'auto'\], got 'q8'"),
    ],
)
def test_train_config_checks_itself(change, needle):
    """train() takes the dataclass: it refuses the same settings, naming the same flag."""
    with pytest.raises(ConfigError, match=needle):
        replace(TINY, **change)


def test_bad_settings_fail_before_any_worker_starts():
    """Under --nproc-per-node the launcher never starts: one line, exit 2, no traceback."""
    proc = _cli(["--pp", "2", "--microbatches", "1", "--nproc-per-node", "2"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "train.py: error: argument --microbatches: 1F1B over --pp 2 stages needs at least 2 "
        "microbatches per step, got 1"
    ]


def test_intra_node_size_auto_reads_the_launcher(monkeypatch):
    """'auto' takes the node size from torchrun's LOCAL_WORLD_SIZE (2 nodes x 2 ranks)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = parse_args(["--intra-node-size", "auto"], world_size=4)
    comm = comm_settings(cfg, 4)
    assert comm.hierarchical and comm.node_size == 2
    assert not comm_settings(replace(cfg, intra_node_size=None), 4).hierarchical
    assert comm_settings(replace(cfg, comm="stock", intra_node_size=None), 4).gradients is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="--intra-node-size: 3 does not divide the world size 4"):
        check_world(cfg, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert comm_settings(cfg, 1).node_size == 1  # a single process is a node of one
    # our own launch is one node of --nproc-per-node ranks
    ours = comm_settings(parse_args(["--intra-node-size", "auto", "--nproc-per-node", "2"]), 2)
    assert ours == CommConfig(gradients="loco", hierarchical=True, node_size=2)


def test_help_lists_every_flag_with_its_default():
    text = build_parser().format_help()
    for flag, default in [
        ("--nproc-per-node", "off"),
        ("--steps", "250"),
        ("--batch-size", "16"),
        ("--dim", "128"),
        ("--num-experts", "8"),
        ("--top-k", "2"),
        ("--pp", "1"),
        ("--microbatches", "4"),
        ("--lr", "0.003"),
        ("--comm", "loco"),
        ("--intra-node-size", "off"),
        ("--ckpt-every", "0"),
        ("--stop-after", "0"),
        ("--out", "runs/train"),
    ]:
        at = text.index(f"  {flag} ")
        assert f"(default: {default})" in " ".join(text[at:].split("\n  --")[0].split()), flag
    assert "--resume" in text and "--seed" in text
