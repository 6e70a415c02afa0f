"""Benchmark: bandwidth of each kernel on the current device, against that device's ``copy_``.

    python benchmarks/kernels.py --quick      # small sizes, few repetitions
    python benchmarks/kernels.py              # 64M elements on a GPU, 4M on a CPU

On a GPU the entry points run the Triton kernels; elsewhere they run the torch references
(the interpreter says nothing about speed). Each kernel is timed on the data path's own
entry points (``quantize_ef_to_payload``, ``dequantize_reduce_from_payload``,
``permute_indices``), LoCo defaults (4-bit, groups of 128, int8 error feedback).
Bandwidth = bytes the kernel must read and write / time; ``fraction_of_copy`` divides that by
``dst.copy_(src)`` on fp32 tensors of the same element count, timed in the same loop.
Timings rotate the kernels each repetition and report medians. The last line printed is
one JSON object; ``min_fraction_of_copy`` is over the two codec kernels (the hot path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from triton_kernels.backend import use_triton  # noqa: E402
from triton_kernels.codec_common import payload_chunk_bytes  # noqa: E402
from triton_kernels.dequantize_reduce import dequantize_reduce_from_payload  # noqa: E402
from triton_kernels.permute_indices import permute_indices  # noqa: E402
from triton_kernels.quantize_ef import quantize_ef_to_payload  # noqa: E402

GROUP, BITS, CHUNKS = 128, 4, 8  # LoCo defaults; 8 ranks' chunks per reduction
CODEC = ("quantize_ef", "dequantize_reduce")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(numel: int, device: torch.device) -> dict:
    """Each kernel as (zero-argument callable, bytes it must read and write)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(numel, generator=gen).to(device)
    rows = grad.view(CHUNKS, -1)
    groups = rows.shape[1] // GROUP
    error = torch.zeros(numel, dtype=torch.int8, device=device)
    error_scales = torch.zeros(numel // GROUP, dtype=torch.float32, device=device)
    width = payload_chunk_bytes(groups, GROUP, BITS)
    payload = torch.empty(CHUNKS, width, dtype=torch.uint8, device=device)
    out = torch.empty(rows.shape[1], dtype=torch.float32, device=device)
    src, dst = torch.randn(numel, generator=gen).to(device), torch.empty(numel, device=device)
    tokens_per_block = numel // (CHUNKS * 16)
    counts = torch.full((CHUNKS, 16), tokens_per_block, dtype=torch.int64, device=device)

    def quantize():
        quantize_ef_to_payload(rows, payload, error, error_scales, group_size=GROUP, beta=0.8)

    def dequantize():
        dequantize_reduce_from_payload(payload, out, group_size=GROUP, bits=BITS, out_scale=0.125)

    quantize()  # a real payload for the receiver
    return {
        # read g, read + write e (codes and scales), write the payload
        "quantize_ef": (quantize, 4 * numel + 2 * (numel + 4 * numel // GROUP) + payload.numel()),
        # read every chunk's payload, write one chunk's output
        "dequantize_reduce": (dequantize, payload.numel() + 4 * out.numel()),
        # write one int64 index per token (the counts are negligible)
        "permute_indices": (lambda: permute_indices(counts), 8 * CHUNKS * 16 * tokens_per_block),
        "copy_": (lambda: dst.copy_(src), 8 * numel),
    }


def _sig(x: float) -> float:
    """Four significant digits."""
    return float(f"{x:.4g}")


def measure(kernels: dict, device: torch.device, reps: int) -> dict[str, float]:
    """Median seconds per call, the kernels rotated each repetition."""
    names = list(kernels)
    times = {n: [] for n in names}
    for fn, _ in kernels.values():  # warm-up: compiles, allocator, caches
        fn()
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn = kernels[name][0]
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--numel", type=int, help="elements per gradient (default by device)")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    numel = args.numel or (
        (2**22 if args.quick else 2**26) if on_gpu else (2**20 if args.quick else 2**22)
    )
    numel -= numel % (CHUNKS * GROUP * 16)
    reps = args.reps or (5 if args.quick else 20)
    kernels = build(numel, device)
    seconds = measure(kernels, device, reps)
    copy_gbps = kernels["copy_"][1] / seconds["copy_"] / 1e9
    report = {}
    for name, (_, nbytes) in kernels.items():
        if name == "copy_":
            continue
        gbps = nbytes / seconds[name] / 1e9
        report[name] = {
            "ms": _sig(seconds[name] * 1e3),
            "gb_per_s": _sig(gbps),
            "fraction_of_copy": _sig(gbps / copy_gbps),
        }
        print(
            f"{name:>18}: {seconds[name] * 1e3:9.3f} ms  {gbps:8.2f} GB/s  "
            f"{gbps / copy_gbps:6.3f} of copy_"
        )
    print(f"{'copy_':>18}: {seconds['copy_'] * 1e3:9.3f} ms  {copy_gbps:8.2f} GB/s")
    result = {
        "bench": "kernels",
        "device": device_name(device),
        "implementation": "triton" if use_triton(src_probe(device)) else "torch reference",
        "numel": numel,
        "reps": reps,
        "copy_gb_per_s": _sig(copy_gbps),
        "kernels": report,
        "min_fraction_of_copy": min(report[n]["fraction_of_copy"] for n in CODEC),
    }
    print(json.dumps(result))
    return result


def src_probe(device: torch.device) -> torch.Tensor:
    """An empty tensor on ``device``: what the entry points dispatch on."""
    return torch.empty(0, device=device)


if __name__ == "__main__":
    main()
