"""A training run's checkpoints over its life: save / prune / resume in two lines
(``Checkpointer``), one job owning the output directory, and in-memory snapshots.

Built on the checkpoint I/O room (``fsdp_ext.checkpoint``), which never imports this one.
"""

from fsdp_ext.job.blob_ownership import BlobOwnership, claim_blob
from fsdp_ext.job.blob_run import published_steps
from fsdp_ext.job.checkpointer import Checkpointer, ModelOptimizerState
from fsdp_ext.job.ownership import (
    LAUNCHER_PID_ENV,
    DirectoryOwnedError,
    Ownership,
    claim,
    exit_with_launcher,
)
from fsdp_ext.job.resume import latest_intact, load_intact
from fsdp_ext.job.snapshot import Snapshots, clean_snapshots, job_name, snapshot_dir

__all__ = [
    "LAUNCHER_PID_ENV",
    "BlobOwnership",
    "Checkpointer",
    "DirectoryOwnedError",
    "ModelOptimizerState",
    "Ownership",
    "Snapshots",
    "claim",
    "claim_blob",
    "clean_snapshots",
    "exit_with_launcher",
    "job_name",
    "latest_intact",
    "load_intact",
    "published_steps",
    "snapshot_dir",
]
