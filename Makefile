# pdsweep. Two commands do everything on a fresh machine:
#   make sweep   the main job: the GPU matrix on a GPU node, sweeps/cpu-smoke.yaml without one
#   make test    the tests
# Both create/update the venv first (quick when nothing changed).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdsweep-installed
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
SWEEP ?= $(if $(HAVE_GPU),sweeps/hybrid-mla-mamba.yaml,sweeps/cpu-smoke.yaml)
SWEEP_NAME := $(basename $(notdir $(SWEEP)))
RUN := $(or $(RUN),results/$(SWEEP_NAME)-$(shell date +%Y%m%d-%H%M%S))
LATEST ?= results/latest
A ?= results/unfixed
B ?= results/fixed
BASELINE ?= results/last-green
PYTEST_ARGS ?=
# local: instances are child processes of this host; slurm: job steps of the allocation
# `make` runs in (inside salloc/sbatch; see scripts/slurm-sweep.sbatch)
LAUNCHER ?= local

.PHONY: install sweep plan validate gate report compare nightly test lint bench baseline-env clean

install: $(STAMP)
$(STAMP): pyproject.toml scripts/install-env.sh scripts/cpu-env-fixups.py
	bash scripts/install-env.sh $(VENV)

validate: install
	$(PY) -m pdsweep validate $(SWEEP)

plan: install
	$(PY) -m pdsweep plan $(SWEEP) $(if $(filter slurm,$(LAUNCHER)),--launcher slurm)

# Run the sweep, point results/latest at it, write the report, then gate it. Without an
# unfixed baseline (unsupported vLLM version) only the unfixed cells fail, with the reason.
sweep: install
	$(MAKE) --no-print-directory baseline-env || echo "warning: no unfixed baseline env; cells with build: unfixed will fail"
	$(PY) -m pdsweep run $(SWEEP) --out $(RUN) --launcher $(LAUNCHER)
	ln -sfn $(abspath $(RUN)) $(LATEST)
	$(PY) -m pdsweep report $(LATEST)
	$(PY) -m pdsweep gate $(LATEST)

gate: install
	$(PY) -m pdsweep gate $(LATEST) --junit $(LATEST)/junit.xml --summary $(LATEST)/summary.md

report: install
	$(PY) -m pdsweep report $(LATEST)

compare: install
	$(PY) -m pdsweep compare $(A) $(B)

# Nightly: sweep + gate + compare against the last green run + summary. BASELINE is a
# directory kept outside the checkout on CI (a copy, not a link: checkouts clean results/);
# a green run replaces it. No baseline yet: said loudly, the gate alone decides.
nightly: install
	$(MAKE) --no-print-directory baseline-env || echo "warning: no unfixed baseline env; cells with build: unfixed will fail"
	$(PY) -m pdsweep run $(SWEEP) --out $(RUN) --quiet --launcher $(LAUNCHER)
	ln -sfn $(abspath $(RUN)) $(LATEST)
	$(PY) -m pdsweep report $(LATEST)
	status=0; $(PY) -m pdsweep gate $(LATEST) --junit $(LATEST)/junit.xml --summary $(LATEST)/summary.md || status=$$?; \
	if [ -f $(BASELINE)/run.json ]; then $(PY) -m pdsweep compare $(BASELINE) $(LATEST) --out $(LATEST) || status=1; \
	else echo "nightly: NO BASELINE at $(BASELINE): compare skipped (first run?)"; fi; \
	if [ $$status -eq 0 ]; then rm -rf $(BASELINE).new && cp -a $(abspath $(RUN)) $(BASELINE).new && \
	  rm -rf $(BASELINE) && mv $(BASELINE).new $(BASELINE) && echo "nightly: $(BASELINE) <- $(RUN)"; fi; exit $$status

baseline-env: install
	$(PY) -m pdsweep baseline-env --dest $(VENV)-unfixed

# the integration tests run the unfixed baseline next to the installed vLLM (the core case)
test: install baseline-env
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff over the whole tree ([tool.ruff] in pyproject.toml); CI runs it first, before the
# install: it takes the venv's ruff (the dev extra) when there is one, else a ruff-only
# venv made in seconds, so a lint error fails CI before minutes of installing
LINT_VENV ?= .venv-lint
RUFF = $(firstword $(wildcard $(VENV)/bin/ruff) $(LINT_VENV)/bin/ruff)
lint:
	@[ -x "$(RUFF)" ] || { python3 -m venv $(LINT_VENV) && $(LINT_VENV)/bin/python -m pip install --quiet \
	  --disable-pip-version-check "ruff>=0.6"; }
	$(RUFF) check .

bench: install
	mkdir -p results/bench
	$(PY) -m pytest bench/ --benchmark-only --benchmark-json=results/bench/bench.json $(PYTEST_ARGS)
	$(PY) scripts/bench-summary.py results/bench/bench.json > results/bench/summary.md
	cat results/bench/summary.md

clean:
	rm -rf .pytest_cache .hypothesis .benchmarks
