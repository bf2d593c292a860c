# specserve: `make run` serves the default model, `make test` runs every check.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install model run test lint typecheck pytest test-long bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first so that no multi-GB CUDA build is pulled in.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/specserve models pull

run: model
	$(BIN)/specserve serve $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

pytest: model
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

test-long: model
	$(BIN)/pytest --runslow $(PYTEST_ARGS)

bench: model
	$(BIN)/specserve bench --quick --json bench-results/bench.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
