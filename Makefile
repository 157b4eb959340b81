# Two commands, each setting itself up in a virtual env inside the repo:
#   make train   the default training run
#   make test    lint + the whole test suite (single device, then 8 simulated devices)
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

.PHONY: train test bench
train: $(VENV)/.installed
	$(PY) -m train $(ARGS)

# Most tests compile many tiny programs and run them once: LLVM's backend optimisation costs them
# more compile time than it saves (test_core -11%, core + flex + variants -24% at -O0). Training
# tests run thousands of steps and lose 31% at -O0, so they keep XLA's defaults, as do users.
FAST_COMPILE := --xla_backend_optimization_level=0

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	XLA_FLAGS="$(FAST_COMPILE) $$XLA_FLAGS" $(PY) -m pytest -n 2 --durations=15 --ignore=tests/test_train.py
	$(PY) -m pytest -n 2 --durations=5 tests/test_train.py
	$(PY) -m pytest -n 2 tests/multidevice

bench: $(VENV)/.installed
	$(PY) -m bench $(ARGS)
