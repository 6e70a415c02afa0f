"""``python -m fsdp_ext.checkpoint {verify,inspect,unlock} PATH`` and ``clean-snapshots``.

verify / inspect: exit 0 when sound, 1 when not. unlock: remove the lock of a checkpoint
path (or its lock file) whatever holds it, printing who held it: the
last resort when a holder is gone and nothing can prove it (leases expire by themselves).
clean-snapshots [ROOT]: remove this node's in-memory snapshots of jobs whose owner is
provably gone (ROOT: the snapshot directory, default $FSDP_EXT_SNAPSHOT_ROOT or /dev/shm).
"""

from __future__ import annotations

import argparse
import sys

from fsdp_ext.checkpoint.lock import unlock
from fsdp_ext.checkpoint.snapshot import clean_snapshots
from fsdp_ext.checkpoint.verify import verify_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_ext.checkpoint", description=__doc__)
    parser.add_argument("command", choices=["verify", "inspect", "unlock", "clean-snapshots"])
    parser.add_argument("path", nargs="?")
    args = parser.parse_args(argv)
    if args.command == "clean-snapshots":
        done = clean_snapshots(args.path)
        for path, what in done:
            print(f"{path}: {what}")
        if not done:
            print("no in-memory snapshots here")
        return 0
    if args.path is None:
        parser.error(f"the following arguments are required for {args.command}: path")
    if args.command == "unlock":
        found, holder = unlock(args.path)
        if not found:
            print(f"{args.path}: no lock to remove")
            return 1
        print(f"removed {found}: held by {holder.describe() if holder else 'an unknown holder'}")
        if holder is not None:
            print(
                f"  host {holder.host}, boot id {holder.boot_id}, pid {holder.pid}, "
                f"run {holder.run_id or '-'}, lease {holder.lease_s:g} s"
            )
        return 0
    report = verify_checkpoint(args.path)
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    if args.command == "inspect":
        print(report.table())
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
