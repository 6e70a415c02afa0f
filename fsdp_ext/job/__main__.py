"""``python -m fsdp_ext.job clean-snapshots [ROOT]``: remove this node's in-memory snapshots
of jobs whose owner is provably gone (ROOT: the snapshot directory, default
$FSDP_EXT_SNAPSHOT_ROOT or /dev/shm). A job that failed for good leaves them in RAM.
"""

from __future__ import annotations

import argparse
import sys

from fsdp_ext.job.snapshot import clean_snapshots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_ext.job", description=__doc__)
    parser.add_argument("command", choices=["clean-snapshots"])
    parser.add_argument("root", nargs="?", help="the snapshot directory (default /dev/shm)")
    args = parser.parse_args(argv)
    done = clean_snapshots(args.root)
    for path, what in done:
        print(f"{path}: {what}")
    if not done:
        print("no in-memory snapshots here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
