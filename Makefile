# Two commands for a newcomer: `make demo` and `make test`. Both bootstrap .venv on first use.
PY := .venv/bin/python
NPROC ?= 2

.PHONY: venv demo test test-slow bench lint format

venv:
	@scripts/bootstrap.sh

demo: venv
	rm -rf runs/demo
	$(PY) examples/train.py --nproc-per-node $(NPROC) --ep $(NPROC) --ckpt-every 100 --out runs/demo

test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

test-slow: venv
	$(PY) -m pytest -q -m slow

format: venv
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
