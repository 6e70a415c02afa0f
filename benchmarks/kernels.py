"""Benchmark: bandwidth of each kernel on the current device, against that device's ``copy_``.

    python benchmarks/kernels.py --quick      # small sizes, few repetitions
    python benchmarks/kernels.py              # 64M elements on a GPU, 4M on a CPU

On a GPU the entry points run the Triton kernels; on a CPU the codec's fast CPU path (the
other kernels their torch references; the interpreter says nothing about speed). Each kernel
is timed on the data path's own
entry points (``quantize_ef_to_payload``, ``dequantize_reduce_from_payload``,
``permute_indices``), LoCo defaults (4-bit, groups of 128, int8 error feedback).
Bandwidth = bytes the kernel must read and write / time; ``fraction_of_copy`` divides that by
``dst.copy_(src)`` on fp32 tensors of the same element count, timed in the same loop.
Timings rotate the kernels each repetition and report medians. The last line printed is
one JSON object; ``min_fraction_of_copy`` is over the two codec kernels (the hot path).

On a CPU it also times the codec's fast CPU path against the torch reference side by side on
ONE thread (``torch.set_num_threads(1)``), alternating the two, same inputs, and checks that
both wrote the same bits. ``cpu_codec_speedup_vs_reference`` is the ratio of median wall
times of the sender, ``quantize_ef`` with LoCo's defaults (4-bit, group 128, int8 error,
beta 0.8): the reference's bottleneck; the receiver's ratio is reported next to it, and so
is the process CPU time per call (user + system), which waiting on a loaded machine does
not inflate. The fast path's sender is C compiled on this machine
(``triton_kernels.cpu_native``; ``cpu_codec_compile_s`` is its build time from a cold cache,
``cpu_codec_path`` says whether it ran); the plain-torch path that runs without a C compiler
(``FSDP_EXT_NATIVE_CPU=0``) is timed in the same alternation (``torch_path_ms``,
``torch_path_speedup``). ``--torch-compile`` also measures the alternative, ``torch.compile``
of the reference: its one-time compile cost, its speed, and whether it is bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from triton_kernels.backend import implementation  # noqa: E402
from triton_kernels.codec_common import payload_chunk_bytes  # noqa: E402
from triton_kernels.cpu_native import ENV as NATIVE_ENV  # noqa: E402
from triton_kernels.cpu_native import build_library, find_compiler, native_sender  # noqa: E402
from triton_kernels.dequantize_reduce import (  # noqa: E402
    dequantize_reduce_from_payload,
    dequantize_reduce_from_payload_cpu,
    dequantize_reduce_from_payload_reference,
)
from triton_kernels.permute_indices import permute_indices  # noqa: E402
from triton_kernels.quantize_ef import (  # noqa: E402
    quantize_ef_to_payload,
    quantize_ef_to_payload_cpu,
    quantize_ef_to_payload_reference,
)

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


@contextmanager
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _codec_inputs(numel: int) -> dict:
    """LoCo defaults on ``[CHUNKS, numel / CHUNKS]`` rows: a gradient with an outlier, an int8
    error with scales, the payload, the output; ``fresh()`` copies the mutable ones."""
    gen = torch.Generator().manual_seed(1)
    rows = (torch.randn(numel, generator=gen) * 1e-2).view(CHUNKS, -1)
    rows[0, 3] = 4.0
    groups = rows.shape[1] // GROUP
    error = torch.randint(-127, 128, (numel,), generator=gen, dtype=torch.int8)
    scales = torch.rand(numel // GROUP, generator=gen) * 1e-4
    payload = torch.empty(CHUNKS, payload_chunk_bytes(groups, GROUP, BITS), dtype=torch.uint8)
    quantize_ef_to_payload_reference(rows, payload, group_size=GROUP, bits=BITS)
    return dict(rows=rows, error=error, scales=scales, payload=payload, n=rows.shape[1])


def _quantize_call(fn, state):
    return lambda: fn(
        state["rows"],
        state["out_payload"],
        state["error"],
        state["scales"],
        group_size=GROUP,
        bits=BITS,
        beta=0.8,
    )


def _time_pair(fns: dict, reps: int) -> dict:
    """Median wall and process CPU seconds per call of each function, alternating them."""
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for rep in range(reps):
        for name in list(fns)[:: 1 if rep % 2 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def _cpu_state(inputs: dict) -> dict:
    return dict(
        rows=inputs["rows"],
        error=inputs["error"].clone(),
        scales=inputs["scales"].clone(),
        out_payload=torch.empty_like(inputs["payload"]),
    )


def cpu_codec_comparison(numel: int, reps: int, torch_compile: bool) -> dict:
    """The fast CPU path against the reference, one thread, side by side (see the docstring).

    With ``torch_compile``, ``torch.compile`` of the quantising reference runs in the same
    alternation (after its one-time compile, which is timed on its own).
    """
    inputs = _codec_inputs(numel)
    impls = ("reference", "cpu", "torch_path", "compiled")
    states = {impl: _cpu_state(inputs) for impl in impls}
    quantize = {
        "reference": _quantize_call(quantize_ef_to_payload_reference, states["reference"]),
        "cpu": _quantize_call(quantize_ef_to_payload_cpu, states["cpu"]),
        "torch_path": _plain_torch(
            _quantize_call(quantize_ef_to_payload_cpu, states["torch_path"])
        ),
    }
    report = {"numel": numel, "threads": 1, "reps": reps}
    with one_thread():
        if torch_compile:  # compiled on a scratch copy: the timed states see equal calls
            report["torch_compile"] = _compile_reference(_cpu_state(inputs))
            quantize["compiled"] = _quantize_call(
                report["torch_compile"].pop("function"), states["compiled"]
            )
        out = {k: torch.empty(inputs["n"]) for k in ("reference", "cpu")}
        kernels = {
            "quantize_ef": quantize,
            "dequantize_reduce": {
                impl: (
                    lambda impl=impl, fn=fn: fn(
                        inputs["payload"], out[impl], group_size=GROUP, bits=BITS, out_scale=0.125
                    )
                )
                for impl, fn in (
                    ("reference", dequantize_reduce_from_payload_reference),
                    ("cpu", dequantize_reduce_from_payload_cpu),
                )
            },
        }
        for name, fns in kernels.items():
            timed = _time_pair(fns, reps)
            (ref_wall, ref_cpu), (cpu_wall, cpu_cpu) = timed["reference"], timed["cpu"]
            report[name] = {
                "reference_ms": _sig(ref_wall * 1e3),
                "cpu_ms": _sig(cpu_wall * 1e3),
                "speedup": _sig(ref_wall / cpu_wall),
                "reference_cpu_time_ms": _sig(ref_cpu * 1e3),
                "cpu_cpu_time_ms": _sig(cpu_cpu * 1e3),
                "speedup_cpu_time": _sig(ref_cpu / cpu_cpu),
                "cpu_gb_per_s_of_input": _sig(4 * numel / cpu_wall / 1e9),
            }
            if "torch_path" in timed:
                wall = timed["torch_path"][0]
                report[name].update(
                    torch_path_ms=_sig(wall * 1e3), torch_path_speedup=_sig(ref_wall / wall)
                )
            if "compiled" in timed:
                wall, cpu = timed["compiled"]
                report["torch_compile"].update(
                    quantize_ef_ms=_sig(wall * 1e3),
                    quantize_ef_cpu_time_ms=_sig(cpu * 1e3),
                    speedup=_sig(ref_wall / wall),
                )
    # every path ran the same number of calls from the same state: same bytes, same errors
    ref = states["reference"]
    report["bit_exact"] = (
        _same_state(ref, states["cpu"])
        and _same_state(ref, states["torch_path"])
        and torch.equal(out["reference"].view(torch.int32), out["cpu"].view(torch.int32))
    )
    if torch_compile:
        report["torch_compile"]["bit_exact"] = _same_state(ref, states["compiled"])
    return report


def _same_state(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["out_payload"], b["out_payload"])
        and torch.equal(a["error"], b["error"])
        and torch.equal(a["scales"].view(torch.int32), b["scales"].view(torch.int32))
    )


def _compile_reference(state: dict) -> dict:
    """``torch.compile`` (inductor) of the quantising reference: its first call, timed, is the
    one-time compile cost of this process (Inductor's on-disk cache may shorten later ones)."""
    torch.compiler.reset()
    compiled = torch.compile(quantize_ef_to_payload_reference)
    start = time.perf_counter()
    _quantize_call(compiled, state)()
    return {"function": compiled, "compile_s": _sig(time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--numel", type=int, help="elements per gradient (default by device)")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="on CPU, also time torch.compile of the reference (compiles for tens of seconds)",
    )
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
        "implementation": implementation(src_probe(device), cpu_path=True),
        "numel": numel,
        "reps": reps,
        "copy_gb_per_s": _sig(copy_gbps),
        "kernels": report,
        "min_fraction_of_copy": min(report[n]["fraction_of_copy"] for n in CODEC),
    }
    if device.type == "cpu":
        comparison = cpu_codec_comparison(numel, max(3, reps // 2), args.torch_compile)
        for name in CODEC:
            c = comparison[name]
            print(
                f"{name:>18}: reference {c['reference_ms']:8.1f} ms, fast CPU path "
                f"{c['cpu_ms']:7.2f} ms on one thread: {c['speedup']:.1f}x "
                f"({c['speedup_cpu_time']:.1f}x in CPU time)"
            )
        if "torch_compile" in comparison:
            tc = comparison["torch_compile"]
            print(
                f"torch.compile of the reference: {tc['compile_s']:.1f} s to compile, then "
                f"{tc['quantize_ef_ms']:.2f} ms ({tc['speedup']:.1f}x), "
                f"bit-exact: {tc['bit_exact']}"
            )
        result["cpu_codec"] = comparison
        # the sender (quantize_ef_reference, LoCo defaults) is the reference's bottleneck
        result["cpu_codec_speedup_vs_reference"] = comparison["quantize_ef"]["speedup"]
        native = native_sender() is not None
        result["cpu_codec_path"] = "native C" if native else "plain torch"
        result["cpu_codec_compile_s"] = native_build_seconds() if native else None
    print(json.dumps(result))
    return result


@contextmanager
def _without_native():
    saved = os.environ.get(NATIVE_ENV)
    os.environ[NATIVE_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[NATIVE_ENV]
        else:
            os.environ[NATIVE_ENV] = saved


def _plain_torch(call):
    """``call`` on the plain-torch CPU path, the one that runs without a C compiler."""

    def run():
        with _without_native():
            return call()

    return run


def native_build_seconds() -> float | None:
    """Seconds to build the native sender from a cold cache (None: no C compiler)."""
    compiler = find_compiler()
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as cold:
        start = time.perf_counter()
        build_library(compiler, Path(cold))
        return _sig(time.perf_counter() - start)


def src_probe(device: torch.device) -> torch.Tensor:
    """An empty tensor on ``device``: what the entry points dispatch on."""
    return torch.empty(0, device=device)


if __name__ == "__main__":
    main()
