# Two entry points for a fresh machine (see README): `make quickstart` and `make test`.
# Both create .venv first, installing the CPU build of torch before anything else: a bare `torch`
# requirement can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
OUT    ?= out/quickstart
# SGLang's own environment, beside .venv: the live tests (tests/live/) start its real server on this CPU
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN  := $(SGLANG_VENV)/bin
SGLANG_REQS := tests/live/requirements-sglang-cpu.txt

.PHONY: quickstart test install sglang-env bench drift clean

$(BIN)/dwise-predict: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $@

install: $(BIN)/dwise-predict

# SGLang 0.5.23 pins torch 2.14.1 and CUDA-only kernels: its wheel goes in without its requirements
# (--no-deps), after what it imports to serve a dLLM on a CPU (SGLANG_REQS); then this project, with
# SGLANG_REQS as constraints so that nothing there moves (torch, transformers, python-dateutil). About
# 6 GB (--no-warn-conflicts: pip would list every CUDA package SGLang's metadata names and this
# environment leaves out on purpose); `make test` skips the live tests without it (CI fails them
# instead: DWISE_REQUIRE_SGLANG=1).
$(SGLANG_BIN)/dwise-predict: $(SGLANG_REQS) pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install --quiet --upgrade pip
	$(SGLANG_BIN)/pip install --quiet -r $(SGLANG_REQS)
	$(SGLANG_BIN)/pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_BIN)/pip install --quiet --no-warn-conflicts -e . -c $(SGLANG_REQS)
	@touch $@

sglang-env: $(SGLANG_BIN)/dwise-predict

quickstart: install
	$(BIN)/dwise-predict quickstart --out $(OUT)

# One worker per core, at most four (each holds its own torch and tiny models). Work units are test
# files, so module fixtures are built once, except where tests/work_units.py cuts or joins them; the
# longest start first (collection order, hence --no-loadscope-reorder) so no worker idles at the end.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# Every benchmark in full, one after another (benchmarks/run_all.py): one table, benchmarks/results.json,
# rendered into docs/results.md. SMOKE=1 runs each on its smallest input instead, into out/bench-smoke/.
bench: install
	$(BIN)/python benchmarks/run_all.py $(if $(SMOKE),--smoke)

# The drift scenario's quality side (scripts/drift_scenario.py, docs/serving.md "Keeping the predictor
# fresh"): traffic shifts, the replayed live monitor shows the drop, `refresh` publishes v2 and restores
# it; one table on stdout, $(DRIFT_OUT)/drift.json. A few minutes; SMOKE=1 runs CI's size. Rerun to resume.
DRIFT_OUT ?= out/drift$(if $(SMOKE),-smoke)
drift: install
	$(BIN)/python scripts/drift_scenario.py --out $(DRIFT_OUT) $(if $(SMOKE),--smoke)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) out
