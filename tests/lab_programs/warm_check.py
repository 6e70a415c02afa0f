"""A rank that says where it came from (standard library only).

    warm_check.py SHARED_DIR

Every rank writes SHARED_DIR/rank<R>.<PHASE>.<PID>.json: its parent's command line,
whether torch was imported before this program ran, and its network namespace's inode.
PHASE is "before" until a rank was lost, "after" from then on. Before: rank 0 prints
"ready" once every rank has written its file, then every rank waits until one of them is
gone (killed from outside) and fails, as the survivors of a collective would, after
leaving the file "struck". After: exit 0.
"""

import json
import os
import sys
import time
from pathlib import Path

shared = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
phase = "after" if (shared / "struck").exists() else "before"
parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
netns = os.stat("/proc/self/ns/net").st_ino
record = {"pid": os.getpid(), "parent": parent, "torch": "torch" in sys.modules, "netns": netns}
(shared / f"rank{rank}.{phase}.{os.getpid()}.json").write_text(json.dumps(record))
if phase == "before":
    while len(list(shared.glob("rank*.before.*.json"))) < world:
        time.sleep(0.05)
    if rank == 0:
        print("ready", flush=True)
    pids = [json.loads(f.read_text())["pid"] for f in shared.glob("rank*.before.*.json")]
    while all(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.05)
    (shared / "struck").touch()
    sys.exit(1)
