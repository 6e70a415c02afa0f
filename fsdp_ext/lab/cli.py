"""``python -m fsdp_ext.lab``: run a script on an emulated multi-node cluster.

python -m fsdp_ext.lab run --nodes 2 --ranks-per-node 2 --link 200mbit -- examples/train.py
python -m fsdp_ext.lab check     # can the lab run here? (one line)
python -m fsdp_ext.lab clean     # remove what labs killed with SIGKILL left behind
"""

from __future__ import annotations

import argparse
import signal
import sys

from fsdp_ext.lab.cleanup import clean_stale
from fsdp_ext.lab.cluster import DEFAULT_TIMEOUT_S, Cluster, LabResult
from fsdp_ext.lab.counters import NodeBytes
from fsdp_ext.lab.launcher import RDZV_BACKENDS
from fsdp_ext.lab.network import MAX_NODES
from fsdp_ext.lab.rates import parse_rate
from fsdp_ext.lab.requirements import LabUnavailable, unavailable_reason

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
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
    run.add_argument("--no-storage", action="store_true", help="no sshd/sshfs, no shared dir")
    run.add_argument("--rdzv", choices=RDZV_BACKENDS, default="c10d")
    run.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before the job is stopped"
    )
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    sub.add_parser("check", help="say whether the lab can run on this machine")
    sub.add_parser("clean", help="remove resources of labs whose owner process is gone")
    return parser


def _terminate(signum, _frame):
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the lab's teardown runs
    raise KeyboardInterrupt(f"signal {signum}")


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


def _print_failures(result: LabResult) -> None:
    """The last lines of every rank that wrote to stderr (rank 0's were streamed)."""
    for rank, err in enumerate(result.rank_stderr):
        if rank == 0 or not err.strip():
            continue
        tail = "".join(err.splitlines(keepends=True)[-10:])
        print(f"lab: rank {rank}'s last stderr lines:\n{tail}", file=sys.stderr, end="")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        reason = unavailable_reason()
        print(reason or "fsdp_ext.lab: this machine can run the lab")
        return 1 if reason else 0
    if args.command == "clean":
        removed = clean_stale()
        print(f"fsdp_ext.lab: removed {len(removed)} stale lab(s) {' '.join(removed)}".rstrip())
        return 0
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("run needs the program after --: run ... -- SCRIPT ARGS...")
    if args.no_storage and (args.shared_dir or args.storage_link):
        parser.error("argument --no-storage: --shared-dir and --storage-link need the storage")
    if args.timeout <= 0:
        parser.error(
            f"argument --timeout: must be a positive number of seconds, got {args.timeout}"
        )
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        with Cluster(
            args.nodes,
            args.ranks_per_node,
            args.link,
            storage_link=args.storage_link,
            shared_dir=args.shared_dir,
            storage=not args.no_storage,
            rdzv=args.rdzv,
            timeout=args.timeout,
        ) as cluster:
            print(f"lab: {cluster.describe()}", file=sys.stderr, flush=True)
            result = cluster.run(program, echo=sys.stdout)
            print(_report(cluster, result.link_bytes), file=sys.stderr)
            if result.timed_out:
                print(
                    f"lab: the job was stopped after {args.timeout:g} s (--timeout)",
                    file=sys.stderr,
                )
            elif result.returncode != 0:
                _print_failures(result)
            print(
                f"lab: exit status {result.returncode} after {result.seconds:.1f} s",
                file=sys.stderr,
            )
            return result.returncode
    except LabUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted; everything it built was removed", file=sys.stderr)
        return 130
