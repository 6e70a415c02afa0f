#!/usr/bin/env bash
# A second venv on another torch release, with the project installed into it (editable, from
# this checkout):  scripts/bootstrap-torch.sh VERSION VENV [EXTRA_REQUIREMENT ...]
#   make test-floor   ->  scripts/bootstrap-torch.sh 2.11.0 .venv-floor "numpy<2.4"
#   make test-newest  ->  scripts/bootstrap-torch.sh 2.15.0 .venv-newest
# torch comes from the package index with PIP_CONSTRAINT=/dev/null: a machine's pip config
# may cap torch at the releases on its disk. The index's wheel is the CUDA build (about 5 GB
# installed); it runs on the CPU too. A VENV that already has torch==VERSION (a prebuilt one,
# or a symlink to it) is kept and only gets the project. Extra requirements go in with it
# (Triton 3.6, torch 2.11's, needs numpy<2.4 for its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 2 ]]; then
    echo "usage: $0 TORCH_VERSION VENV [EXTRA_REQUIREMENT ...]" >&2
    exit 2
fi
VERSION=$1 VENV=$2
shift 2
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.fsdp-ext-installed
if [[ -f $STAMP && $STAMP -nt pyproject.toml && "$(cat "$STAMP")" == "$PWD" ]]; then
    exit 0
fi
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ $have != "$VERSION" ]]; then
    echo "bootstrap-torch: installing torch==$VERSION into $VENV (found: ${have:-none})"
    "$VENV/bin/python" -m pip install -q "torch==$VERSION"
fi
"$VENV/bin/python" -m pip install -q "$@" -e ".[dev,hf]"
got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [[ $got != "$VERSION" ]]; then
    echo "bootstrap-torch: $VENV has torch $got after installing the project, not $VERSION" >&2
    exit 1
fi
echo "$PWD" >"$STAMP"
