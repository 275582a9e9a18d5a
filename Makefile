# Two entry points for a fresh clone: `make demo` and `make test`. Both build the venv from this
# repository's own files; `make test` also installs Debian's prometheus (promtool) and chromium when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0

.PHONY: demo test lint typecheck unit docs bench fuzz soak clean system-deps

$(BIN)/tqmon: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first: transferqueue depends on torch, and pip would otherwise fetch a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev,tq,otel,verl]'
	touch $@

system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (for promtool and the end-to-end tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
	@command -v chromium >/dev/null || { \
	  echo "installing Debian's chromium (headless browser test of the status page)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

demo: $(BIN)/tqmon
	$(BIN)/tqmon demo

lint: $(BIN)/tqmon
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/tqmon
	$(BIN)/mypy

unit: $(BIN)/tqmon system-deps
	$(BIN)/pytest

test: lint typecheck unit

docs: $(BIN)/tqmon
	$(BIN)/python -m mixin.docs && $(BIN)/python -m mixin.rules && $(BIN)/python -m mixin.dashboards

bench: $(BIN)/tqmon
	$(BIN)/python bench/bench_service.py
	$(BIN)/python bench/bench_tq_poll.py
	$(BIN)/python bench/bench_verl_plugin.py
	$(BIN)/python bench/bench_startup.py
	$(BIN)/python bench/bench_checkpoint_read.py

# The schemathesis run of the test suite with a 20x budget (tests/test_api_fuzz.py).
fuzz: $(BIN)/tqmon
	TQMON_FUZZ_EXAMPLES=2000 $(BIN)/pytest tests/test_api_fuzz.py -q

# A compressed long run against the simulator (docs/reliability.md); a few minutes.
soak: $(BIN)/tqmon system-deps
	PYTHONPATH=. $(BIN)/python bench/soak.py  # reuses the tests' tqmon and Prometheus launchers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache tqmon-state
