# Set-up and the two commands from the README: `make report` and `make test`.
# TORCH_SPEC picks the torch build; the exact pin takes the CPU wheel these machines carry.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REPORT_NAME ?= report
# The report notebook's own defaults (tiny preset) keep the test suite fast; `make report`
# measures the small preset (25M parameters, 303 MB checkpoints) in 3 interleaved repeats, one
# torch thread training so that a core is left to the background writes, as on a GPU node
# (about 5 minutes on 2 cores).
REPORT_PARAMS ?= -p preset small -p steps 12 -p every 4 -p repeats 3 -p torch_threads 1

.PHONY: venv report test lint lab browser-deps clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[lab,test]"
	$(BIN)/python -m pip check
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# Debian's Chromium for the browser test; only root can apt-get, others get a skip with the reason.
browser-deps:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) \
		|| echo "warning: could not install chromium; the browser test will be skipped"; \
	else echo "note: /usr/bin/chromium missing and not root; the browser test will be skipped"; fi

report: $(STAMP)
	$(BIN)/nbckpt report --name $(REPORT_NAME) $(REPORT_PARAMS)

# JupyterLab on the notebooks, from the project's venv (LAB_ARGS: e.g. --no-browser --port 8899).
LAB_ARGS ?=
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check nbckpt tests benchmarks scripts examples
	$(BIN)/ruff format --check nbckpt tests benchmarks scripts examples
	$(BIN)/mypy

# Two pytest workers share the two cores: one torch thread each, since OpenMP threads that
# spin-wait on an oversubscribed machine make a tiny model's step ten times slower.
# One run for the tests and nbval's notebooks, so that neither waits for the other's last test:
# a notebook's cells are one xdist group (one kernel, one worker), and nbval leaves out the
# notebooks the tests run with their defaults (notebooks/conftest.py).
test: export OMP_NUM_THREADS = 1
# Every rank, kernel and CLI the suite starts imports nbckpt: from bytecode cached on the first
# import (about 0.3 s of CPU a process), also where the environment asks Python to write none.
test: export PYTHONDONTWRITEBYTECODE =
test: $(STAMP) browser-deps lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=25 --nbval-lax --nbval-current-env tests notebooks
	# nbval runs them with their defaults: 01 and 08 keep their run for re-running cells by hand
	rm -rf data/checkpoints/01_quickstart data/checkpoints/08_never_lose_work

clean:
	rm -rf $(VENV) reports data/checkpoints .pytest_cache .mypy_cache .ruff_cache
