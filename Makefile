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

# The suite compiles thousands of tiny programs: LLVM's backend optimisation costs them more
# compile time than it saves run time (-24% wall time for the core tests). Tests only; users and
# benchmarks keep XLA's defaults.
test: export XLA_FLAGS := --xla_backend_optimization_level=0 $(XLA_FLAGS)
test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -n 2 --durations=15
	$(PY) -m pytest -n 2 tests/multidevice

bench: $(VENV)/.installed
	$(PY) -m bench $(ARGS)
