"""A rank that reports itself in the shared directory, then sleeps (standard library only).

    sleeper.py SHARED_DIR SECONDS [KILL_RANK]

Every rank writes SHARED_DIR/rank<R>.pid. The rank KILL_RANK, once every rank has written
its file, kills itself with SIGKILL, as an out-of-memory killer would.
"""

import os
import signal
import sys
import time
from pathlib import Path

shared, seconds = Path(sys.argv[1]), float(sys.argv[2])
kill_rank = int(sys.argv[3]) if len(sys.argv) > 3 else -1
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
(shared / f"rank{rank}.pid").write_text(str(os.getpid()))
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    if rank == kill_rank and len(list(shared.glob("rank*.pid"))) == world:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
