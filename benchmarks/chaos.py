"""Chaos: a 3-node x 2-rank lab job under a seeded schedule of faults, beside a fault-free one.

    python benchmarks/chaos.py [--quick] [--seed 0] [--faults 12] [--min-nodes 3]
                                [--no-warm-workers]

The lab: 3 nodes x 2 ranks, 1 Gbit/s links and storage, the rendezvous in etcd off the
training nodes (``--rdzv etcd``: node 0 may be lost too). examples/train.py (tiny model,
``--comm stock``) runs twice in one invocation, with the same flags: once without faults,
then under the schedule (benchmarks/chaos_schedule.py), struck from outside the job
(benchmarks/chaos_strike.py: ``ip netns pids`` and signals, driven by rank 0's step lines).
Both run with ``--max-restarts`` to spare, ``--replace-failed --min-nodes 3`` (every step on
the full world of 6 ranks), ``--snapshot-every 1`` and a checkpoint every ``ckpt_every`` steps,
all kept. Every node forks its workers from a warm server (``--warm-workers``, the default:
fsdp_ext/warm, which imported torch and examples.train once), so a restart does not pay a
fresh interpreter's imports; ``--no-warm-workers`` starts fresh interpreters, as before.
With them, a pre-booted spare (``--warm-spare``, the default) gives a fresh node's torchrun
agent and workers, forked, so a replacement pays no imports.

The last line is one JSON object: ``faults``, ``hangs`` (stretches of more than ``hang_s``
without a new step, or the job stopped at its timeout), ``restarts`` (rank 0's ``resuming:``
lines), ``lost_steps`` per fault (steps done twice) with its ``recovery_s`` (from the strike
to the first new step), ``goodput`` (the fault-free median step time x steps / wall time) and
``goodput_over_fault_free``, ``final_state_equal`` (losses, and every model and optimizer
tensor of both final checkpoints, loaded here with DCP, bit for bit) and
``checkpoints_lost_or_corrupt`` (every checkpoint published, each verified). With
``--min-nodes 2`` the world shrinks while a fresh node comes, so the run reports ``loss_gap``
(the largest difference of the losses at the same steps) instead of equality. ``startup``
gives, per run, rank 0's ``interpreter+imports`` seconds of every start (examples/startup.py:
from the worker process's start, which is its fork under warm workers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.chaos_schedule import ChaosFault, schedule  # noqa: E402
from benchmarks.chaos_state import (  # noqa: E402
    RunEnd,
    checkpoint_audit,
    compare_runs,
    load_checkpoint,
)
from benchmarks.chaos_strike import Striker  # noqa: E402
from fsdp_ext.lab import Cluster, teardown_on_termination  # noqa: E402

__all__ = ["main", "measure"]

NODES, RANKS_PER_NODE = 3, 2
# batch 12: 2 sequences per rank on 6 ranks, 3 on 4 (the --min-nodes 2 variant)
TINY = ["--batch-size", "12", "--seq-len", "32", "--dim", "32", "--n-layers", "2"]
TINY += ["--n-heads", "2", "--hidden-dim", "32", "--num-experts", "2", "--val-batches", "1"]
TINY += ["--log-every", "1", "--comm", "stock", "--keep", "100000"]
LEASE_S = 5.0  # the checkpoint lock's lease: a node-pause lasts two
STEP = re.compile(r"^step\s+(\d+) \| loss (\S+) .*\|\s+(\S+) ms/step")
RESUMED = re.compile(r"resumed from \S+step-(\d+) at step")
STARTUP = re.compile(r"^startup \| interpreter\+imports (\S+) s")
FULL = {"steps": 200, "ckpt_every": 10, "faults": 12, "timeout": 2400.0, "hang_s": 240.0}
QUICK = {"steps": 50, "ckpt_every": 5, "faults": 5, "timeout": 900.0, "hang_s": 180.0}


def parse(lines: list[tuple[float, str]]) -> dict:
    """Rank 0's step lines (step, loss, ms, when), restarts, resumes (step, when) and the
    interpreter+imports seconds of each start."""
    steps, loading, resumed, startup = [], [], [], []
    for at, line in lines:
        if m := STARTUP.match(line):
            startup.append(float(m.group(1)))
        elif m := STEP.match(line):
            steps.append((int(m.group(1)), float(m.group(2)), float(m.group(3)), at))
        elif line.startswith("resuming:"):
            loading.append(at)
        elif m := RESUMED.search(line):
            resumed.append((int(m.group(1)), at))
    return {"steps": steps, "loading": loading, "resumed": resumed, "startup": startup}


def _progress(steps: list[tuple], start: float, end: float) -> list[tuple[int, float]]:
    """(step, when) of each step line that went further than every line before it."""
    out, best = [], 0
    for step, _loss, _ms, at in steps:
        if step > best:
            out.append((step, at))
            best = step
    return [(0, start), *out, (best, end)]


def measure(
    parsed: dict, struck: list, start: float, end: float, hang_s: float, timed_out: bool
) -> dict:
    """Hangs, restarts, and per fault: steps done twice and seconds to the next new step."""
    progress = _progress(parsed["steps"], start, end)
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(progress)]
    hangs = sum(gap > hang_s for gap in gaps) + int(timed_out)
    per_fault = []
    for i, hit in enumerate(struck):
        upto = struck[i + 1].at if i + 1 < len(struck) else end
        resumes = [(s, at) for s, at in parsed["resumed"] if hit.at <= at < upto]
        lost = 0
        if resumes:
            step, at = resumes[0]
            before = [s for s, _l, _m, t in parsed["steps"] if t < at]
            lost = max(0, max(before, default=0) - step)
        best = max((s for s, _l, _m, t in parsed["steps"] if t < hit.at), default=0)
        new = [t for s, _l, _m, t in parsed["steps"] if t >= hit.at and s > best]
        per_fault.append(
            {
                "fault": hit.fault.describe(),
                "at_s": round(hit.at - start, 1),
                "lost_steps": lost,
                "recovery_s": round(new[0] - hit.at, 1) if new else None,
                "note": hit.note,
            }
        )
    return {"hangs": hangs, "restarts": len(parsed["loading"]), "lost_steps": per_fault}


def _losses(parsed: dict) -> dict[int, float]:
    return {step: loss for step, loss, _ms, _at in parsed["steps"]}  # the last run of each


def run_job(lab: Cluster, name: str, flags: list[str], faults: list[ChaosFault], args) -> dict:
    """One job of the lab under ``faults`` (none: the fault-free run); what it did."""
    out = lab.shared_dir / name
    program = [str(REPO / "examples" / "train.py"), *TINY, *flags, "--out", str(out)]
    striker = Striker(lab.topology.node_namespaces, faults, pause_s=2 * LEASE_S)
    striker.start()
    start = time.time()
    try:
        result = lab.run(
            program,
            echo=striker,
            timeout=args.timeout,
            max_restarts=3 * len(faults) + 5,
            min_nodes=args.min_nodes,
            replace_failed=True,
        )
    finally:
        striker.stop()
    end = time.time()
    parsed = parse(striker.lines)
    report = result.last_json() or {}
    print(
        f"chaos: {name}: exit status {result.returncode} in {result.seconds:.1f} s, "
        f"{len(striker.struck)} of {len(faults)} faults struck",
        file=sys.stderr,
        flush=True,
    )
    return {
        "name": name,
        "rc": result.returncode,
        "wall_s": result.seconds,
        "steps_done": report.get("steps"),
        "world_at_end": report.get("world_size"),
        "final_loss": report.get("final_loss"),
        "val_loss": report.get("val_loss"),
        "parsed": parsed,
        "struck": striker.struck,
        "errors": striker.failures + result.problems,
        "measured": measure(parsed, striker.struck, start, end, args.hang_s, result.timed_out),
        "root": out / "checkpoints",
    }


def _final_state(run: dict, steps: int) -> RunEnd:
    path = run["root"] / f"step-{steps:07d}"
    state = load_checkpoint(path) if (path / ".metadata").exists() else {}
    return RunEnd(_losses(run["parsed"]), state)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 steps, 5 faults")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    parser.add_argument("--faults", type=int, default=None, help="default: 12 (quick: 5)")
    parser.add_argument("--steps", type=int, default=None, help="default: 200 (quick: 50)")
    parser.add_argument("--min-nodes", type=int, default=NODES, choices=(1, 2, 3))
    parser.add_argument(
        "--warm-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork workers from a warm server per node (default), or start fresh interpreters",
    )
    parser.add_argument(
        "--warm-spare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with warm workers: a fresh node's agent and workers forked from a pre-booted "
        "spare (default)",
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    steps = args.steps or preset["steps"]
    every = preset["ckpt_every"]
    count = args.faults or preset["faults"]
    args.timeout, args.hang_s = preset["timeout"], preset["hang_s"]
    faults = schedule(
        args.seed, steps, count, nodes=NODES, ranks_per_node=RANKS_PER_NODE, ckpt_every=every
    )
    for fault in faults:
        print(f"chaos: scheduled {fault.describe()}", file=sys.stderr)
    flags = ["--steps", str(steps), "--ckpt-every", str(every), "--snapshot-every", "1"]
    flags += ["--lease", str(LEASE_S)]
    load_before = os.getloadavg()[0]
    warm = {"warm_workers": args.warm_workers}
    if args.warm_workers:
        # torch._dynamo: FSDP2's and DTensor's paths import it on first use (1 s a worker)
        warm["warm_preload"] = ["examples.train", "torch._dynamo"]
        warm["warm_spare"] = args.warm_spare
    with Cluster(NODES, RANKS_PER_NODE, "1gbit", rdzv="etcd", **warm) as lab:
        free = run_job(lab, "fault-free", flags, [], args)
        chaos = run_job(lab, "chaos", flags, faults, args)
        step_ms = statistics.median(ms for _s, _l, ms, _at in free["parsed"]["steps"])
        useful = steps * step_ms / 1e3
        compared = compare_runs(_final_state(chaos, steps), _final_state(free, steps))
        audit = checkpoint_audit(chaos["root"], steps, every)
    goodput = round(useful / chaos["wall_s"], 3)
    goodput_free = round(useful / free["wall_s"], 3)
    summary = {
        "benchmark": "chaos",
        "lab": f"{NODES} nodes x {RANKS_PER_NODE} ranks, 1gbit, --rdzv etcd",
        "seed": args.seed,
        "steps": steps,
        "ckpt_every": every,
        "snapshot_every": 1,
        "min_nodes": args.min_nodes,
        "warm_workers": args.warm_workers,
        "warm_spare": args.warm_workers and args.warm_spare,
        "finished": chaos["rc"] == 0 and chaos["steps_done"] == steps,
        "faults": len(chaos["struck"]),
        "faults_scheduled": len(faults),
        **chaos["measured"],
        "step_ms_fault_free": step_ms,
        "wall_s": round(chaos["wall_s"], 1),
        "wall_s_fault_free": round(free["wall_s"], 1),
        "goodput": goodput,
        "goodput_fault_free": goodput_free,
        "goodput_over_fault_free": round(goodput / goodput_free, 3),
        "final_loss": chaos["final_loss"],
        "final_loss_fault_free": free["final_loss"],
        "world_at_end": chaos["world_at_end"],
        "checkpoints_lost_or_corrupt": audit["checkpoints_lost_or_corrupt"],
        "checkpoints": {k: audit[k] for k in ("published", "lost", "corrupt")},
        "startup": {
            "interpreter_imports_s": chaos["parsed"]["startup"],
            "interpreter_imports_s_fault_free": free["parsed"]["startup"],
        },
        "errors": chaos["errors"][:10],
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    if args.min_nodes < NODES:
        ours, ref = _losses(chaos["parsed"]), _losses(free["parsed"])
        gaps = [abs(ours[s] - ref[s]) for s in ours if s in ref]
        summary["loss_gap"] = round(max(gaps), 5) if gaps else None
        summary["final_state_equal"] = compared["final_state_equal"]
    else:
        summary.update(compared)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    teardown_on_termination()  # SIGTERM tears the lab down, as Ctrl-C does
    main()
