# gpufail: every target creates the environment it needs from nothing (a venv in .venv).
# `make help` lists the targets.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DATA ?= demo-data
DEMO_OUT ?= $(DEMO_DATA)/out
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1

.DEFAULT_GOAL := help
.PHONY: help install demo test test-fast lint bench bench-paper lock clean mlflow notebooks serve

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	@# Compiled to bytecode once here: where PYTHONDONTWRITEBYTECODE is set (as in the image),
	@# every process would otherwise compile what it imports (a second of each CLI command's
	@# start, and of a serving replica's).
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -r requirements.lock
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	$(BIN)/python -m compileall -q gpufail ingest features models serving
	touch $(STAMP)

install: $(STAMP) ## Create .venv with the pinned dependencies (requirements.lock)

demo: $(STAMP) ## Run the whole pipeline on a simulated fleet (writes $(DEMO_DATA)/)
	rm -rf $(DEMO_DATA)
	$(BIN)/gpufail simulate --out $(DEMO_DATA) --preset demo
	$(BIN)/gpufail ingest kernel-log --data $(DEMO_DATA)
	$(BIN)/gpufail features --data $(DEMO_DATA)
	$(BIN)/gpufail train --data $(DEMO_DATA) --model-out $(DEMO_OUT)/model
	$(BIN)/gpufail evaluate --data $(DEMO_DATA) --report $(DEMO_OUT)/report
	$(BIN)/gpufail score --data $(DEMO_DATA) --model $(DEMO_OUT)/model
	@# A dry run to Slurm when one is configured and its controller answers, else to the audit
	@# log only. The config file check comes first: without one, Slurm tools look for a
	@# controller in DNS.
	if [ -f "$${SLURM_CONF:-/etc/slurm/slurm.conf}" ] && timeout 15 scontrol ping >/dev/null 2>&1; \
		then target=slurm; else target=log; fi; \
		$(BIN)/gpufail publish --data $(DEMO_DATA) --to $$target --dry-run
	$(BIN)/gpufail summary --data $(DEMO_DATA) --report $(DEMO_OUT)/report

# Test processes: most tests wait on child processes and servers, so two workers keep both of
# CI's two cores busy. Each worker starts its own MLflow server and Slurm controller when its
# tests ask for one, so more workers cost memory as well as cores.
TEST_WORKERS ?= 2

test: $(STAMP) ## Run the whole test suite, as CI does (no GPU, no ../shared needed; TEST_WORKERS=1: one process)
	$(BIN)/pytest -q -n $(TEST_WORKERS)

test-fast: $(STAMP) ## The test suite without the tests marked slow (minutes less; `make test` before a merge)
	$(BIN)/pytest -q -n $(TEST_WORKERS) -m "not slow"

NOTEBOOKS_OUT ?= build/notebooks
notebooks: $(STAMP) ## Run notebooks/*.ipynb on $(DEMO_DATA) (`make demo` first if needed) -> $(NOTEBOOKS_OUT)/*.html
	@# The notebooks read the data root from [store] root and the report from <root>/out/report.
	if [ ! -f "$(DEMO_DATA)/out/report/metrics.json" ]; then $(MAKE) demo; fi
	GPUFAIL_STORE__ROOT="$(abspath $(DEMO_DATA))" MPLBACKEND=module://matplotlib_inline.backend_inline \
		$(BIN)/jupyter nbconvert --to html --execute --ExecutePreprocessor.timeout=1800 \
		--output-dir $(NOTEBOOKS_OUT) notebooks/*.ipynb

mlflow: $(STAMP) ## Run the embedded MLflow registry on 127.0.0.1:5000 (SQLite, ./mlruns)
	$(BIN)/gpufail mlflow

SERVE_MODEL ?= $(DEMO_OUT)/model
serve: $(STAMP) ## Serve predictions on 127.0.0.1:8080 (the demo's model; SERVE_MODEL= for the registry champion)
	@# The demo's data is simulated in the past: readiness does not check the features' age here.
	GPUFAIL_SERVE__FEATURES_MAX_AGE=$${GPUFAIL_SERVE__FEATURES_MAX_AGE:-0s} \
		$(BIN)/gpufail serve --data $(DEMO_DATA) $(if $(SERVE_MODEL),--model $(SERVE_MODEL))

bench: $(STAMP) ## Time each demo stage (and peak memory) and the hot loops -> bench-results/
	$(BIN)/python -m benchmarks --out bench-results

bench-paper: $(STAMP) ## The paper preset (~31k GPUs, 120 days) stage by stage -> bench-results/bench-paper.md (PAPER_DAYS=30: shorter)
	$(BIN)/python -m benchmarks --paper --out bench-results $(if $(PAPER_DAYS),--days $(PAPER_DAYS))

lint: $(STAMP) ## ruff, mypy and the layer contract
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

lock: ## Re-resolve requirements.lock from pyproject.toml (every extra: the full development install)
	$(BIN)/uv pip compile --quiet pyproject.toml --all-extras -o requirements.lock --python-version 3.11

clean: ## Remove the venv, caches and demo data
	rm -rf $(VENV) $(DEMO_DATA) .pytest_cache .mypy_cache .ruff_cache
