"""The tiny examples/train.py that the job-life, ownership, lab and recovery tests launch: one
layer, two experts, one validation batch, a progress line every step. No loss plot: drawing it
imports matplotlib, about 1.3 s of CPU per run; test_train.py checks the plot."""

TINY = ["--batch-size", "4", "--seq-len", "16", "--dim", "16", "--n-layers", "1"]
TINY += ["--n-heads", "2", "--hidden-dim", "16", "--num-experts", "2", "--val-batches", "1"]
TINY += ["--log-every", "1", "--no-plot"]
