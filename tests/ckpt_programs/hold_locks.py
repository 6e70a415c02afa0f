"""A job that owns ROOT and holds the lock of ROOT/step-0000005, then waits to be killed."""

import sys
import time
from pathlib import Path

from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.lock import LockOwner, acquire
from fsdp_ext.job.ownership import claim

root, lease = Path(sys.argv[1]), float(sys.argv[2])
claim(root, lease_s=lease)
acquire(LocalStorage(), root / "step-0000005", LockOwner.here("save-b", lease_s=lease))
print("held", flush=True)
time.sleep(600)
