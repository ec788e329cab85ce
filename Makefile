# lingbot-serve: `make test` sets up .venv and runs the tests; see README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# On a machine without an NVIDIA GPU take the CPU build of torch (a plain `torch` pulls a CUDA build). The
# floor on GPU machines is pyproject.toml's (torch.accelerator.synchronize needs 2.6).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.6" || echo "torch==2.13.0")

.PHONY: install lint test serve perf clean browser

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The linter (ruff, configured in pyproject.toml) runs first: a lint failure fails the test command.
lint: install
	$(PY) -m ruff check .

# Two pytest processes side by side: the modules that run Ray in one, in file order; the rest beside them
# (tests/side_by_side.py). A failure in either exits non-zero.
test: lint browser
	$(PY) -m tests.side_by_side -q --durations=40 tests

# The browser tests drive Debian's Chromium (root installs it; elsewhere install `chromium` yourself).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# Serve the embedded default (tiny random weights, CPU, SP-2 over gloo) on local Ray; it prints the URL when the
# first model group is ready (http://127.0.0.1:8000/)
serve: install
	$(PY) -m deployments.local serve_config.yaml

# In-process benchmarks (perf/README.md has the rest, incl. the WebSocket benchmark perf/realtime.py)
perf: install
	$(PY) -m perf.ab --switch camera_cache
	$(PY) -m perf.ab --switch fixed_point_skip
	$(PY) -m perf.sp_time
	$(PY) -m perf.cost
	$(PY) -m perf.cost --preset lingbot-world-v2-14b --no-measure

clean:
	rm -rf $(VENV) build *.egg-info
