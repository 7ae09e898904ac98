# Two entry points for a fresh machine (see README): `make quickstart` and `make test`.
# Both create .venv first, installing the CPU build of torch before anything else: a bare `torch`
# requirement can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
OUT    ?= out/quickstart

.PHONY: quickstart test install clean

$(BIN)/dwise-predict: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $@

install: $(BIN)/dwise-predict

quickstart: install
	$(BIN)/dwise-predict quickstart --out $(OUT)

# One worker per core, at most four (each holds its own torch and tiny models). Work units are test
# files, so module fixtures are built once, except where tests/work_units.py cuts or joins them; the
# longest start first (collection order, hence --no-loadscope-reorder) so no worker idles at the end.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) out
