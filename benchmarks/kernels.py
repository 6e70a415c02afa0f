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
(``fsdp_ext.kernels.cpu_native``; ``cpu_codec_compile_s`` is its build time from a cold cache,
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

from fsdp_ext.comm import Codec, WeightQuantConfig, make_codec  # noqa: E402
from fsdp_ext.kernels.backend import implementation  # noqa: E402
from fsdp_ext.kernels.codec_common import payload_chunk_bytes  # noqa: E402
from fsdp_ext.kernels.cpu_native import ENV as NATIVE_ENV  # noqa: E402
from fsdp_ext.kernels.cpu_native import build_library, find_compiler, native_sender  # noqa: E402
from fsdp_ext.kernels.dequantize_reduce import (  # noqa: E402
    dequantize_reduce_from_payload,
    dequantize_reduce_from_payload_cpu,
    dequantize_reduce_from_payload_reference,
)
from fsdp_ext.kernels.permute_indices import permute_indices  # noqa: E402
from fsdp_ext.kernels.quantize_blockwise import (  # noqa: E402
    dequantize_blockwise,
    quantize_blockwise,
    unit_payload_row_bytes,
)
from fsdp_ext.kernels.quantize_ef import (  # noqa: E402
    quantize_ef_to_payload,
    quantize_ef_to_payload_cpu,
    quantize_ef_to_payload_reference,
)
from fsdp_ext.testing import KernelLaunches  # noqa: E402

GROUP, BITS, CHUNKS = 128, 4, 8  # LoCo defaults; 8 ranks' chunks per reduction
QWZ_GROUP = 256  # WeightQuantConfig's default
CODEC = ("quantize_ef", "dequantize_reduce")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(numel: int, device: torch.device) -> dict:
    """Each kernel as (zero-argument callable, bytes it must read and write), every one on
    ``numel`` values, so each moves about as many bytes as the ``copy_`` it is compared with."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(numel, generator=gen).to(device)
    rows = grad.view(CHUNKS, -1)
    groups = rows.shape[1] // GROUP
    error = torch.zeros(numel, dtype=torch.int8, device=device)
    error_scales = torch.zeros(numel // GROUP, dtype=torch.float32, device=device)
    payload = torch.empty(
        CHUNKS, payload_chunk_bytes(groups, GROUP, BITS), dtype=torch.uint8, device=device
    )
    # the receiver reduces CHUNKS chunks of numel values each into numel outputs
    received = torch.empty(
        CHUNKS, payload_chunk_bytes(numel // GROUP, GROUP, BITS), dtype=torch.uint8, device=device
    )
    out = torch.empty(numel, dtype=torch.float32, device=device)
    src, dst = torch.randn(numel, generator=gen).to(device), torch.empty(numel, device=device)
    tokens_per_block = numel // (CHUNKS * 16)
    counts = torch.full((CHUNKS, 16), tokens_per_block, dtype=torch.int64, device=device)
    weights = torch.randn(CHUNKS, numel // CHUNKS, generator=gen).to(device, torch.bfloat16)
    segments = [numel // CHUNKS]
    qwz_payload = torch.empty(
        CHUNKS, unit_payload_row_bytes(segments, QWZ_GROUP), dtype=torch.uint8, device=device
    )
    qwz_out = torch.empty_like(weights)

    def quantize():
        quantize_ef_to_payload(rows, payload, error, error_scales, group_size=GROUP, beta=0.8)

    def dequantize():
        dequantize_reduce_from_payload(received, out, group_size=GROUP, bits=BITS, out_scale=0.125)

    def qwz_quantize():
        quantize_blockwise(weights, qwz_payload, group_size=QWZ_GROUP, segments=segments)

    def qwz_dequantize():
        dequantize_blockwise(qwz_payload, qwz_out, group_size=QWZ_GROUP, segments=segments)

    big = grad.repeat(CHUNKS).view(CHUNKS, numel)
    quantize_ef_to_payload(big, received, group_size=GROUP, bits=BITS)  # a real payload
    del big
    qwz_quantize()
    return {
        # read g, read + write e (codes and scales), write the payload
        "quantize_ef": (quantize, 4 * numel + 2 * (numel + 4 * numel // GROUP) + payload.numel()),
        # read every chunk's payload, write the output
        "dequantize_reduce": (dequantize, received.numel() + 4 * out.numel()),
        # write one int64 index per token (the counts are negligible)
        "permute_indices": (lambda: permute_indices(counts), 8 * CHUNKS * 16 * tokens_per_block),
        # qwZ, bf16 weights: read the weights, write the payload; and back
        "quantize_blockwise": (qwz_quantize, 2 * numel + qwz_payload.numel()),
        "dequantize_blockwise": (qwz_dequantize, qwz_payload.numel() + 2 * numel),
        "copy_": (lambda: dst.copy_(src), 8 * numel),
    }


# A Llama-7B decoder block: q, k, v, o (4096 x 4096), gate, up (11008 x 4096), down
# (4096 x 11008), two RMSNorm weights (4096); sharded 8 ways, as FSDP lays out one unit.
BLOCK_7B = [4096 * 4096] * 4 + [11008 * 4096] * 3 + [4096] * 2


def unit_decode(device: torch.device, reps: int, scale: int = 1) -> dict:
    """The qwZ gather's decode of one 7B-sized unit (9 parameters, 8 shards, bf16): one
    launch over the flat buffer against the per-parameter loop the gather ran before (a
    launch and a ``.contiguous()`` copy per parameter), wall time per call with a sync
    after each (the host's launch time counts: that is what a per-parameter loop costs),
    launches counted at the Triton launcher. ``scale`` divides every size (CPU smoke runs)."""
    world = 8
    segments = [-(-n // scale) // world for n in BLOCK_7B]
    n = sum(segments)
    codec = make_codec(WeightQuantConfig(group_size=QWZ_GROUP))
    gen = torch.Generator().manual_seed(2)
    rows = (torch.randn(world, n, generator=gen) * 0.02).to(device, torch.bfloat16)
    out = torch.empty_like(rows)
    loop = torch.empty(world, Codec.unit_payload_bytes(codec, segments), dtype=torch.uint8)
    loop = loop.to(device)
    unit = torch.empty(world, codec.unit_payload_bytes(segments), dtype=torch.uint8, device=device)
    Codec.encode_unit(codec, rows, loop, segments)
    codec.encode_unit(rows, unit, segments)
    calls = {
        "per_parameter_loop": lambda: Codec.decode_unit(codec, loop, out, segments),
        "one_launch": lambda: codec.decode_unit(unit, out, segments),
    }
    launches = {}
    for name, fn in calls.items():
        fn()
        with KernelLaunches() as counted:
            fn()
        launches[name] = len(counted.names)
    seconds = measure({k: (fn, 0) for k, fn in calls.items()}, device, reps, batch=1)
    return {
        "params": len(segments),
        "shards": world,
        "values_per_rank": n,
        "per_parameter_loop_ms": _sig(seconds["per_parameter_loop"] * 1e3),
        "one_launch_ms": _sig(seconds["one_launch"] * 1e3),
        "speedup": _sig(seconds["per_parameter_loop"] / seconds["one_launch"]),
        "launches": launches,
    }


def _sig(x: float) -> float:
    """Four significant digits."""
    return float(f"{x:.4g}")


def measure(kernels: dict, device: torch.device, reps: int, batch: int = 1) -> dict[str, float]:
    """Median seconds per call, the kernels rotated each repetition. Each repetition times
    ``batch`` calls back to back with one sync at the end: on a GPU the host then queues
    the next launch while the device runs, so the figure is the kernel's, not the host's
    (a sync after every call adds each launch's host time, tens of microseconds)."""
    names = list(kernels)
    times = {n: [] for n in names}
    for fn, _ in kernels.values():  # warm-up: compiles, allocator, caches
        fn()
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn = kernels[name][0]
            _sync(device)
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) / batch)
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
    seconds = measure(kernels, device, reps, batch=10 if on_gpu else 1)
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
        "min_fraction_of_copy_all": min(r["fraction_of_copy"] for r in report.values()),
        "qwz_unit_decode_7b": unit_decode(device, reps, scale=1 if on_gpu else 256),
    }
    block = result["qwz_unit_decode_7b"]
    print(
        f"qwZ decode of a 7B block ({block['params']} params, {block['shards']} shards): "
        f"{block['per_parameter_loop_ms']:.3f} ms per-parameter loop "
        f"({block['launches']['per_parameter_loop']} launches), {block['one_launch_ms']:.3f} ms "
        f"one launch ({block['launches']['one_launch']}): {block['speedup']:.2f}x"
    )
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
