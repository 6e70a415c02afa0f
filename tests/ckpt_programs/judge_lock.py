"""Print the lock holder's stale reason (or 'alive') for the lock of ARGV[1]."""

import os
import sys
from pathlib import Path

from fsdp_ext.checkpoint.lock import LockOwner, lock_path

holder = LockOwner.decode(os.readlink(lock_path(Path(sys.argv[1]))))
print(f"holder pid {holder.pid}, me {os.getpid()}: {holder.stale_reason() or 'alive'}", flush=True)
