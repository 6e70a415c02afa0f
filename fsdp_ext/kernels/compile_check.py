"""Compile every ``@triton.jit`` kernel ahead of time for NVIDIA GPUs, without a GPU.

Triton bundles ``ptxas``, so ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``
produces PTX and a cubin on a CPU-only machine. This module finds every kernel in a package,
compiles each variant its launcher can produce (the module's ``compile_cases()``) for each
requested architecture, and reports facts about the generated code that matter on hardware:
FMA instructions, the widths of global loads, the integer width of pointer offsets, the IEEE
divisions per value, whether a loop waits on its own loads, registers and SASS size (the
last two read from the cubin's ELF sections, checked against Triton's bundled ``cuobjdump``
on one case of each run).

Run as ``python -m fsdp_ext.kernels.compile_check [--arch 80 90] [--json PATH] [--cover]``. It
must run with ``TRITON_INTERPRET`` unset (the interpreter replaces kernels by Python functions).
``--cover`` compiles the smallest set of variants that still holds each kernel's every group
size, bit width and pointer signature once (46 of 125 today): the default test run uses it,
``make test-slow`` compiles them all.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ARCHS = (80, 90)
_LD_GLOBAL = re.compile(r"\bld\.global(?:\.[a-z0-9]+)*")
_ADDPTR = re.compile(r"tt\.addptr .*, tensor<(?:\d+x)+(i\d+)>")
_LOOP_HEADER = re.compile(r"^(\$L__BB\d+_\d+):.*Loop Header", re.M)
_REG = re.compile(r"%[a-z]+\d+")


def loads_used_in_their_iteration(ptx: str) -> bool:
    """Whether some loop of ``ptx`` computes, in the same iteration, with a value it loads
    from global memory: each iteration then waits a full memory latency, with one load per
    thread in flight. (Loading the next iteration's values first, then computing with the
    previous ones, carried by ``mov``, keeps two in flight.)"""
    lines = ptx.splitlines()
    for label in _LOOP_HEADER.findall(ptx):
        start = next(i for i, line in enumerate(lines) if line.startswith(label + ":"))
        end = next(
            (
                i
                for i in range(start + 1, len(lines))
                if re.search(rf"\bbra(\.uni)?\s+{re.escape(label)};", lines[i])
            ),
            len(lines),
        )
        loaded: set[str] = set()
        for line in lines[start:end]:
            code = line.split("//")[0].strip()
            if "ld.global" in code:
                loaded.update(_REG.findall(code.split("}")[0]))
                continue
            op = re.sub(r"^@!?%p\d+\s+", "", code).split(" ")[0].split("\t")[0]
            if not op or op.startswith(("mov", ".")):
                continue
            if loaded & set(_REG.findall(code.split(",", 1)[-1] if "," in code else "")):
                return True
    return False


# ELF64 section header: name, type, flags, addr, offset, size, link, info, align, entsize
_SECTION = struct.Struct("<IIQQQQIIQQ")
_EIATTR_REGCOUNT = 0x2F  # in .nv.info: (symbol index, registers), format EIFMT_SVAL (4)
_SASS_BYTES = 16  # every instruction is 128 bits from sm_70 on


def _elf_sections(cubin: bytes) -> dict[str, bytes]:
    """The cubin's sections by name (a cubin is a little-endian ELF64 file)."""
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    (offset,) = struct.unpack_from("<Q", cubin, 0x28)
    entry, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [_SECTION.unpack_from(cubin, offset + i * entry) for i in range(count)]
    names_at = headers[names_index][4]

    def name(at: int) -> str:
        start = names_at + at
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h[0]): cubin[h[4] : h[4] + h[5]] for h in headers}


def cubin_facts(cubin: bytes) -> dict[str, Any]:
    """Registers and SASS instruction count of a one-kernel cubin, read from its ELF
    sections: what ``cuobjdump -res-usage`` and ``-sass`` print, without two processes per
    kernel (those took most of the compile check's time on a warm Triton cache)."""
    sections = _elf_sections(cubin)
    registers = None
    info, at = sections.get(".nv.info", b""), 0
    while at + 4 <= len(info):  # attributes: format, attribute, payload size, payload
        fmt, attribute, size = struct.unpack_from("<BBH", info, at)
        if fmt != 4:  # the other formats carry no size field of their own
            at += 4
            continue
        if attribute == _EIATTR_REGCOUNT:
            registers = struct.unpack_from("<II", info, at + 4)[1]
        at += 4 + size
    text = [data for name, data in sections.items() if name.startswith(".text.")]
    return {
        "registers": registers,
        "sass_instructions": sum(len(t) for t in text) // _SASS_BYTES if text else None,
    }


def cuobjdump_facts(cubin: bytes) -> dict[str, Any] | None:
    """The same facts from Triton's bundled ``cuobjdump`` (None where it is missing): the
    independent reading that ``cubin_facts`` is checked against."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    regs = re.search(r"REG:(\d+)", usage.stdout)
    count = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s", sass.stdout, re.M))
    return {"registers": int(regs.group(1)) if regs else None, "sass_instructions": count}


def discover(package: str) -> tuple[dict[str, Any], dict[str, list]]:
    """(every JIT function by qualified name, the compile cases of every module)."""
    from triton.runtime.jit import JITFunction

    pkg = importlib.import_module(package)
    modules = [pkg] + [
        importlib.import_module(f"{package}.{m.name}")
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name != "compile_check"
    ]
    functions, cases = {}, {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                functions[f"{module.__name__}.{name}"] = value
        if hasattr(module, "compile_cases"):
            cases[module.__name__] = list(module.compile_cases())
    return functions, cases


def uncovered(functions: dict[str, Any], cases: dict[str, list]) -> list[str]:
    """JIT functions that no compile case compiles, directly or as a callee of one."""
    compiled = {c.kernel for module_cases in cases.values() for c in module_cases}
    reached = set(compiled)
    grew = True
    while grew:  # helpers called (by name) from a compiled kernel or from a reached helper
        grew = False
        sources = " ".join(f.src for f in reached)
        for f in functions.values():
            if f not in reached and re.search(rf"\b{f.fn.__name__}\s*\(", sources):
                reached.add(f)
                grew = True
    return sorted(name for name, f in functions.items() if f not in reached)


def compile_case(
    case, arch: int, enable_fp_fusion: bool | None = None, cross_check: bool = False
) -> dict[str, Any]:
    """Compile one case for ``sm_<arch>`` with the launchers' own options (or FP fusion
    forced to ``enable_fp_fusion``); returns facts about its PTX and TTIR."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fsdp_ext.kernels.codec_common import launch_options

    options = {"num_warps": case.num_warps, **launch_options()}
    if enable_fp_fusion is not None:
        options["enable_fp_fusion"] = enable_fp_fusion
    names = list(case.signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.aligned}
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(
                fn=case.kernel, signature=case.signature, constexprs=case.constexprs, attrs=attrs
            ),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )
    except Exception as exc:  # the compiler's own message is the report
        return {"case": case.name, "arch": arch, "error": f"{type(exc).__name__}: {exc}"}
    ptx, ttir = compiled.asm["ptx"], compiled.asm["ttir"]
    threads = case.num_warps * 32
    fma = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    explicit = sum(  # scalar calls, and vector ones (<N x float>) N times
        int(width or 1)
        for width in re.findall(
            r"call (?:float|<(\d+) x float>) @llvm\.fma\.(?:f32|v\d+f32)\(", compiled.asm["llir"]
        )
    )
    return {
        "case": case.name,
        "arch": arch,
        "error": None,
        "seconds": time.perf_counter() - start,
        "cubin_bytes": len(compiled.asm["cubin"]),
        # FMAs in the PTX: the source's own tl.fma calls (each an llvm.fma call in the LLVM
        # IR) and those the compiler contracted from a multiply and an add (fusion on)
        "fma": fma,
        "fma_explicit": explicit,
        "fma_contracted": fma - explicit,
        "loads": sorted(set(_LD_GLOBAL.findall(ptx))),
        "offset_types": sorted(set(_ADDPTR.findall(ttir))),
        # IEEE divisions compiled (each a reciprocal, refinement, range check and
        # slow-path call in SASS), and the values one thread handles per tile
        "div_rn": len(re.findall(r"\bdiv\.rn\.f32\b", ptx)),
        "values_per_thread": case.values // threads if case.values else None,
        "loads_used_in_their_iteration": loads_used_in_their_iteration(ptx),
        **cubin_facts(compiled.asm["cubin"]),
        **({"cuobjdump": cuobjdump_facts(compiled.asm["cubin"])} if cross_check else {}),
    }


def _compile_job(job):
    module, index, arch, fusion, cross_check = job
    case = discover_cases_of(module)[index]
    result = compile_case(case, arch, fusion, cross_check)
    result.update(module=module, fused=bool(fusion))
    return result


_CASES: dict[str, list] = {}


def discover_cases_of(module_name: str) -> list:
    if module_name not in _CASES:
        _CASES[module_name] = list(importlib.import_module(module_name).compile_cases())
    return _CASES[module_name]


def covering(cases: list) -> list[int]:
    """Indices of the cases that first bring a kernel's group size, bit width or pointer
    signature: each of those compiles at least once, in far fewer compiles."""
    seen: set = set()
    keep = []
    for i, case in enumerate(cases):
        name = case.kernel.fn.__name__
        keys = {
            (name, "group", case.constexprs.get("GROUP")),
            (name, "bits", case.constexprs.get("BITS")),
            (name, "signature", tuple(sorted(case.signature.items()))),
        }
        if keys - seen:
            keep.append(i)
            seen |= keys
    return keep


def compile_all(
    cases: dict[str, list[int]], archs=ARCHS, workers: int = 2, extra_jobs=()
) -> list[dict[str, Any]]:
    """Compile the cases at these indices of each module's ``compile_cases()`` for every
    arch, ``workers`` processes at a time."""
    jobs = [
        (module, i, arch, None, n == 0)  # each module's first job is read by cuobjdump too
        for module, indices in cases.items()
        for n, (i, arch) in enumerate((i, arch) for i in indices for arch in archs)
    ]
    jobs += list(extra_jobs)
    if workers <= 1:
        return [_compile_job(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_compile_job, jobs, chunksize=4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", nargs="+", default=["fsdp_ext.kernels"])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--fused-probe",
        action="store_true",
        help="also compile each module's last case with FP fusion on (shows FMAs appear)",
    )
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument(
        "--cover",
        action="store_true",
        help="only the variants that bring a new group size, bit width or signature",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter replaces kernels by Python")
    start = time.perf_counter()
    packages, cases = {}, {}
    for package in args.package:
        functions, package_cases = discover(package)
        chosen = {
            m: covering(c) if args.cover else list(range(len(c))) for m, c in package_cases.items()
        }
        packages[package] = {
            "functions": sorted(functions),
            "uncovered": uncovered(functions, package_cases),
            "cases": sum(len(c) for c in chosen.values()),
            "variants": sum(len(c) for c in package_cases.values()),
        }
        cases.update(chosen)
    extra = [(m, c[-1], args.arch[-1], True, False) for m, c in cases.items()]
    extra = extra if args.fused_probe else []
    results = compile_all(cases, args.arch, args.workers, extra)
    seconds = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"packages": packages, "results": results, "seconds": seconds}, f)
    failed = [r for r in results if r["error"]]
    uncovered_names = [n for p in packages.values() for n in p["uncovered"]]
    summary = {
        "compile_check": args.package,
        "archs": args.arch,
        "compiled": len(results) - len(failed),
        "failed": len(failed),
        "uncovered": uncovered_names,
        "seconds": round(seconds, 1),
    }
    print(json.dumps(summary))
    return 1 if failed or uncovered_names else 0


if __name__ == "__main__":
    sys.exit(main())
