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

# The GPU machine has transformers 5.17.0: `make test` runs the patch matrix's cells where the model's
# code meets patch's (tests/test_patch_matrix.py: training, checkpointing, the coverage) and the
# backend's (torch.compile) under it too,
# from a folder first on PYTHONPATH that holds it and what it needs in other versions than the venv's
# (huggingface-hub < 2, which imports httpx); everything else, and the venv, stay as pinned.
GPU_TRANSFORMERS := 5.17.0
GPU_TRANSFORMERS_DIR := $(VENV)/transformers-$(GPU_TRANSFORMERS)

$(GPU_TRANSFORMERS_DIR)/.installed: Makefile | $(STAMP)-test
	rm -rf $(GPU_TRANSFORMERS_DIR)
	$(PY) -m pip install -q --no-deps --target $(GPU_TRANSFORMERS_DIR) transformers==$(GPU_TRANSFORMERS) \
		huggingface-hub==1.33.0 httpx==0.29.0 httpcore==1.0.9 certifi==2026.10.19.post1
	touch $@

test: lint $(GPU_TRANSFORMERS_DIR)/.installed
	$(PY) -m pytest -q -n 2
	PYTHONPATH=$(GPU_TRANSFORMERS_DIR) TEENY_TRANSFORMERS_VERSION=$(GPU_TRANSFORMERS) \
		$(PY) -m pytest -q -n 2 -rs -p no:cacheprovider tests/test_patch_matrix.py \
		-k "trains_as_the_unpatched or checkpointing or coverage or version or backend"

gpu-test:
	PYTHONPATH=src $(GPU_PY) -m pytest -q -n 8 -p no:cacheprovider tests

bench:
	PYTHONPATH=src $(GPU_PY) bench/ops.py

clean:
	rm -rf $(VENV) runs
