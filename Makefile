# Two entry points for a fresh clone: `make demo` and `make test`. Both build the venv from this
# repository's own files; `make test` also installs the Debian packages the tests run (prometheus/promtool,
# podman, runc, debootstrap, kubectl, chromium) when missing, and checkov in a venv of its own.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# torch's build for this venv (cpu, or e.g. cu126) and the index serving it, as in the Dockerfile. pip's own
# configuration is used alone when it already resolves torch to that build (a local wheel, a mirror: the index
# is then never contacted); otherwise TORCH_INDEX_URL is added as an extra index, so torch's dependencies
# still come from the configured one and its 2.13.0+cpu outranks the default index's CUDA 2.13.0.
# `make TORCH_INDEX_URL=` takes whatever pip's configuration resolves (the CUDA build from PyPI on Linux).
TORCH_VARIANT ?= cpu
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/$(TORCH_VARIANT)

CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30

.PHONY: demo test lint typecheck unit docs bench fuzz soak clean system-deps

$(BIN)/tqmon: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first: transferqueue depends on torch, and pip would otherwise fetch a multi-GB CUDA build.
	if [ -z "$(TORCH_INDEX_URL)" ] || $(BIN)/pip install --quiet --dry-run --no-deps --report - torch==$(TORCH_VERSION) \
	    | grep -F '"version": "$(TORCH_VERSION)+$(TORCH_VARIANT)"' >/dev/null; then \
	  $(BIN)/pip install --quiet torch==$(TORCH_VERSION); \
	else \
	  $(BIN)/pip install --quiet --extra-index-url $(TORCH_INDEX_URL) torch==$(TORCH_VERSION); \
	fi
	$(BIN)/pip install --quiet -e '.[dev,tq,otel,verl]'
	touch $@

# Debian package of each command the tests run: the image test (podman, runc, debootstrap), the manifest
# tests (kubectl), the unit-file test (systemd-analyze), the Prometheus tests (prometheus, promtool) and the
# headless browser test of the status page (chromium).
SYSTEM_DEPS := promtool:prometheus prometheus:prometheus podman:podman runc:runc debootstrap:debootstrap \
	kubectl:kubernetes-client systemd-analyze:systemd chromium:chromium

system-deps:
	@missing=$$(for pair in $(SYSTEM_DEPS); do command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done | sort -u); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# checkov pins dozens of dependencies of its own: keep it out of the project venv.
$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet checkov==$(CHECKOV_VERSION)

demo: $(BIN)/tqmon
	$(BIN)/tqmon demo

lint: $(BIN)/tqmon
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/tqmon
	$(BIN)/mypy

unit: $(BIN)/tqmon system-deps $(CHECKOV_VENV)/bin/checkov
	$(BIN)/pytest

test: lint typecheck unit

docs: $(BIN)/tqmon
	$(BIN)/python -m mixin.docs && $(BIN)/python -m mixin.rules && $(BIN)/python -m mixin.dashboards \
	  && $(BIN)/python -m mixin.kubernetes

bench: $(BIN)/tqmon
	$(BIN)/python bench/bench_service.py
	$(BIN)/python bench/bench_tq_poll.py
	$(BIN)/python bench/bench_verl_plugin.py
	$(BIN)/python bench/bench_startup.py
	$(BIN)/python bench/bench_cli_startup.py
	$(BIN)/python bench/bench_verl_share.py
	$(BIN)/python bench/bench_checkpoint_read.py
	$(BIN)/python bench/bench_image.py

# The schemathesis run of the test suite with a 20x budget (tests/test_api_fuzz.py).
fuzz: $(BIN)/tqmon
	TQMON_FUZZ_EXAMPLES=2000 $(BIN)/pytest tests/test_api_fuzz.py -q

# A compressed long run against the simulator (docs/reliability.md); a few minutes.
soak: $(BIN)/tqmon system-deps
	PYTHONPATH=. $(BIN)/python bench/soak.py  # reuses the tests' tqmon and Prometheus launchers

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .mypy_cache .ruff_cache tqmon-state
