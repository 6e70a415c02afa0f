# Two commands for a newcomer: `make demo` and `make test`. Both bootstrap .venv on first use.
PY := .venv/bin/python
NPROC ?= 2

.PHONY: venv demo test test-slow torchtitan bench lint format lab

venv:
	@scripts/bootstrap.sh

demo: venv
	rm -rf runs/demo
	$(PY) examples/train.py --nproc-per-node $(NPROC) --ep $(NPROC) --ckpt-every 100 --out runs/demo

# the cluster lab's Debian packages (sshfs, openssh-server, iproute2), as root; see docs/cluster.md
lab:
	@scripts/lab-packages.sh

test: venv
	@scripts/lab-packages.sh --best-effort
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# torchtitan 0.3.0 with its full dependency set would downgrade huggingface_hub (2.x -> 1.33)
# under transformers 5.23, so it goes in without dependencies, plus the pure-python packages
# its model, FSDP and checkpoint modules import (torch, numpy, safetensors are there already).
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 \
	einops==0.8.2 docstring_parser==0.18.0 typeguard==4.6.0

torchtitan: venv
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(TORCHTITAN)

test-slow: venv torchtitan
	$(PY) -m pytest -q -m slow

format: venv
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
