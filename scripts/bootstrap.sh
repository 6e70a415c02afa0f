#!/usr/bin/env bash
# Creates .venv when missing and installs the project into it.
# torch==2.13.0 is named first: it is the CPU wheel on disk, while a bare "torch"
# requirement would pull a multi-gigabyte CUDA build. pip finds that wheel (uv does not look
# on this disk); uv then installs it with everything else, downloading and compiling in
# parallel. Without uv (an index that lacks it), pip does it all.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.installed
if [[ -f $STAMP && $STAMP -nt pyproject.toml ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    torch=("torch==2.13.0")
else
    torch=()
fi
if "${pip[@]}" uv 2>/dev/null; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    if [[ ${#torch[@]} -gt 0 ]]; then
        .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps -d "$wheels" \
            "${torch[@]}"
        torch=("$wheels"/torch-*.whl)
    fi
    # --compile-bytecode: all 11,100 modules (about 37 CPU-s, on every core), once; without
    # it each process of the test suite's first run that imports a module before its
    # bytecode exists compiles it again (the cold run's penalty: docs/testing.md)
    .venv/bin/python -m uv pip install -q --compile-bytecode --python .venv/bin/python \
        "${torch[@]}" -e ".[dev,hf]"
else
    [[ ${#torch[@]} -eq 0 ]] || "${pip[@]}" "${torch[@]}"
    "${pip[@]}" -e ".[dev,hf]"
fi
touch "$STAMP"
