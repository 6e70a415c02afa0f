"""``python -m fsdp_ext.checkpoint {verify,inspect,unlock} PATH`` and ``export``.

verify / inspect: exit 0 when sound, 1 when not. unlock: remove the lock of a checkpoint
path (or its lock file) whatever holds it, printing who held it: the
last resort when a holder is gone and nothing can prove it (leases expire by themselves).
export CKPT --to safetensors OUT [--dtype bf16|fp16|fp32] [--config CONFIG]: the model's
weights as Hugging Face safetensors shards with their index (``export.py``);
``AutoModelForCausalLM.from_pretrained(OUT)`` loads them (with ``--config``, which copies
config.json into OUT).
"""

from __future__ import annotations

import argparse
import sys

from fsdp_ext.checkpoint.blob import BlobError
from fsdp_ext.checkpoint.export import DTYPES, ExportConfig, export_safetensors, parse_size
from fsdp_ext.checkpoint.lock import unlock
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, UnsafeCheckpointError
from fsdp_ext.checkpoint.verify import verify_checkpoint


def export_main(argv: list[str]) -> int:
    """``export CKPT --to safetensors OUT ...``: exit 0 when written, 2 on bad input, 1 when
    the checkpoint fails its checks or a store cannot be used."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_ext.checkpoint export",
        description="Write a checkpoint's model weights as Hugging Face safetensors.",
    )
    parser.add_argument("checkpoint", help="a step-N checkpoint, or a Checkpointer root "
                        "(its newest intact checkpoint); a path or file:// URL")  # fmt: skip
    parser.add_argument("--to", required=True, choices=["safetensors"], help="the format")
    parser.add_argument("out", help="where to write: a path, file:// or s3:// URL")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="convert float weights")
    parser.add_argument("--config", help="config.json (or its directory): copied into OUT, "
                        "and the model's weights and ties taken from it")  # fmt: skip
    parser.add_argument("--max-shard-size", default="5GB", help="per file (default 5GB)")
    parser.add_argument("--prefix", default="model.", help="the checkpoint's name for the "
                        "model (default 'model.', the Checkpointer's)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        config = ExportConfig(
            dtype=args.dtype,
            config=args.config,
            prefix=args.prefix,
            max_shard_bytes=parse_size(args.max_shard_size),
        )
        report = export_safetensors(args.checkpoint, args.out, config)
    except ValueError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    except (CheckpointIntegrityError, UnsafeCheckpointError, BlobError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 1
    for name, tensors in report.files.items():
        print(f"{name}: {len(tensors)} tensors")
    for dropped, kept in report.tied.items():
        print(f"tied: {dropped} is {kept} (written once)")
    print(
        f"exported {sum(map(len, report.files.values()))} tensors, {report.total_size} bytes, "
        f"from {report.checkpoint} to {args.out}; left out {len(report.left_out)} "
        "optimizer and other entries"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fsdp_ext.checkpoint", description=__doc__)
    parser.add_argument("command", choices=["verify", "inspect", "unlock", "export"])
    parser.add_argument("path", nargs="?")
    args = parser.parse_args(argv)
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
