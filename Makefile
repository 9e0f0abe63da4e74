# One command sets up a fresh machine and runs the main job; one sets it up and runs the tests.
#   make run    create .venv (torch 2.9.1, every extra CI uses) and run the main job
#   make test   create .venv and run the whole test suite (this is what CI runs)
# Both are idempotent: the environment is rebuilt only when pyproject.toml changes.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# fairseq2 0.8.1 pins torch 2.9.1 (through fairseq2n); install it first so pip never picks another.
TORCH   := torch==2.9.1
PYTEST_ARGS ?=

.PHONY: setup run test test-fast bench lint docs clean system-deps

setup: $(STAMP)

# fairseq2n loads libsndfile.so.1 at import time; the native CPU kernels are compiled on first use (g++).
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libsndfile\.so\.1'; then \
	  echo "installing libsndfile1 (needed by fairseq2)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libsndfile1; \
	fi
	@if ! command -v c++ >/dev/null 2>&1; then \
	  echo "installing g++ (builds the native CPU kernels)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q g++; \
	fi

$(STAMP): pyproject.toml examples/third_party_plugin/pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[all]' -e examples/third_party_plugin
	touch $(STAMP)

run: setup
	$(VENV)/bin/mixer-plugins demo

# The unit tests and, once each with timing disabled, the benchmark suites (so they cannot rot).
# --dist loadfile keeps each test module on one worker (fairseq2 is initialised once per process).
test: setup
	$(PY) -m pytest -n 2 --dist loadfile tests benchmarks --benchmark-disable $(PYTEST_ARGS)

# Timed benchmark runs, saved as JSON under .benchmarks/ (render them with: mixer-plugins bench-table .benchmarks)
bench: setup
	$(PY) -m pytest benchmarks --benchmark-only --benchmark-autosave $(PYTEST_ARGS)

# The documentation site (mkdocs + mkdocstrings); `make test` also checks it builds with --strict.
docs: setup
	$(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks site
