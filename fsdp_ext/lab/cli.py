"""``python -m fsdp_ext.lab``: run a script on an emulated multi-node cluster.

python -m fsdp_ext.lab run --nodes 2 --ranks-per-node 2 --link 200mbit -- examples/train.py
python -m fsdp_ext.lab run --nodes 2 --ranks-per-node 2 --link 1gbit --max-restarts 3 \
    --min-nodes 1 --kill-node 1 --kill-after 20 -- examples/train.py --out SHARED/run ...
python -m fsdp_ext.lab run --nodes 2 --ranks-per-node 2 --link 1gbit --storage s3 \
    -- examples/train.py --out s3://lab/run ...     # S3 (SeaweedFS) on the storage node
python -m fsdp_ext.lab run --nodes 3 --ranks-per-node 2 --link 1gbit --warm-workers \
    --warm-preload examples.train -- examples/train.py ...   # workers forked, not started
python -m fsdp_ext.lab check [--storage s3]    # can the lab run here? (one line)
python -m fsdp_ext.lab clean     # remove what labs killed with SIGKILL left behind
"""

from __future__ import annotations

import argparse
import signal
import sys

from fsdp_ext.lab.cleanup import clean_stale, teardown_on_termination
from fsdp_ext.lab.cluster import DEFAULT_TIMEOUT_S, Cluster, LabResult
from fsdp_ext.lab.counters import NodeBytes
from fsdp_ext.lab.faults import Fault
from fsdp_ext.lab.launcher import LOST, RDZV_BACKENDS
from fsdp_ext.lab.network import MAX_NODES
from fsdp_ext.lab.rates import parse_rate
from fsdp_ext.lab.requirements import STORAGE_SERVICES, LabUnavailable, unavailable_reason

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _rate(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("link ")) from exc
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_ext.lab", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run SCRIPT ARGS... under torchrun on every node")
    run.add_argument("--nodes", type=_positive_int, required=True, help=f"1 to {MAX_NODES}")
    run.add_argument("--ranks-per-node", type=_positive_int, default=1)
    run.add_argument("--link", type=_rate, required=True, help="per node, each way: 200mbit, 1gbit")
    run.add_argument("--storage-link", type=_rate, default=None, help="default: --link")
    run.add_argument(
        "--shared-dir", default=None, help="served by the storage, same path on every node"
    )
    run.add_argument(
        "--storage",
        choices=STORAGE_SERVICES,
        default=None,
        help="what the storage node serves: sshfs (default: a directory at the same path on "
        "every node) or s3 (a SeaweedFS S3 server: s3://lab, AWS_ENDPOINT_URL and the "
        "credentials in the job's environment)",
    )
    run.add_argument("--no-storage", action="store_true", help="no storage node, no shared dir")
    run.add_argument("--rdzv", choices=RDZV_BACKENDS, default="c10d")
    run.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before the job is stopped"
    )
    run.add_argument(
        "--warm-workers",
        action="store_true",
        help="fork every worker from a per-node server that imported torch once (a restart "
        "skips the imports; see docs/recovery.md)",
    )
    run.add_argument(
        "--warm-preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="with --warm-workers: a module the servers import too (e.g. examples.train)",
    )
    run.add_argument(
        "--warm-spare",
        action="store_true",
        help="with --warm-workers: a pre-booted spare server outside the nodes; a fresh node's "
        "torchrun and workers are forked from it",
    )
    elastic = run.add_argument_group("elastic jobs (torchrun's restarts and node counts)")
    elastic.add_argument(
        "--max-restarts", type=_count, default=0, help="worker group restarts after a failure"
    )
    elastic.add_argument(
        "--min-nodes", type=_positive_int, default=None, help="fewest nodes the job goes on with"
    )
    elastic.add_argument(
        "--replace-failed", action="store_true", help="start a fresh node in place of a lost one"
    )
    faults = run.add_argument_group("faults, struck from outside the job")
    faults.add_argument("--kill-node", type=_count, metavar="I", help="SIGKILL all of node I")
    faults.add_argument("--kill-rank", type=_count, metavar="R", help="SIGKILL global rank R")
    faults.add_argument("--link-down", type=_count, metavar="I", help="node I's link goes down")
    faults.add_argument(
        "--for", dest="down_for", type=float, metavar="T", help="--link-down's seconds"
    )
    faults.add_argument("--storage-down", type=_count, metavar="I", help="node I's sshfs dies")
    faults.add_argument("--kill-after", type=float, metavar="S", help="the faults strike S s in")
    faults.add_argument(
        "--kill-on", metavar="TEXT", help="... or when rank 0 first prints a line with TEXT"
    )
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    check = sub.add_parser("check", help="say whether the lab can run on this machine")
    check.add_argument("--storage", choices=STORAGE_SERVICES, default="sshfs")
    sub.add_parser("clean", help="remove resources of labs whose owner process is gone")
    return parser


def _report(cluster: Cluster, link_bytes: list[NodeBytes]) -> str:
    lines = ["lab: bytes per node (interface counters)"]
    for node, b in enumerate(link_bytes):
        text = (
            f"lab:   node {node}: link sent {b.link_tx / 1e6:.2f} MB, "
            f"received {b.link_rx / 1e6:.2f} MB"
        )
        if cluster.storage:
            text += (
                f"; storage sent {b.storage_tx / 1e6:.2f} MB, received {b.storage_rx / 1e6:.2f} MB"
            )
        lines.append(text + f"; loopback {b.loopback / 1e6:.2f} MB")
    return "\n".join(lines)


def _status_cause(code: int) -> str:
    """What an exit status means when a signal caused it: torchrun exits with its failed
    worker's status, -9 for SIGKILL, which the shell sees as 256 - 9 = 247."""
    if code == LOST:
        return " (a node was lost that the job could not do without)"
    number = -code if code < 0 else 256 - code if code > 128 else None
    try:
        name = signal.Signals(number).name if number else None
    except ValueError:
        name = None
    return "" if name is None else f" (a process was killed by {name})"


def _print_failures(result: LabResult) -> None:
    """The last lines of every rank that wrote to stderr (rank 0's were streamed)."""
    for rank, err in enumerate(result.rank_stderr):
        if rank == 0 or not err.strip():
            continue
        tail = "".join(err.splitlines(keepends=True)[-10:])
        print(f"lab: rank {rank}'s last stderr lines:\n{tail}", file=sys.stderr, end="")


FAULT_FLAGS = {
    "kill_node": "kill-node",
    "kill_rank": "kill-rank",
    "link_down": "link-down",
    "storage_down": "storage-down",
}


def _faults(args: argparse.Namespace) -> list[Fault]:
    """The faults the flags ask for, each struck at --kill-after or --kill-on."""
    chosen = {kind: getattr(args, dest) for dest, kind in FAULT_FLAGS.items()}
    chosen = {kind: target for kind, target in chosen.items() if target is not None}
    when = {"after_s": args.kill_after, "on_output": args.kill_on}
    if chosen and (args.kill_after is None) == (args.kill_on is None):
        raise ValueError(
            "argument --kill-after: the faults need one of --kill-after S or --kill-on TEXT"
        )
    if not chosen and (args.kill_after is not None or args.kill_on is not None):
        raise ValueError(
            "argument --kill-after: no fault to strike (--kill-node, --kill-rank, --link-down, "
            "--storage-down)"
        )
    if "link-down" in chosen and args.down_for is None:
        raise ValueError("argument --link-down: needs --for T (seconds the link stays down)")
    if args.down_for is not None and "link-down" not in chosen:
        raise ValueError("argument --for: only with --link-down")
    faults = []
    for kind, target in chosen.items():
        duration = args.down_for if kind == "link-down" else None
        faults.append(Fault(kind, target, duration_s=duration, **when))
    return faults


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        reason = unavailable_reason(storage=args.storage)
        can = "" if args.storage == "sshfs" else f" with --storage {args.storage}"
        print(reason or f"fsdp_ext.lab: this machine can run the lab{can}")
        return 1 if reason else 0
    if args.command == "clean":
        removed = clean_stale()
        print(f"fsdp_ext.lab: removed {len(removed)} stale lab(s) {' '.join(removed)}".rstrip())
        return 0
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("run needs the program after --: run ... -- SCRIPT ARGS...")
    if args.no_storage and (args.shared_dir or args.storage_link or args.storage):
        parser.error(
            "argument --no-storage: --storage, --shared-dir and --storage-link need the storage"
        )
    if args.storage == "s3" and args.shared_dir:
        parser.error("argument --shared-dir: only with --storage sshfs (S3 serves s3://lab)")
    if args.timeout <= 0:
        parser.error(
            f"argument --timeout: must be a positive number of seconds, got {args.timeout}"
        )
    if args.warm_preload and not args.warm_workers:
        parser.error("argument --warm-preload: needs --warm-workers")
    if args.warm_spare and not args.warm_workers:
        parser.error("argument --warm-spare: needs --warm-workers")
    try:
        faults = _faults(args)
    except ValueError as exc:
        parser.error(str(exc))
    teardown_on_termination()
    cluster = Cluster(
        args.nodes,
        args.ranks_per_node,
        args.link,
        storage_link=args.storage_link,
        shared_dir=args.shared_dir,
        storage=False if args.no_storage else args.storage or "sshfs",
        rdzv=args.rdzv,
        timeout=args.timeout,
        warm_workers=args.warm_workers,
        warm_preload=args.warm_preload,
        warm_spare=args.warm_spare,
    )
    options = dict(
        max_restarts=args.max_restarts,
        min_nodes=args.min_nodes,
        faults=faults,
        replace_failed=args.replace_failed,
    )
    try:
        cluster.check_run(**options)  # before anything is built
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with cluster:
            print(f"lab: {cluster.describe()}", file=sys.stderr, flush=True)
            result = cluster.run(program, echo=sys.stdout, **options)
            print(_report(cluster, result.link_bytes), file=sys.stderr)
            for event in result.faults:
                print(f"lab: at {event.at_s:.1f} s: {event.note}", file=sys.stderr)
            for loss in result.losses:
                print(f"lab: at {loss.at_s:.1f} s: {loss.note}", file=sys.stderr)
            told = {loss.note for loss in result.losses}
            for problem in result.problems:
                if problem not in told:
                    print(f"lab: {problem}", file=sys.stderr)
            if result.timed_out:
                print(
                    f"lab: the job was stopped after {args.timeout:g} s (--timeout)",
                    file=sys.stderr,
                )
            elif result.returncode != 0:
                _print_failures(result)
            print(
                f"lab: exit status {result.returncode}{_status_cause(result.returncode)} "
                f"after {result.seconds:.1f} s",
                file=sys.stderr,
            )
            return result.returncode
    except LabUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted; everything it built was removed", file=sys.stderr)
        return 130
