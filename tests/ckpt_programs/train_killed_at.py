"""examples/train.py whose worker kills itself (SIGKILL) at one point of a background save,
a different point in each torchrun attempt: ``$KILL_PLAN`` holds one point per attempt,
comma-separated, each ``RANK/WHAT``:

- ``R/stage`` : rank R, in the middle of staging (after its third buffer copy);
- ``R/OP@NAME``: rank R, in the background save thread, before the first storage operation
  ``OP`` (write, rename, exchange, fsync...) on a path whose last part matches the regular
  expression ``NAME``;
- ``R/pause@OP@NAME``: the same point, where the background thread stops for
  ``$PAUSE_S`` seconds (default 600) instead, printing ``paused:``, then goes on;
- ``-``: no kill in that attempt.

A kill strikes only the first save of an attempt (the save after its resume); a pause, the
first save that reaches its point.
"""

import os
import re
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.job import staging

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ.get("RANK", "0"))
plan = os.environ["KILL_PLAN"].split(",")
point = plan[attempt] if attempt < len(plan) else "-"
who, _, what = point.partition("/")


def _die(where: str) -> None:
    print(f"killed: attempt {attempt} rank {rank} at {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if point != "-" and int(who) == rank:
    if what == "stage":
        copy = staging.StagingBuffers._copy
        calls = [0]

        def _copy(self, buffer, source):
            calls[0] += 1
            if calls[0] == 3:
                _die("staging")
            return copy(self, buffer, source)

        staging.StagingBuffers._copy = _copy
    else:
        pause = what.startswith("pause@")
        op_name, _, name = what.removeprefix("pause@").partition("@")
        first_save: list[str] = []

        def before(self, op, path):
            thread = threading.current_thread().name
            if not thread.startswith("fsdp_ext-save"):
                return
            if not first_save:
                first_save.append(thread)
            struck = op == op_name and re.fullmatch(name, Path(path).name)
            if "done" in first_save or not struck or (thread != first_save[0] and not pause):
                return
            if not pause:
                _die(f"{op} {path}")
            print(f"paused: rank {rank} at {op} {path}", file=sys.stderr, flush=True)
            first_save.append("done")  # pause once
            time.sleep(float(os.environ.get("PAUSE_S", "600")))

        LocalStorage.before = before

sys.argv = [str(Path(__file__).resolve().parents[2] / "examples" / "train.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
