# mgpu: `make run` trains the default experiment, `make test` runs the suite. `make help` lists all.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; a machine with GPUs may pass its own, e.g. `make TORCH=torch==2.11.0`.
TORCH ?= torch==2.13.0
MLFLOW_PORT ?= 5000
# The directory make is run from, where `python -m mgpu` run there keeps mlflow.db: the shell's
# $(PWD), which `make -C <repo>` leaves as it was (CURDIR is the repo then).
WORKDIR := $(or $(PWD),$(CURDIR))
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install run sweep test test-fast lint ui bench gpu-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/$$(MLFLOW_PORT)/$(MLFLOW_PORT)/' \
		| awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,cluster]'
	touch $@

install: $(VENV)/.installed ## create .venv and install mgpu with its dependencies (dev, cluster extras)

run: install ## train the default experiment (2 processes, DDP, digits) and record it in MLflow
	$(PY) -m mgpu $(ARGS)

sweep: install ## an example sweep: strategy single/ddp x two learning rates, one MLflow parent run
	$(PY) -m mgpu -m experiment=lr_sweep $(ARGS)

# Two tests at a time: a test spends about half its time waiting on its processes' start-up
# and rendezvous. The matrix and README tiers each stay on one worker (their launches are shared).
# Then the `timing` tests, one at a time: their figures are shares of wall-clock time, which
# another test's processes on the same cores would skew. Exit 5 is pytest's "none selected"
# (ARGS naming only tests of the one kind).
TEST_WORKERS ?= 2

test: lint ## ruff, then the whole suite: unit, dist (process groups) and e2e (CLI) tiers
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 -m "not timing" \
		$(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q --durations=5 -m timing $(ARGS) || [ $$? -eq 5 ]

test-fast: install ## the unit tier only: no process groups, no CLI runs (< 2 min)
	$(PY) -m pytest -q -m "not dist and not e2e" $(ARGS)

lint: install ## ruff
	$(VENV)/bin/ruff check mgpu tests scripts

ui: install ## serve the MLflow UI for ./mlflow.db on http://127.0.0.1:$(MLFLOW_PORT)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow server --host 127.0.0.1 \
		--port $(MLFLOW_PORT) --workers 1 \
		--backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///$(WORKDIR)/mlflow.db}

bench: install ## benchmarks, side by side in one run (with the peers in the bench extra); writes bench-report.json
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) scripts/bench.py --out bench-report.json $(ARGS)

gpu-check: install ## the CUDA paths in short real runs, as a table (< 5 min; says so without CUDA)
	$(PY) scripts/gpu_check.py

clean: ## remove outputs, the local MLflow store and caches (keeps .venv)
	rm -rf outputs multirun mlruns mlflow.db bench-report.json .pytest_cache .ruff_cache
