"""Read benchmarks/kernels.py's JSON line (a file), print each kernel's fraction of copy_ and
the 7B-block qwZ decode, one line each, and the fractions as one JSON object last; exit 1 if
a kernel is below ``--min`` (scripts/gpu-check.sh: GPU_CHECK_MIN_FRACTION, default 0.6)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", help="file whose last line is the benchmark's JSON")
    parser.add_argument("--min", type=float, default=0.6)
    args = parser.parse_args(argv)
    with open(args.bench_json) as f:
        report = json.loads(f.read().strip().splitlines()[-1])
    fractions = {k: v["fraction_of_copy"] for k, v in report["kernels"].items()}
    for name, value in fractions.items():
        verdict = "ok" if value >= args.min else f"below {args.min}"
        print(f"gpu-check: {name:>20} {value:.3f} of copy_ ({verdict})")
    block = report["qwz_unit_decode_7b"]
    print(
        f"gpu-check: qwZ decode of a 7B block ({block['params']} params, {block['shards']} "
        f"shards): {block['one_launch_ms']} ms in {block['launches']['one_launch']} launch, "
        f"{block['per_parameter_loop_ms']} ms in {block['launches']['per_parameter_loop']} "
        f"launches as before ({block['speedup']}x)"
    )
    print(json.dumps(fractions))
    return 0 if min(fractions.values()) >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
