"""The tiny examples/train.py that the job-life, ownership, lab and recovery tests launch (one
layer, two experts, one validation batch, a progress line every step; no loss plot: drawing it
imports matplotlib, about 1.3 s of CPU per run, and test_train.py checks the plot), and the
uninterrupted runs they compare against."""

TINY = ["--batch-size", "4", "--seq-len", "16", "--dim", "16", "--n-layers", "1"]
TINY += ["--n-heads", "2", "--hidden-dim", "16", "--num-experts", "2", "--val-batches", "1"]
TINY += ["--log-every", "1", "--no-plot"]


def _main(argv: list[str], stdout: str | None) -> dict | None:
    import contextlib
    import os

    from examples.train import main

    if stdout is None:
        return main(argv, own_process_group=False)
    # the ranks fork from a server started before the test, so its capture never sees them
    with open(f"{stdout}.{os.environ['RANK']}", "w") as out, contextlib.redirect_stdout(out):
        return main(argv, own_process_group=False)


def train_in_ranks(argv: list[str], nproc: int, stdout: str | None = None) -> dict:
    """``examples/train.py ARGV`` as ``nproc`` ranks of the test harness: the same program,
    one thread per rank and gloo, as under torchrun, so the same numbers and checkpoints,
    without a launcher, an agent and fresh interpreters (about 15 CPU-s a run). For the
    uninterrupted runs that tests compare checkpoints against; the launch itself is tested
    where it matters. ``stdout``: each rank prints into ``STDOUT.RANK``. Returns rank 0's
    summary."""
    from fsdp_ext.testing import run_distributed

    return run_distributed(_main, nproc, list(argv), stdout)[0]
