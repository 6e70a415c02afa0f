"""``benchmarks/recovery.py --peer torchft``: our recovery and torchft's, side by side.

One lab of 2 nodes x 2 ranks, 1 Gbit/s, the same model, data and flags (recovery.py's tiny
train.py). Each system runs twice: without a fault, and with node 1 lost, unannounced (every
process of its namespace killed), when rank 0 prints step 30 of 100 (--quick: 12 of 40).

- ours: train.py under the lab's torchrun, ``--max-restarts 3 --min-nodes 1``, checkpoints
  every 10 steps and ``--snapshot-every 1``, its workers forked from a warm server per node
  and a fresh node from a pre-booted spare (``warm``, as chaos.py runs them): the survivors
  restart and resume on node 0, from the disk (a snapshot holds one world size's shards,
  and the world went from 4 to 2);
- ``ours_replaced``: the same with ``--replace-failed`` instead: a fresh node 1 joins, the
  world stays 4, and the ranks resume from the in-memory snapshot (node 1's from node 0's copy);
- torchft 0.2.0: one replica group per node (benchmarks/torchft_train.py), its lighthouse on
  node 0; the survivor drops node 1 from its quorum and goes on, with no restart.

Per system: ``recovery_s`` (from the kill to the first step beyond the last one before it),
``lost_steps`` (steps computed and thrown away: redone after a resume, or not committed),
``goodput`` (the system's own fault-free median step time x steps / wall time) and
``final_loss`` against its own fault-free run. The last line is one JSON object.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

from benchmarks.recovery_torchft import run_torchft, torchft_missing
from fsdp_ext.lab import Cluster, Fault

__all__ = ["compare"]

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step\s+(\d+) \| loss (\S+) .*\|\s+(\S+) ms/step")
RESUMED = re.compile(r"resumed from \S+step-(\d+) at step")
NOT_COMMITTED = "not committed"


def _steps(lines: list[tuple[float, str]]) -> list[tuple[int, float, float, float]]:
    """(step, loss, ms, when) of every step line."""
    out = []
    for at, line in lines:
        if m := STEP.search(line):
            out.append((int(m.group(1)), float(m.group(2)), float(m.group(3)), at))
    return out


def figures(lines, struck_at: float | None, wall_s: float, step_ms: float, steps: int) -> dict:
    """recovery_s, lost_steps, goodput and final_loss of one run (times: seconds since the
    epoch; ``step_ms``: the same system's fault-free median)."""
    done = _steps(lines)
    row = {"goodput": round(steps * step_ms / 1e3 / wall_s, 3) if wall_s else None}
    row["final_loss"] = done[-1][1] if done else None
    row["final_step"] = max((s for s, *_ in done), default=0)
    if struck_at is None:
        return row
    best = max((s for s, _l, _m, t in done if t < struck_at), default=0)
    new = [t for s, _l, _m, t in done if t >= struck_at and s > best]
    row["recovery_s"] = round(new[0] - struck_at, 2) if new else None
    resumed = [int(m.group(1)) for at, ln in lines if at >= struck_at and (m := RESUMED.search(ln))]
    uncommitted = sum(NOT_COMMITTED in ln for at, ln in lines if at >= struck_at)
    if resumed:  # ours: the steps done again after the resume
        row["lost_steps"] = max(0, max((s for s, *_ in done if s <= best), default=0) - resumed[0])
    else:  # torchft: the steps computed and not committed
        row["lost_steps"] = uncommitted
    return row


def _ours(
    lab: Cluster,
    flags: list[str],
    name: str,
    trigger: str,
    env: dict,
    timeout: float,
    replace: bool = False,
):
    """(lines with when, struck at, wall s, exit status) of train.py in the lab, elastic:
    the survivors go on (``--min-nodes 1``), or a fresh node 1 comes (``--replace-failed``)."""
    faults = [Fault("kill-node", 1, on_output=trigger)] if name == "fault" else []
    out = lab.shared_dir / f"{name}{'-replaced' if replace else ''}"
    program = [str(REPO / "examples" / "train.py"), *flags, "--out", str(out)]
    elastic = {"replace_failed": True} if replace else {"min_nodes": 1}
    result = lab.run(program, env=env, faults=faults, timeout=timeout, max_restarts=3, **elastic)
    if result.returncode != 0:
        tail = "".join(result.output.splitlines(keepends=True)[-12:])
        print(f"recovery: ours, {name}: {result.problems}\n{tail}", file=sys.stderr)
    text = result.output.splitlines(keepends=True)
    lines = [(result.started_at + t, ln) for t, ln in zip(result.line_times, text, strict=False)]
    struck = result.started_at + result.faults[0].at_s if result.faults else None
    return lines, struck, result.seconds, result.returncode


def compare(quick: bool, timeout: float, torchft_path: str | None, warm: bool = True) -> dict:
    steps, fault_step, every = (40, 12, 5) if quick else (100, 30, 10)
    flags = ["--batch-size", "4", "--seq-len", "32", "--dim", "32", "--n-layers", "2"]
    flags += ["--n-heads", "2", "--hidden-dim", "32", "--num-experts", "2"]
    flags += ["--val-batches", "1", "--log-every", "1", "--comm", "stock"]
    flags += ["--steps", str(steps)]
    trigger = f"step {fault_step:5d} |"
    env = dict(os.environ)
    if torchft_path:
        env["PYTHONPATH"] = os.pathsep.join([torchft_path, str(REPO), env.get("PYTHONPATH", "")])
    missing = torchft_missing(env=env)
    out: dict = {"benchmark": "recovery --peer torchft", "lab": "2 nodes x 2 ranks, 1gbit"}
    out["warm_workers"] = warm
    out |= {
        "steps": steps,
        "fault": f"node 1 lost (SIGKILL to all its processes) at step {fault_step}",
    }
    out["load_before"] = round(os.getloadavg()[0], 2)
    ours_flags = [*flags, "--ckpt-every", str(every), "--snapshot-every", "1"]
    # torchft's jobs come between ours: a lab job makes a node lost by the one before whole
    # again (a fresh sshfs mount), which torchft's own launch (lab.popen) does not
    order = [("ours", "free"), ("torchft", "free"), ("torchft", "fault"), ("ours", "fault")]
    order += [("ours_replaced", "fault")]
    # torch._dynamo: FSDP2's and DTensor's paths import it on first use (as in chaos.py)
    options = {"warm_preload": ["examples.train", "torch._dynamo"], "warm_spare": True}
    with Cluster(2, 2, "1gbit", warm_workers=warm, **(options if warm else {})) as lab:
        runs = {}
        for system, name in order:
            if system.startswith("ours"):
                replace = system == "ours_replaced"
                runs[(system, name)] = _ours(lab, ours_flags, name, trigger, env, timeout, replace)
            elif missing is None:
                at = trigger if name == "fault" else None
                run = run_torchft(
                    lab, flags, name=f"torchft-{name}", kill_node_at=at, env=env, timeout=timeout
                )
                rc = run.returncodes[0] if run.returncodes else None
                runs[(system, name)] = (run.lines[0], run.struck_at, run.seconds, rc)
                if rc != 0:
                    tail = "".join(ln for _t, ln in run.lines[0][-15:])
                    print(f"recovery: torchft, {name}: last lines\n{tail}", file=sys.stderr)
            status = runs[(system, name)][3] if (system, name) in runs else "not run"
            print(f"recovery: {system}, {name}: exit status {status}", file=sys.stderr)
    runs[("ours_replaced", "free")] = runs[("ours", "free")]  # the same fault-free run
    for system in ("ours", "ours_replaced", "torchft"):
        if (system, "free") not in runs:
            out[f"error_{system}"] = missing
            continue
        free_lines, _, free_wall, free_rc = runs[(system, "free")]
        if not _steps(free_lines):
            tail = " | ".join(ln.strip() for _t, ln in free_lines[-5:])
            out[f"error_{system}"] = f"no step line (exit status {free_rc}): {tail}"
            continue
        step_ms = statistics.median(ms for _s, _l, ms, _t in _steps(free_lines))
        free = figures(free_lines, None, free_wall, step_ms, steps)
        lines, struck, wall, rc = runs[(system, "fault")]
        hit = figures(lines, struck, wall, step_ms, steps)
        out[f"recovery_s_{system}"] = hit.get("recovery_s")
        out[f"lost_steps_{system}"] = hit.get("lost_steps")
        out[f"goodput_{system}"] = hit["goodput"]
        out[f"goodput_fault_free_{system}"] = free["goodput"]
        out[f"final_loss_{system}"] = hit["final_loss"]
        out[f"final_loss_fault_free_{system}"] = free["final_loss"]
        out[f"finished_{system}"] = rc == 0 and hit["final_step"] == steps and free_rc == 0
        out[f"step_ms_{system}"] = step_ms
    out["load_after"] = round(os.getloadavg()[0], 2)
    return out
