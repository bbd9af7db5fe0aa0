# Two commands for a fresh machine: `make train` trains a model, `make test` runs the tests.
# Both create (or reuse) a virtual environment in .venv and install what they need, with the
# versions pinned in constraints.txt: `make train` teeny with its [train] extra, `make test` with
# [test] (which holds train's). `make gpu-test` and `make bench` are for the GPU machine, which
# has torch and triton installed: they run from the source tree without installing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.teeny-installed
GPU_PY ?= python3

.PHONY: train test lint gpu-test bench install clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# $(STAMP)-train, $(STAMP)-test: teeny installed (editable) with that extra
$(STAMP)-%: pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q -c constraints.txt -e '.[$*]'
	touch $@

install: $(STAMP)-test

train: $(STAMP)-train
	$(VENV)/bin/teeny train mlp

lint: $(STAMP)-test
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

test: lint
	$(PY) -m pytest -q -n 2

gpu-test:
	PYTHONPATH=src $(GPU_PY) -m pytest -q -n 8 -p no:cacheprovider tests

bench:
	PYTHONPATH=src $(GPU_PY) bench/ops.py

clean:
	rm -rf $(VENV) runs
