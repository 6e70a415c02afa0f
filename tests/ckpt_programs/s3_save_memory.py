"""Save one large tensor to an S3 location, for a parent that watches this process's memory.

``python s3_save_memory.py LOCATION NBYTES`` (the part size from ``FSDP_EXT_S3_PART_BYTES``,
the server from ``AWS_ENDPOINT_URL``...): a warm-up save of a small state first (boto3's
client, botocore's models and DCP's machinery are then loaded), then the state, one uint8
tensor of NBYTES (:func:`tensor`); prints ``ready`` and waits for ``go`` on stdin
(the parent reads VmRSS and resets VmHWM meanwhile), saves it with ``BlobStorageWriter``,
prints ``done SECONDS``, and waits for ``exit``.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from fsdp_ext.checkpoint.blob_writer import BlobStorageWriter
from fsdp_ext.checkpoint.planner import SpreadSavePlanner


def tensor(nbytes: int) -> torch.Tensor:
    """NBYTES of seeded random bytes (one 4 MiB block repeated), every page touched."""
    block = torch.randint(
        0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    out = torch.empty(nbytes, dtype=torch.uint8)
    for start in range(0, nbytes, len(block)):
        out[start : start + len(block)] = block[: nbytes - start]
    return out


def save(location: str, state: dict) -> None:
    writer = BlobStorageWriter(location, 1, min_file_bytes=0)
    dcp.save(state, storage_writer=writer, planner=SpreadSavePlanner(), no_dist=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    location, nbytes = sys.argv[1], int(sys.argv[2])
    save(f"{location}/warm-up", {"w": torch.arange(1 << 16, dtype=torch.uint8)})
    state = {"w": tensor(nbytes)}
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    started = time.perf_counter()
    save(location, state)
    print(f"done {time.perf_counter() - started:.3f}", flush=True)
    assert sys.stdin.readline().strip() == "exit"


if __name__ == "__main__":
    main()
