"""Take the lock of ARGV[1] and exit without releasing it (os._exit: no cleanup)."""

import os
import sys
from pathlib import Path

from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.lock import LockOwner, acquire

acquire(LocalStorage(), Path(sys.argv[1]), LockOwner.here("save-dead"))
print(os.getpid(), flush=True)
os._exit(0)
