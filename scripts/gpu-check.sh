#!/usr/bin/env bash
# Certify a GPU machine for fsdp-ext in one command:
#   1. the Triton kernels compiled and run on CUDA equal the torch references, bit for bit;
#   2. benchmarks/kernels.py: GB/s of each kernel and its fraction of the device's copy_;
#   3. a 30-step single-GPU run of examples/train.py (world 1, nccl);
#   4. LoCoReduceScatter on 2 processes over NCCL, if NCCL allows two ranks on one device.
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

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
status() { [ "$1" -eq 0 ] && echo pass || echo fail; }

"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py >"$OUT/kernels.log" 2>&1
kernels_rc=$?
tail -n 3 "$OUT/kernels.log"

"$PY" benchmarks/kernels.py >"$OUT/bench.log" 2>&1
bench_rc=$?
tail -n 5 "$OUT/bench.log"
bench_json=$(tail -n 1 "$OUT/bench.log")
[ "$bench_rc" -eq 0 ] || bench_json=null

"$PY" examples/train.py --device cuda --steps 30 --ckpt-every 0 --out "$OUT/train" >"$OUT/train.log" 2>&1
train_rc=$?
tail -n 3 "$OUT/train.log"

timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_check_loco.py \
    >"$OUT/loco.log" 2>&1
loco_rc=$?
loco_json=$(grep '"check": "loco_2proc"' "$OUT/loco.log" | tail -n 1)
if [ "$loco_rc" -eq 0 ]; then
    loco=pass
elif grep -q '"skipped": true' "$OUT/loco.log"; then
    loco="skipped: NCCL does not allow two ranks on one device"
    loco_rc=0
else
    loco=fail
    tail -n 20 "$OUT/loco.log"
fi

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name())')
rc=0
for r in $kernels_rc $bench_rc $train_rc $loco_rc; do [ "$r" -eq 0 ] || rc=1; done
printf '{"gpu_check": "%s", "ok": %s, "kernel_tests": "%s", "train_30_steps": "%s", "loco_2proc": "%s", "loco_detail": %s, "bench": %s}\n' \
    "$device" "$([ $rc -eq 0 ] && echo true || echo false)" "$(status $kernels_rc)" \
    "$(status $train_rc)" "$loco" "${loco_json:-null}" "${bench_json:-null}"
exit $rc
