"""How long a lab job takes to recover by itself when node 1 is lost, and what it costs.

    python benchmarks/recovery.py [--quick] [--plot docs/recovery_loss.png]
    python benchmarks/recovery.py --peer torchft [--quick] [--torchft-path DIR]
                                 [--no-warm-workers]

The lab: 2 nodes x 2 ranks, 1 Gbit/s links and storage, examples/train.py (tiny model,
--comm stock) with checkpoints on the shared directory, torchrun --max-restarts 3
--min-nodes 1. Every process of node 1 gets SIGKILL (from outside, ``ip netns pids``) at
one of three moments:

- ``step``: in the middle of a checkpoint interval, during a step;
- ``save``: right after a checkpointed step's line, while its checkpoint is written;
- ``load``: rank 3 is killed first; node 1 is lost while the restarted workers load;
- ``replace``: as ``step``, in a fixed-size job (2 nodes) whose lost node the lab replaces
  (``--replace-failed``), as a scheduler would; ``replace+snapshots``: the same with
  ``--snapshot-every K``, where the fresh node's ranks get their shards from the copy node
  0 holds in RAM (Gemini), and lose at most K steps instead of a checkpoint interval.

Per scenario: ``detect_s`` (from the loss to the restarted workers starting to load),
``restart_s`` (to the first new step), ``lost_steps`` (steps done twice), ``goodput`` (the
baseline's step time x steps / wall time) and ``loss_gap`` (the largest difference between
the resumed losses and the uninterrupted run's at the same steps; the resumed run has 2
ranks instead of 4, so float rounding only). A run without failures is the baseline, in
the same invocation. ``breakdown`` splits ``restart_s``: torchrun's detection (from the
loss to node 0's agent declaring its worker group failed) and rendezvous (from its INFO log),
then the new rank 0's own phases (its ``startup |`` line): spawn, interpreter and imports,
process group, model, corpus, checkpoint load, first step. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fsdp_ext.lab import Cluster, Fault, teardown_on_termination  # noqa: E402

TINY = ["--batch-size", "4", "--seq-len", "32", "--dim", "32", "--n-layers", "2"]
TINY += ["--n-heads", "2", "--hidden-dim", "32", "--num-experts", "2", "--val-batches", "1"]
TINY += ["--log-every", "1", "--comm", "stock"]
TINY += ["--no-async-save"]  # synchronous saves: the steps lost are theirs, as in docs/recovery.md
STEP = re.compile(r"^step\s+(\d+) \| loss (\S+) .*\|\s+(\S+) ms/step")
RESUMED = re.compile(r"resumed from \S+step-(\d+) at step")
STARTUP = re.compile(r"startup \| (.*) \| process start (\S+)")
AGENT_LINE = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")
SURVIVORS = {"max_restarts": 3, "min_nodes": 1}  # node 1 lost: node 0 goes on alone
REPLACED = {"max_restarts": 3, "replace_failed": True}  # 2 nodes: a fresh node 1 joins


def snapshot_every(every: int) -> int:
    return max(1, every // 4)


def scenarios(steps: int, every: int) -> dict[str, tuple[list[Fault], dict, list[str]]]:
    """name: (faults, the lab's elastic options, train.py's extra flags)."""
    mid = steps // 2 + every // 2  # half way through an interval
    save = (steps // 2 // every + 1) * every  # a checkpointed step
    kill_1 = Fault("kill-node", 1, on_output=f"step {mid:5d} |")
    snap = ["--snapshot-every", str(snapshot_every(every))]
    return {
        "baseline": ([], SURVIVORS, []),
        "step": ([kill_1], SURVIVORS, []),
        "save": ([Fault("kill-node", 1, on_output=f"step {save:5d} |")], SURVIVORS, []),
        "load": (
            [
                Fault("kill-rank", 3, on_output=f"step {mid:5d} |"),
                Fault("kill-node", 1, on_output="resuming:"),
            ],
            SURVIVORS,
            [],
        ),
        "replace": ([kill_1], REPLACED, []),
        "replace+snapshots": ([kill_1], REPLACED, snap),
    }


def _agent_times(console: str, day: datetime.datetime) -> list[tuple[float, str]]:
    """(seconds since the epoch, text) of torchrun's own log lines (INFO and up)."""
    out = []
    for line in console.splitlines():
        if m := AGENT_LINE.match(line):
            h, mnt, sec = int(m.group(1)), int(m.group(2)), float(m.group(3))
            at = day.replace(hour=h, minute=mnt, second=0, microsecond=0).timestamp() + sec
            out.append((at, line))
    return out


def breakdown(result, lost_at: float) -> dict | None:
    """Where restart_s went: torchrun's detection and rendezvous, the new rank 0's phases."""
    lost = result.started_at + lost_at
    day = datetime.datetime.fromtimestamp(result.started_at)
    agent = [(t, ln) for t, ln in _agent_times(result.consoles[0], day) if t >= lost]
    failed = next((t for t, ln in agent if "Worker group FAILED" in ln), None)
    rdzv = next((t for t, ln in agent if "Rendezvous complete" in ln), None)
    starts = [STARTUP.search(ln) for ln in result.output.splitlines()]
    after = [m for m in starts if m and float(m.group(2)) >= lost]
    if failed is None or rdzv is None or not after:
        return None
    row = {"detect": round(failed - lost, 2), "rendezvous": round(rdzv - failed, 2)}
    row["spawn"] = round(float(after[0].group(2)) - rdzv, 2)
    for part in after[0].group(1).split(" | "):  # "interpreter+imports 6.10 s"
        name, _, secs = part.removesuffix(" s").rpartition(" ")
        row[name] = float(secs)
    return row


def parse(result) -> dict:
    """Rank 0's steps (with the second each line came) and restarts, from its output."""
    lines = result.output.splitlines(keepends=True)
    steps, resumes = [], []
    for line, at in zip(lines, result.line_times, strict=False):
        if m := STEP.match(line):
            steps.append((int(m.group(1)), float(m.group(2)), float(m.group(3)), at))
        elif line.startswith("resuming:"):
            resumes.append(("loading", at))
        elif m := RESUMED.search(line):
            resumes.append((int(m.group(1)), at))
    return {"steps": steps, "resumes": resumes}


def measure(name: str, result, baseline: dict | None, step_s: float | None) -> dict:
    parsed = parse(result)
    row = {"scenario": name, "rc": result.returncode, "wall_s": round(result.seconds, 2)}
    report = result.last_json() or {}
    row["final_step"] = report.get("steps")
    row["world_at_end"] = report.get("world_size")
    if step_s is not None and row["final_step"]:
        row["goodput"] = round(row["final_step"] * step_s / result.seconds, 3)
    if not result.faults:
        return row
    lost_at = result.faults[-1].at_s  # node 1's loss (the last fault struck)
    loading = [at for what, at in parsed["resumes"] if what == "loading" and at >= lost_at]
    resumes = [(what, at) for what, at in parsed["resumes"] if what != "loading"]
    back = [(what, at) for what, at in resumes if at >= lost_at]
    # a step under way when the fault struck may still print: the new steps are those
    # after the resumed line, the lost ones those before the first restart's
    resumed_at = back[0][1] if back else float("inf")
    first_resume = resumes[0][1] if resumes else float("inf")
    after = [s for s in parsed["steps"] if s[3] >= resumed_at]
    before = [s for s in parsed["steps"] if s[3] < first_resume]
    row["detect_s"] = round(loading[0] - lost_at, 2) if loading else None
    row["restart_s"] = round(after[0][3] - lost_at, 2) if after else None
    if back and before:
        row["resumed_from"] = back[-1][0]
        row["lost_steps"] = before[-1][0] - resumes[0][0]
    if baseline is not None:
        straight = {s[0]: s[1] for s in baseline["steps"]}
        gaps = [abs(s[1] - straight[s[0]]) for s in after if s[0] in straight]
        row["loss_gap"] = round(max(gaps), 5) if gaps else None
    row["breakdown"] = breakdown(result, lost_at)
    row["faults"] = [f"{e.at_s:.1f} s: {e.note}" for e in result.faults]
    return row


def plot(baseline: dict, failed: dict, lost_at: float, fault_step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    base = baseline["steps"]
    ax.plot(
        [s[0] for s in base], [s[1] for s in base], lw=3, alpha=0.4, label="no failure, 4 ranks"
    )
    before = [s for s in failed["steps"] if s[3] < lost_at]
    after = [s for s in failed["steps"] if s[3] >= lost_at]
    ax.plot(
        [s[0] for s in before],
        [s[1] for s in before],
        ".",
        ms=4,
        label="4 ranks, until node 1 is lost",
    )
    ax.plot(
        [s[0] for s in after], [s[1] for s in after], "x", ms=4, label="2 ranks on node 0, resumed"
    )
    ax.axvline(fault_step, color="red", ls="--", lw=1, label=f"node 1 lost (step {fault_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 steps, checkpoints every 4")
    parser.add_argument("--plot", type=Path, default=None, help="loss curve PNG (step scenario)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument(
        "--peer",
        choices=("torchft",),
        default=None,
        help="node 1 lost at step 30 of 100 under ours and under the peer, side by side",
    )
    parser.add_argument(
        "--torchft-path",
        default=os.environ.get("TORCHFT_PATH"),
        help="directories to import torchft from (pip install --target DIR torchft==0.2.0)",
    )
    parser.add_argument(
        "--warm-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --peer: our workers forked from a warm server per node, and a fresh node "
        "from a pre-booted spare, as chaos.py runs them (default); or fresh interpreters",
    )
    args = parser.parse_args(argv)
    if args.peer == "torchft":
        from benchmarks.recovery_peer import compare

        summary = compare(args.quick, args.timeout, args.torchft_path, args.warm_workers)
        print(json.dumps(summary))
        return summary
    steps, every = (16, 4) if args.quick else (60, 10)
    results, parsed = {}, {}
    env = {**os.environ, "LOGLEVEL": "INFO"}  # torchrun's agent logs its steps, with times
    with Cluster(2, 2, "1gbit") as lab:
        for name, (faults, elastic, flags) in scenarios(steps, every).items():
            out = lab.shared_dir / name
            program = [str(REPO / "examples" / "train.py"), *TINY, "--steps", str(steps)]
            program += ["--ckpt-every", str(every), "--out", str(out), *flags]
            results[name] = lab.run(
                program, env=env, faults=faults, timeout=args.timeout, **elastic
            )
            parsed[name] = parse(results[name])
            print(
                f"{name}: rc {results[name].returncode} in {results[name].seconds:.1f} s",
                file=sys.stderr,
            )
    base = parsed["baseline"]
    step_s = statistics.median(s[2] for s in base["steps"]) / 1e3 if base["steps"] else None
    rows = [measure(n, r, base, step_s) for n, r in results.items()]
    for row in rows:
        print(json.dumps(row))
    if args.plot is not None:
        fault_step = int(scenarios(steps, every)["step"][0][0].on_output.split()[1])
        lost_at = results["step"].faults[-1].at_s if results["step"].faults else float("inf")
        plot(base, parsed["step"], lost_at, fault_step, args.plot)
    failed = [r for r in rows if r["scenario"] != "baseline"]
    summary = {
        "benchmark": "recovery",
        "lab": "2 nodes x 2 ranks, 1gbit",
        "steps": steps,
        "ckpt_every": every,
        "snapshot_every": snapshot_every(every),
        "baseline_wall_s": rows[0]["wall_s"],
        "baseline_goodput": rows[0].get("goodput"),
        "all_finished": all(r["rc"] == 0 and r["final_step"] == steps for r in rows),
        "max_lost_steps": max((r.get("lost_steps") or 0) for r in failed),
        "max_restart_s": max((r.get("restart_s") or 0) for r in failed),
        "scenarios": {
            r["scenario"]: {
                k: r.get(k)
                for k in (
                    "detect_s",
                    "restart_s",
                    "lost_steps",
                    "goodput",
                    "loss_gap",
                    "wall_s",
                    "world_at_end",
                    "breakdown",
                )
            }
            for r in rows
        },
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    teardown_on_termination()  # SIGTERM tears the lab down, as Ctrl-C does
    main()
