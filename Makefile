# One command sets up a fresh machine and runs the main job; one sets it up and runs the tests.
#   make run    create .venv (torch 2.9.1, every extra CI uses) and run the main job
#   make test   create .venv, then ruff, lint-imports, mypy and the whole test suite (this is what CI runs)
# Both are idempotent: the environment is reinstalled only when pyproject.toml, setup.py or the example plugin's
# change (the stamp is a hash of the files, so a fresh clone beside a matching .venv reinstalls nothing). After editing
# the C++ kernels (mixer_plugins/kernels/_native/), `make native-build` recompiles them.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
# fairseq2 0.8.1 pins torch 2.9.1 (through fairseq2n); install it first so pip never picks another.
TORCH   := torch==2.9.1
PYTEST_ARGS ?=
REQUIREMENTS := pyproject.toml setup.py examples/third_party_plugin/pyproject.toml
HASH    := $(shell $(PYTHON) -c "import hashlib, sys; h = hashlib.sha256(); [h.update(open(p, 'rb').read()) for p in sys.argv[1:]]; print(h.hexdigest()[:16])" $(REQUIREMENTS))
STAMP   := $(VENV)/.installed-$(HASH)

.PHONY: setup native native-build run test test-fast bench lint docs clean system-deps

setup: $(STAMP) native

# Installs nothing without saying first what, why and how: fairseq2n loads libsndfile.so.1 at import time, and the
# native CPU kernels are compiled with the C++ compiler when the package is installed.
system-deps:
	@missing=""; \
	if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libsndfile\.so\.1'; then \
	  echo "system package libsndfile1 is missing: fairseq2 loads libsndfile.so.1 when it is imported"; \
	  missing="$$missing libsndfile1"; \
	fi; \
	if ! command -v "$${CXX:-c++}" >/dev/null 2>&1; then \
	  echo "system package g++ is missing: it compiles the native CPU kernels"; \
	  missing="$$missing g++"; \
	fi; \
	if [ -n "$$missing" ]; then \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "no apt-get here: install$$missing with your system's package manager, then run make again"; exit 1; \
	  fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing$$missing with: $${SUDO:+$$SUDO }apt-get update && $${SUDO:+$$SUDO }apt-get install -y$$missing"; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $$missing; \
	fi

# The package is installed without build isolation, so that setup.py compiles the native CPU kernels against the torch
# installed just before (a minute or two; pip never fetches another torch). Without a compiler it installs without
# them and their PyTorch code runs.
$(STAMP):
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q --no-build-isolation -e '.[all]'
	$(PY) -m pip install -q -e examples/third_party_plugin
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Say whether the native CPU kernels load; without them the PyTorch code runs: not a reason to stop.
native: $(STAMP)
	@$(VENV)/bin/mixer-plugins env --native || echo "continuing without the native CPU kernels (see above)"

# Recompile the native CPU kernels in place (after editing their C++).
native-build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

run: setup
	$(VENV)/bin/mixer-plugins demo

# Lint, the layer contracts and the type check (mypy, settings in pyproject.toml), then the unit tests and, once each
# with timing disabled, the benchmark suites (so they cannot rot). --dist loadfile keeps each test module on one worker
# (fairseq2 is initialised once per process); --no-loadscope-reorder keeps the modules in collection order, where
# tests/conftest.py puts the ones holding a slow test first. TORCHINDUCTOR_VEC_ISA_OK=1: inductor takes the vector
# instruction sets the CPU reports as buildable, instead of building and loading a probe program per set (a fresh
# Python each) in every process that compiles, ~17 s each; where the C++ compiler cannot build them, the compile tests
# fail with its error (`make test TORCHINDUCTOR_VEC_ISA_OK=` probes as inductor does by default).
TORCHINDUCTOR_VEC_ISA_OK ?= 1
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	TORCHINDUCTOR_VEC_ISA_OK=$(TORCHINDUCTOR_VEC_ISA_OK) $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests \
	  benchmarks --benchmark-disable $(PYTEST_ARGS)

# Timed benchmark runs, saved as JSON under .benchmarks/ (render them with: mixer-plugins bench-table .benchmarks)
bench: setup
	$(PY) -m pytest benchmarks --benchmark-only --benchmark-autosave $(PYTEST_ARGS)

# The documentation site (mkdocs + mkdocstrings); `make test` also checks it builds with --strict.
docs: setup
	$(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks site
