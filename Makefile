# lingbot-serve: `make test` sets up .venv and runs the tests; see README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# On a machine without an NVIDIA GPU take the CPU build of torch (a plain `torch` pulls a CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.5" || echo "torch==2.13.0")

.PHONY: install test perf clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

perf: install
	$(PY) perf/chunk_time.py
	$(PY) perf/pipeline_time.py
	$(PY) perf/flops.py

clean:
	rm -rf $(VENV) build *.egg-info
