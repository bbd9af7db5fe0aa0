# Two commands for a fresh machine: `make train` trains a model, `make test` runs the tests.
# Both create (or reuse) a virtual environment in .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.teeny-installed

.PHONY: train test gpu-test bench install clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/teeny train mlp

test: $(STAMP)
	$(PY) -m pytest -q -n 2

clean:
	rm -rf $(VENV) runs
