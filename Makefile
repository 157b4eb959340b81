# Two commands, each setting itself up in a virtual env inside the repo:
#   make train   the default training run
#   make test    lint + the docs site + the whole test suite (single device, then 8 simulated devices)
# and three more: make docs (the docs site into site/), make fuzz (the slow differential fuzz),
# make bench (benchmarks, ARGS=...).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

.PHONY: train test docs fuzz bench
train: $(VENV)/.installed
	$(PY) -m train $(ARGS)

# The docs site (mkdocs.yml, docs/): mkdocs build --strict fails on any warning (a broken link or
# anchor, a page missing from the nav, a docstring it cannot parse); about 2 s. Material's banner
# about MkDocs 2 is a notice, not a warning of this build: NO_MKDOCS_2_WARNING silences it.
DOCS_BUILD := NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir site
docs: $(VENV)/.installed
	$(DOCS_BUILD)

# Most tests compile many small programs and run them once, so the test sessions buy compile speed:
# LLVM's backend at -O0 (test_core -11%, core + flex + variants -24%), XLA:CPU's classic emitters
# instead of the MLIR fusion emitters (a small program compiles in 60% of the time; the decoding tests
# take 35% less CPU), and one LLVM module a program rather than parts compiled in parallel (xdist's two
# workers already fill both cores: 3-6% less CPU). The training tests run 20-300 steps and gain too
# (-40% CPU); the one that trains 800 steps runs its command at XLA's defaults, as users do. Every
# session shares a persistent compilation cache, emptied first: the training tests compile the same
# tiny model many times over (-34% CPU for three of them). Tests marked `long` come first (tests/conftest.py).
FAST_COMPILE := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1
# Only the flags this jaxlib knows: XLA aborts on an unknown flag, and a later jaxlib may drop one.
KNOWN_FAST = $$(for f in $(FAST_COMPILE); do XLA_FLAGS=$$f $(PY) -c 'import jax; jax.devices()' 2>/dev/null && printf '%s ' $$f; done)
CACHE := $(CURDIR)/.xla-cache
test: export JAX_COMPILATION_CACHE_DIR := $(CACHE)
test: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0.2

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(DOCS_BUILD)
	rm -rf "$(CACHE)"
	export JATTN_FAST_XLA_FLAGS="$(KNOWN_FAST)" && export XLA_FLAGS="$$JATTN_FAST_XLA_FLAGS$$XLA_FLAGS" && \
	$(PY) -m pytest -n 2 --durations=15 && \
	$(PY) -m pytest -n 2 --durations=5 tests/multidevice

# The differential fuzz's slow mode: 5,000 cases, about an hour on 2 cores (README: chunks, progress log).
fuzz: $(VENV)/.installed
	XLA_FLAGS="$(KNOWN_FAST)$$XLA_FLAGS" $(PY) -m pytest -n 2 --slow -s -p no:cacheprovider tests/test_contract.py -k differential

bench: $(VENV)/.installed
	$(PY) -m bench $(ARGS)
