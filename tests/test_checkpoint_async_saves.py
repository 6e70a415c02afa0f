"""Checkpointer's background saves: what each checkpoint holds, the order they publish in,
the wait a save reports, and close() finishing the last write."""

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_ext import Checkpointer, SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint import LocalStorage, checkpoint_steps, verify_checkpoint
from fsdp_ext.warm import client_argv
from tests.test_train_job_life import TINY, contents, same
from tests.train_flags import train_in_ranks


class _SlowBackground(LocalStorage):
    """Every storage operation of a background save takes a little while (a slow disk);
    records the checkpoint paths published, in order."""

    def __init__(self):
        super().__init__()
        self.published: list[str] = []

    def before(self, op, path):
        if threading.current_thread().name.startswith("fsdp_ext-save"):
            time.sleep(0.01)
            if op in ("rename", "exchange") and "step-" in str(path).rsplit("/", 1)[-1][:5]:
                self.published.append(str(path).rsplit("/", 1)[-1])


def test_background_saves_hold_their_own_step_publish_in_order_and_close_waits(tmp_path, capfd):
    root, fs = tmp_path / "out", _SlowBackground()
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, model=model, optimizer=opt, keep=None, fs=fs, overlap_staging=True)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        ckpt.save(step, blocking=False)
        for p in model.parameters():  # the next step changes the weights at once
            p.grad = torch.ones_like(p)
        opt.step()
    ckpt.close()
    assert [s for s, _ in checkpoint_steps(root)] == [1, 2, 3]  # close() waited
    assert fs.published == ["step-0000001", "step-0000002", "step-0000003"]
    err = capfd.readouterr().err
    assert "the save of step 2 waited" in err and "write of step 1 to finish" in err
    assert "the save of step 3 waited" in err
    for step, path in checkpoint_steps(root):
        assert verify_checkpoint(path).ok
        fresh = nn.Linear(64, 32)
        dcp.load(
            {"model": _ModelOnly(fresh)},
            storage_reader=VerifiedFileSystemReader(path),
            planner=SafeLoadPlanner(),
        )
        for p in fresh.parameters():
            assert torch.equal(p, torch.full_like(p, float(step))), step  # its own step's
    stats = ckpt.stats
    assert len(stats.blocked_s) == 3 and len(stats.waited_s) == 2  # saves 2 and 3 waited
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    # staging holds the model and AdamW's two moments (and step counters): bounded by the
    # state's bytes, allocated once and reused
    assert 3 * nbytes <= stats.staging_bytes <= 3 * nbytes * 1.1 + 1024, stats.staging_bytes


def _saved(path, template: nn.Module) -> dict[str, torch.Tensor]:
    fresh = copy.deepcopy(template)
    dcp.load(
        {"model": _ModelOnly(fresh)},
        storage_reader=VerifiedFileSystemReader(path),
        planner=SafeLoadPlanner(),
    )
    return {k: v.clone() for k, v in fresh.state_dict().items()}


class _Blocks(nn.Module):
    """32 weights of 1 MiB each, then (last in the state dict) a buffer that the forward pass
    writes in place, as a BatchNorm's running mean is."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(512, 512)) for _ in range(32))
        self.norm = nn.Module()
        self.norm.register_buffer("running", torch.zeros(512))


def test_the_step_after_a_background_save_waits_for_its_copy_and_other_tensors_are_copied_at_once(
    tmp_path,
):
    """With ``overlap_staging=True`` (train.py's), ``save`` returns before the parameters and the
    optimizer's state are copied; the next ``optimizer.step()`` must wait for that copy. The
    optimizer walks the weights in the opposite order to the copy, so a step that did not
    wait would write the last weights before the copy reads them. A buffer that the forward
    pass writes is not the optimizer's: it is copied before ``save`` returns."""
    model = _Blocks()
    opt = torch.optim.SGD(list(reversed(list(model.parameters()))), lr=1.0)
    ckpt = Checkpointer(
        tmp_path / "out", model=model, optimizer=opt, keep=None, overlap_staging=True
    )
    for step in (1, 2, 3):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(step, blocking=False)
        model.norm.running.add_(1.0)  # the next forward pass
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # every weight moves by -1
        ckpt.wait()
        saved = _saved(tmp_path / "out" / f"step-{step:07d}", model)
        for key, value in before.items():
            assert torch.equal(saved[key], value), (step, key)
        phases = ckpt.stats.phases_s[-1]
        assert "step_wait" in phases  # the step waited (maybe 0 s, the copy being done)
        assert ckpt.stats.blocked_s[-1] >= phases["step_wait"]
    ckpt.close()
    opt.step()  # a closed checkpointer's hook is gone: nothing to wait for, nothing raised


def test_by_default_a_background_save_copies_everything_before_it_returns(tmp_path):
    """Without ``overlap_staging`` (the default), a loop that writes parameters in place
    outside the optimizer between a save and the next step still saves what the save saw."""
    model = _Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ckpt = Checkpointer(tmp_path / "out", model=model, optimizer=opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    ckpt.close()
    saved = _saved(tmp_path / "out" / "step-0000001", model)
    assert all(torch.equal(saved[k], v) for k, v in before.items())
    assert "step_wait" not in ckpt.stats.phases_s[-1]
    with pytest.raises(TypeError, match="overlap_staging must be True or False, got 'yes'"):
        Checkpointer(tmp_path / "other", model=model, optimizer=opt, overlap_staging="yes")


class _Wrapped(torch.optim.Optimizer):
    """An optimizer wrapper that never calls ``Optimizer.__init__`` (as accelerate's
    ``AcceleratedOptimizer`` does not): a step pre-hook on it would never run."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_wrapped_optimizer_whose_hooks_never_run_has_its_tensors_copied_in_the_call(tmp_path):
    model = _Blocks()
    opt = _Wrapped(torch.optim.SGD(list(reversed(list(model.parameters()))), lr=1.0))
    ckpt = Checkpointer(tmp_path / "out", model=model, optimizer=opt, overlap_staging=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1, blocking=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ckpt.close()
    saved = _saved(tmp_path / "out" / "step-0000001", model)
    assert all(torch.equal(saved[k], v) for k, v in before.items())
    assert "step_wait" not in ckpt.stats.phases_s[-1]  # nothing was left for a step to wait on


class _ModelOnly:
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


# -- train.py --async-save, killed -9 at every point of a background save ------------------

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "ckpt_programs" / "train_killed_at.py"
TORCHRUN2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
KILL_POINTS = [
    "0/stage",  # rank 0 while staging (after three buffer copies)
    r"1/write@__1_.*\.distcp",  # rank 1 writing its data file
    r"0/write@__0_.*\.distcp",  # rank 0 writing its data file
    r"0/write@\.metadata",  # the coordinator writing .metadata
    r"0/rename@\.manifest\.json",  # just before the commit (the manifest's rename)
    r"0/rename@step-\d+",  # just before the publish
    "0/fsync@checkpoints",  # just after the publish (the directory's fsync)
    r"0/rename@\.fsdp_ext-trash-.*",  # the prune after it
]


def test_async_saves_killed_at_every_point_resume_bit_for_bit(tmp_path, warm_server_socket):
    """torchrun restarts the job after each kill; its workers are forked from the session's
    warm server (fsdp_ext/warm), so the nine attempts pay no imports of torch."""
    args = [*TINY.split(), "--steps", "20", "--ckpt-every", "2", "--keep", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_PLAN": ",".join(KILL_POINTS)}
    program = [str(PROGRAM), *args, "--async-save", "--out", str(tmp_path / "struck")]
    client = client_argv(warm_server_socket, program)
    struck = subprocess.run(
        [*TORCHRUN2, "--max-restarts", str(len(KILL_POINTS)), *client],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "fresh interpreter" not in struck.stderr  # every attempt's workers were forked
    assert struck.returncode == 0, struck.stderr[-4000:]
    kills = [x for x in struck.stderr.splitlines() if x.startswith("killed: attempt")]
    assert [int(x.split()[2]) for x in kills] == list(range(len(KILL_POINTS))), (
        kills
    )  # every point was reached, in its attempt
    straight = train_in_ranks([*args, "--out", str(tmp_path / "straight")], 2)
    assert straight["steps"] == 20
    left = checkpoint_steps(tmp_path / "struck" / "checkpoints")
    assert [s for s, _ in left] == [20]
    for step, path in left:
        assert verify_checkpoint(path).ok
        want = tmp_path / "straight" / "checkpoints" / path.name
        assert same(contents(path), contents(want)), step  # bit for bit
    root = tmp_path / "struck" / "checkpoints"
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".owner"]  # nothing leaked
    work = [p for p in (root / ".owner").iterdir() if p.is_dir()]
    assert all(not any(p.iterdir()) for p in work)


def test_sigterm_to_the_launcher_during_a_background_write_and_resume(tmp_path, warm_server_socket):
    """The workers are forks of the session's warm server, which join the job's mount
    namespace (its own /dev/shm); torchrun's SIGTERM reaches them through their clients."""
    args = [*TINY.split(), "--steps", "8", "--ckpt-every", "2", "--keep", "2", "--async-save"]
    out = tmp_path / "run"
    # the job sees a /dev/shm of its own (a bind mount in its own mount namespace), so what it
    # leaves there is told apart from what other jobs on this machine make meanwhile
    shm = tmp_path / "shm"
    shm.mkdir()
    private_shm = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    private_shm += ['mount --bind "$0" /dev/shm && exec "$@"', str(shm)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KILL_PLAN": r"0/pause@rename@\.manifest\.json",  # just before the commit
    }
    launcher = subprocess.Popen(
        [
            *private_shm,
            *TORCHRUN2,
            *client_argv(warm_server_socket, [str(PROGRAM), *args, "--out", str(out)]),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in launcher.stderr:
            seen.append(line)
            if line.startswith("paused:"):
                break
        else:
            raise AssertionError(f"never paused; exit {launcher.wait()}")
        launcher.send_signal(signal.SIGTERM)
        _, rest = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "fresh interpreter" not in "".join(seen) + rest  # the workers were forks
    root = out / "checkpoints"
    assert checkpoint_steps(root) == []  # the write stopped before its commit: not visible
    assert os.listdir(shm) == []  # nothing staged in shared memory
    resumed = train_in_ranks([*args, "--out", str(out)], 2)  # resumes by itself
    assert resumed["steps"] == 8
    assert [s for s, _ in checkpoint_steps(root)] == [6, 8]
    assert all(verify_checkpoint(p).ok for _, p in checkpoint_steps(root))
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".owner"]  # nothing leaked
    assert all(not any(p.iterdir()) for p in (root / ".owner").iterdir() if p.is_dir())
