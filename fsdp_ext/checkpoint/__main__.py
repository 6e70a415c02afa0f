"""``python -m fsdp_ext.checkpoint {verify,inspect} PATH``: exit 0 when sound, 1 when not."""

from __future__ import annotations

import argparse
import sys

from fsdp_ext.checkpoint.verify import verify_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_ext.checkpoint", description=__doc__)
    parser.add_argument("command", choices=["verify", "inspect"])
    parser.add_argument("path")
    args = parser.parse_args(argv)
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
