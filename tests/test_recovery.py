"""A job recovers by itself: torchrun restarts the workers after a rank is SIGKILLed, they
resume from the newest intact checkpoint, and the run ends where an uninterrupted one does,
bit for bit. Resumes on another world size reshard through DCP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from examples.model import ModelConfig
from examples.train import TrainConfig, train
from fsdp_ext.lab import process_environ
from fsdp_ext.testing import run_distributed
from tests.train_flags import TINY

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "examples" / "train.py")
STEPS, CKPT_EVERY, KILL_AFTER = 25, 5, 7
SNAPSHOT_EVERY = 2
TIMEOUT_S = 240


def _torchrun(out: Path, *extra: str, train: tuple[str, ...] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", *extra, TRAIN, *TINY, *train]
    argv += ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(out)]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The worker of global rank ``rank`` that torchrun ``launcher`` started first."""
    for pid in _children(launcher):
        env = process_environ(pid)
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return pid
    return None


def _final_files(out: Path) -> dict[str, bytes]:
    """The tensor files of the step-STEPS checkpoint (data only: .distcp)."""
    ckpt = out / "checkpoints" / f"step-{STEPS:07d}"
    return {p.name: p.read_bytes() for p in sorted(ckpt.resolve().glob("*.distcp"))}


def _collect(proc: subprocess.Popen, lines: list[str], on_line=None) -> None:
    for line in proc.stdout:
        lines.append(line)
        if on_line is not None:
            on_line(line)


def _killer(proc_box: dict, killed: dict):
    """An output callback: SIGKILL to rank 1's first worker after step KILL_AFTER's line."""

    def on_line(line: str) -> None:
        if killed or not line.lstrip().startswith(f"step {KILL_AFTER:5d} |"):
            return
        pid = _rank_pid(proc_box["proc"].pid, 1)
        assert pid is not None, "rank 1's worker not found under torchrun"
        os.kill(pid, signal.SIGKILL)
        killed["pid"], killed["at"] = pid, time.monotonic()

    return on_line


def _resumed_step(lines: list[str]) -> tuple[int, str]:
    resumed = [ln for ln in lines if ln.startswith("resumed from")]
    assert len(resumed) == 1, "".join(lines)[-3000:]
    return int(resumed[0].split("step-")[1][:7]), resumed[0]


@pytest.mark.slow  # default sibling: test_checkpoint_async_saves' kill sweep under torchrun
def test_torchrun_restart_after_a_killed_rank_finishes_bit_for_bit(tmp_path):
    """torchrun --max-restarts 2; rank 1 gets SIGKILL after step 7; the job exits 0 at step
    25 and its last checkpoint equals an uninterrupted run's byte for byte. A second job
    with --snapshot-every 2 resumes from its in-memory snapshot of step 6 instead of the
    disk's step 5, ends bit for bit the same, and leaves nothing in /dev/shm."""
    straight = _torchrun(tmp_path / "straight")
    jobs = {"straight": (straight, [], None)}
    killed = {"disk": {}, "snapshot": {}}
    for name, flags in (("disk", ()), ("snapshot", ("--snapshot-every", str(SNAPSHOT_EVERY)))):
        box = {}
        box["proc"] = _torchrun(tmp_path / name, "--max-restarts", "2", train=flags)
        jobs[name] = (box["proc"], [], _killer(box, killed[name]))
    readers = [
        threading.Thread(target=_collect, args=(proc, lines, cb), daemon=True)
        for proc, lines, cb in jobs.values()
    ]
    for reader in readers:
        reader.start()
    try:
        for proc, _, _ in jobs.values():
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc, _, _ in jobs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    assert straight.returncode == 0, "".join(jobs["straight"][1])[-3000:]
    expected = _final_files(tmp_path / "straight")
    for name in ("disk", "snapshot"):
        proc, lines, _ = jobs[name]
        text = "".join(lines)
        assert killed[name], f"{name}: rank 1 was never killed: " + text[-3000:]
        assert proc.returncode == 0, text[-3000:]
        result = json.loads(next(ln for ln in reversed(lines) if ln.startswith("{")))
        assert result["steps"] == STEPS
        step, line = _resumed_step(lines)
        if name == "disk":
            # from a disk checkpoint at or after step 5, before the kill: at most one
            # checkpoint interval of steps lost
            assert CKPT_EVERY <= step <= KILL_AFTER + CKPT_EVERY and step % CKPT_EVERY == 0
            assert KILL_AFTER - step <= CKPT_EVERY
        else:
            # from RAM: the snapshot of step 6 (8 if rank 1 finished it before the kill
            # landed), fresher than the disk's step 5: fewer than K steps lost
            assert "in-memory snapshot" in line, line
            assert step % SNAPSHOT_EVERY == 0 and step > CKPT_EVERY, line
            assert KILL_AFTER - step < SNAPSHOT_EVERY
            shm = Path(line.split()[2]).parent
            assert shm.parent == Path("/dev/shm") and not shm.exists(), line
        files = _final_files(tmp_path / name)
        assert files and files == expected, name


# ---------------------------------------------------------------- another world size

SMALL = TrainConfig(
    steps=16,
    batch_size=8,
    seq_len=16,
    model=ModelConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=16, max_seq_len=16, num_experts=2),
    warmup_steps=4,
    val_batches=1,
    verbose=False,
)


def _train(cfg: TrainConfig) -> dict:
    return train(cfg)


SMALL_FLAGS = ["--steps", "16", "--batch-size", "8", "--seq-len", "16", "--dim", "16"]
SMALL_FLAGS += ["--n-layers", "1", "--n-heads", "2", "--hidden-dim", "16", "--num-experts", "2"]
SMALL_FLAGS += ["--warmup-steps", "4", "--val-batches", "1", "--log-every", "1", "--no-plot"]


def _logged_losses(stdout: str) -> list[float]:
    return [
        float(ln.split("| loss ")[1].split()[0]) for ln in stdout.splitlines() if "| loss " in ln
    ]


def test_resume_on_fewer_ranks_reshards_and_continues(tmp_path):
    """Saved on 2 ranks at step 8, resumed on 1: parameters, optimizer and schedule are
    resharded by DCP and the data order continues, so the losses follow the 2-rank run's
    to float rounding."""
    cfg = replace(SMALL, comm="stock")
    straight = run_distributed(_train, 2, replace(cfg, out=str(tmp_path / "a")))[0]
    head = replace(cfg, stop_after=8, ckpt_every=8, out=str(tmp_path / "b"))
    run_distributed(_train, 2, head)
    tail = run_distributed(_train, 1, replace(head, stop_after=0, resume=True))[0]
    assert tail["start_step"] == 8 and tail["steps"] == 16
    assert tail["world_size"] == 1
    rest = straight["losses"][8:]
    # step 9's loss sees the loaded parameters only: the same mean, to float rounding
    assert tail["losses"][0] == pytest.approx(rest[0], abs=1e-5)
    # the steps after it need the loaded Adam moments and LR schedule as well (a mutant
    # that zeroes the moments after a resharding load fails here)
    assert tail["losses"] == pytest.approx(rest, abs=1e-4)


@pytest.mark.slow
def test_loco_resume_on_fewer_ranks_resets_its_buffers_with_one_warning(tmp_path):
    """The same under LoCo, through the command line on 1 rank: one warning line, the
    error buffers start from zero, the losses stay near the 2-rank run's."""
    out = tmp_path / "run"
    head = replace(SMALL, comm="loco", stop_after=8, ckpt_every=8, out=str(out))
    straight = run_distributed(
        _train, 2, replace(head, stop_after=0, ckpt_every=0, out=str(tmp_path / "a"))
    )[0]
    run_distributed(_train, 2, head)
    proc = subprocess.run(
        [sys.executable, TRAIN, *SMALL_FLAGS, "--ckpt-every", "8", "--resume", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "error buffers reset" in ln]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "world_size 2 -> 1" in warnings[0]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 16
    assert _logged_losses(proc.stdout) == pytest.approx(straight["losses"][8:], abs=2e-2)


def test_our_launcher_hands_max_restarts_to_torchrun(monkeypatch, tmp_path, capsys):
    """--max-restarts goes to torchrun, not to the workers; under torchrun it is refused
    in one line naming torchrun's own flag."""
    from examples.config import parse_args
    from examples.launch import launch

    seen = []
    monkeypatch.setattr("torch.distributed.run.main", seen.append)
    argv = ["--nproc-per-node", "2", "--max-restarts", "3", "--out", str(tmp_path)]
    launch(argv, parse_args(argv), TRAIN)
    [args] = seen
    script = args.index(TRAIN)
    assert {"--standalone", "--nproc-per-node=2", "--max-restarts=3"} <= set(args[:script])
    assert args[script + 1 :] == ["--out", str(tmp_path)]
    for rank, needle in (("0", "pass torchrun's own --max-restarts"), (None, "--nproc-per-node")):
        if rank is not None:
            monkeypatch.setenv("RANK", rank)
        else:
            monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(SystemExit) as exc:
            parse_args(["--max-restarts", "1", "--out", str(tmp_path)])
        assert exc.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "argument --max-restarts: only with our launcher" in line and needle in line
