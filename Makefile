# Two commands for a newcomer: `make demo` and `make test`. Both bootstrap .venv on first use.
PY := .venv/bin/python
# Bytecode is written on first import, since the bootstrap compiles nothing ahead: a shell
# that sets PYTHONDONTWRITEBYTECODE would have every process compile torch again.
export PYTHONDONTWRITEBYTECODE :=
NPROC ?= 2
# pytest workers: lab tests share one (tests/conftest.py), the rest spread over both
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

.PHONY: venv demo test test-floor test-newest test-slow torchtitan bench lint format lab

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
	$(PY) $(PYTEST)

# The default suite on the oldest torch we support and on the newest release, each in its own
# venv (scripts/bootstrap-torch.sh; the index's CUDA wheel, about 5 GB). Point FLOOR_VENV or
# NEWEST_VENV at a venv that already has that torch to reuse it. Lint is make test's job.
TORCH_FLOOR := 2.11.0
TORCH_NEWEST := 2.15.0
FLOOR_VENV ?= .venv-floor
NEWEST_VENV ?= .venv-newest

test-floor:
	@scripts/bootstrap-torch.sh $(TORCH_FLOOR) $(FLOOR_VENV) "numpy<2.4"
	PYTHONPATH=$(CURDIR) $(FLOOR_VENV)/bin/python $(PYTEST)

test-newest:
	@scripts/bootstrap-torch.sh $(TORCH_NEWEST) $(NEWEST_VENV)
	PYTHONPATH=$(CURDIR) $(NEWEST_VENV)/bin/python $(PYTEST)

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
