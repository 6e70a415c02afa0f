#!/usr/bin/env bash
# Certify a GPU machine for fsdp-ext in one command:
#   1. the Triton kernels compiled and run on CUDA equal the torch references, bit for bit;
#   2. benchmarks/kernels.py: each kernel's fraction of the device's copy_ (every one must
#      reach GPU_CHECK_MIN_FRACTION, default 0.6), and the qwZ decode of a 7B-sized block
#      (9 params, 8 shards) in one launch against the per-parameter loop it replaced;
#   3. a 30-step single-GPU run of examples/train.py (world 1, nccl);
#   4. with two GPUs or more: LoCoReduceScatter on 2 processes over NCCL, bit for bit, and a
#      2-process ZeRO++ step (qwZ + LoCo) with its launches and host syncs counted. With one
#      GPU it says so and skips them (NCCL refuses two ranks on one device).
# Prints one JSON summary line last; exits non-zero if any check fails.
# On a machine without CUDA it prints one "no CUDA device" line and exits 2.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TRITON_KERNELS_BACKEND=auto

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA device"
    exit 2
fi

# GPU_CHECK_LOGS=DIR keeps every step's whole log there (the device tool's $OUT, say).
if [ -n "${GPU_CHECK_LOGS:-}" ]; then
    OUT=$GPU_CHECK_LOGS
    mkdir -p "$OUT"
else
    OUT=$(mktemp -d)
    trap 'rm -rf "$OUT"' EXIT
fi
status() { [ "$1" -eq 0 ] && echo pass || echo fail; }

"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py >"$OUT/kernels.log" 2>&1
kernels_rc=$?
tail -n 3 "$OUT/kernels.log"

"$PY" benchmarks/kernels.py >"$OUT/bench.log" 2>&1
bench_rc=$?
tail -n 8 "$OUT/bench.log"
bench_json=$(tail -n 1 "$OUT/bench.log")
fractions=null
if [ "$bench_rc" -eq 0 ]; then
    "$PY" scripts/gpu_check_fractions.py "$OUT/bench.log" --min "${GPU_CHECK_MIN_FRACTION:-0.6}" \
        >"$OUT/fractions.log" 2>&1
    fractions_rc=$?
    head -n -1 "$OUT/fractions.log"
    fractions=$(tail -n 1 "$OUT/fractions.log")
    [ "$fractions_rc" -eq 0 ] || bench_rc=1
else
    bench_json=null
fi

"$PY" examples/train.py --device cuda --steps 30 --ckpt-every 0 --out "$OUT/train" >"$OUT/train.log" 2>&1
train_rc=$?
tail -n 3 "$OUT/train.log"

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
loco_rc=0
zeropp_rc=0
loco_json=null
zeropp_json=null
if [ "$gpus" -ge 2 ]; then
    timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_check_loco.py \
        >"$OUT/loco.log" 2>&1
    loco_rc=$?
    loco_json=$(grep '"check": "loco_2proc"' "$OUT/loco.log" | tail -n 1)
    loco=$(status $loco_rc)
    [ "$loco_rc" -eq 0 ] || tail -n 20 "$OUT/loco.log"
    timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_check_zeropp.py \
        >"$OUT/zeropp.log" 2>&1
    zeropp_rc=$?
    zeropp_json=$(grep '"check": "zeropp_2proc"' "$OUT/zeropp.log" | tail -n 1)
    zeropp=$(status $zeropp_rc)
    echo "gpu-check: 2-process ZeRO++ step: $zeropp ${zeropp_json}"
    [ "$zeropp_rc" -eq 0 ] || tail -n 20 "$OUT/zeropp.log"
else
    loco="skipped: one GPU"
    zeropp="skipped: one GPU"
    echo "gpu-check: only $gpus GPU here: the 2-process LoCo and ZeRO++ steps need two (NCCL refuses two ranks on one device); skipped"
fi

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name())')
rc=0
for r in $kernels_rc $bench_rc $train_rc $loco_rc $zeropp_rc; do [ "$r" -eq 0 ] || rc=1; done
printf '{"gpu_check": "%s", "ok": %s, "gpus": %s, "kernel_tests": "%s", "fractions_of_copy": %s, "train_30_steps": "%s", "loco_2proc": "%s", "zeropp_2proc": "%s", "loco_detail": %s, "zeropp_detail": %s, "bench": %s}\n' \
    "$device" "$([ $rc -eq 0 ] && echo true || echo false)" "$gpus" "$(status $kernels_rc)" \
    "${fractions:-null}" "$(status $train_rc)" "$loco" "$zeropp" "${loco_json:-null}" \
    "${zeropp_json:-null}" "${bench_json:-null}"
exit $rc
