#!/usr/bin/env bash
# Creates .venv when missing and installs the project into it.
# torch==2.13.0 goes in first: it is the CPU wheel on disk, while a bare "torch"
# requirement would pull a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.installed
if [[ -f $STAMP && $STAMP -nt pyproject.toml ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,hf]"
touch "$STAMP"
