"""A job that survives restarts by itself: all-reduces in a loop, and says where it is.

    elastic_check.py STEPS STEP_S [SHARED_DIR]

Rank 0 prints ``step N world W attempt A`` after each step, and at the end one JSON line
with the world size, torchrun's restart count and the sum the last all-reduce gave
(1 + 2 + ... + W: every rank took part). With SHARED_DIR, every rank also writes (and
fsyncs) a small file there after each step.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

steps, step_s = int(sys.argv[1]), float(sys.argv[2])
shared = sys.argv[3] if len(sys.argv) > 3 else None
started = time.monotonic()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
x = torch.zeros(1)
for step in range(1, steps + 1):
    x = torch.full((1024,), float(rank + 1))
    dist.all_reduce(x)
    if shared is not None:
        with open(os.path.join(shared, f"rank{rank}.step"), "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
    if rank == 0:
        print(f"step {step} world {world} attempt {attempt}", flush=True)
    time.sleep(step_s)
if rank == 0:
    report = {"world": world, "attempt": attempt, "sum": float(x[0])}
    report["group_world"] = int(os.environ["GROUP_WORLD_SIZE"])
    report["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(report), flush=True)
dist.destroy_process_group()
