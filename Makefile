# Two commands, each setting itself up in a virtual env inside the repo:
#   make train   the default training run
#   make test    lint + the docs site + the test suite but its heavy tests (one device, then 8 simulated ones)
# and more: make test-heavy (the heavy tests, tests/tiers.py), make test-newest (the files tests/tiers.py names,
# on the newest JAX, Python 3.12+), make compile-check (the GPU kernels compiled, no GPU needed: Triton's for sm_80
# and sm_90, Mosaic GPU's for sm_90a and sm_100a), make jax-triton-route (the forward in Triton's DSL through jax_triton), make ci (what .ci/run
# runs: test, test-heavy, test-newest, compile-check), make docs (the docs site into site/), make fuzz (the slow
# differential fuzz), make bench (benchmarks, ARGS=...).
VENV ?= .venv
PY := $(VENV)/bin/python
# The newest JAX needs Python >= 3.12 (pip gives Python 3.11 jax 0.10.2, the oldest CI tests): its own venv,
# on the first Python 3.12 or 3.13 found on PATH or in pyenv's versions.
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHON_NEWEST ?= $(shell for p in python3.12 python3.13 $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12 $(PYENV_ROOT)/versions/3.13*/bin/python3.13); do \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# --upgrade: the newest releases pyproject.toml admits (jax, jaxlib, flax, ...), not what an older venv kept
$(NEWEST_VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON_NEWEST)" || { echo "make test-newest needs Python 3.12+ (python3.12 on PATH, or PYTHON_NEWEST=...)"; exit 1; }
	$(PYTHON_NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q --upgrade -e ".[dev]"
	touch $@

# Triton from PyPI for make compile-check, in its own venv (never with jax in one process: each bundles its
# own MLIR and LLVM): 3.8.0, whose tt op set equals jaxlib 0.10.2's, with its own ptxas; about 290 MB.
TRITON_VENV ?= .venv-triton
$(TRITON_VENV)/.installed:
	python3 -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install -q triton==3.8.0
	touch $@

# make compile-check's Mosaic GPU half (bench/mosaic_compile.py): JAX's CUDA PJRT plugin of the newest venv's jaxlib
# version (its Mosaic GPU compiler and NVIDIA's PTX compiler inside; no dependencies, no GPU), and the stand-in
# CUDA driver that tells it the chip (bench/fake_cuda.c)
MOSAIC_VENV ?= .venv-mosaic
$(MOSAIC_VENV)/.installed: $(NEWEST_VENV)/.installed bench/fake_cuda.c
	python3 -m venv $(MOSAIC_VENV)
	$(MOSAIC_VENV)/bin/pip install -q --no-deps "jax-cuda13-pjrt==$$($(NEWEST_PY) -c 'import jaxlib; print(jaxlib.__version__)')"
	mkdir -p $(MOSAIC_VENV)/fake-cuda
	$${CC:-cc} -shared -fPIC -o $(MOSAIC_VENV)/fake-cuda/libcuda.so.1 bench/fake_cuda.c
	touch $@

# make jax-triton-route (bench/jax_triton_route.py): torch (CPU, for Triton's interpreter) beside that Triton,
# and a venv of the newest JAX with jax_triton, the official Triton and JAX's CUDA plugin (lowering only: no GPU)
$(TRITON_VENV)/.torch: $(TRITON_VENV)/.installed
	$(TRITON_VENV)/bin/pip install -q torch==2.13.0 numpy
	touch $@
JAX_TRITON_VENV ?= .venv-jax-triton
$(JAX_TRITON_VENV)/.installed:
	@test -n "$(PYTHON_NEWEST)" || { echo "make jax-triton-route needs Python 3.12+ (PYTHON_NEWEST=...)"; exit 1; }
	$(PYTHON_NEWEST) -m venv $(JAX_TRITON_VENV)
	$(JAX_TRITON_VENV)/bin/pip install -q "jax>=0.12" "jax-triton>=0.4.1" "triton>=3.9" numpy
	$(JAX_TRITON_VENV)/bin/pip install -q --no-deps "jax-cuda13-plugin==$$($(JAX_TRITON_VENV)/bin/python -c 'import jaxlib; print(jaxlib.__version__)')"
	touch $@

.PHONY: train test test-heavy test-newest compile-check jax-triton-route ci docs fuzz bench
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
KNOWN_FAST_NEWEST = $$(for f in $(FAST_COMPILE); do XLA_FLAGS=$$f $(NEWEST_PY) -c 'import jax; jax.devices()' 2>/dev/null && printf '%s ' $$f; done)
CACHE := $(CURDIR)/.xla-cache
# Each session's per-test durations (junit XML): docs/contributing.md's table of the slowest comes from them
DURATIONS := $(CURDIR)/.durations
test: export JAX_COMPILATION_CACHE_DIR := $(CACHE)
test: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0.2

# One venv's pytest over a marker expression, on one device then on 8 simulated ones (tests/multidevice); both
# sessions run and report. $(call sessions,PYTHON,MARKERS,NAME): NAME.xml and NAME-multidevice.xml in $(DURATIONS).
sessions = status=0; \
	$(1) -m pytest -n 2 -m "$(2)" --durations=15 --junitxml=$(DURATIONS)/$(3).xml || status=1; \
	$(1) -m pytest -n 2 -m "$(2)" --durations=5 --junitxml=$(DURATIONS)/$(3)-multidevice.xml tests/multidevice || status=1; \
	exit $$status

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(DOCS_BUILD)
	rm -rf "$(CACHE)"
	export JATTN_FAST_XLA_FLAGS="$(KNOWN_FAST)" && export XLA_FLAGS="$$JATTN_FAST_XLA_FLAGS$$XLA_FLAGS" && \
	$(call sessions,$(PY),not heavy,test)

# The heavy tests (tests/tiers.py: training to a verdict, the differential fuzz, sharded training, and the tests
# named SLOW there), on the oldest JAX: it compiles the same tests in half the CPU time of the newest. Shares
# make test's compilation cache.
test-heavy: export JAX_COMPILATION_CACHE_DIR := $(CACHE)
test-heavy: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0.2
test-heavy: $(VENV)/.installed
	export JATTN_FAST_XLA_FLAGS="$(KNOWN_FAST)" && export XLA_FLAGS="$$JATTN_FAST_XLA_FLAGS$$XLA_FLAGS" && \
	$(call sessions,$(PY),heavy,test-heavy)

# The newest JAX (its own venv, Python 3.12+): the files tests/tiers.py names in NEWEST (those that exercise
# JAX's transformations, lowering, Pallas, compilers, Flax, orbax and shard_map most) but their heavy tests.
test-newest: export JAX_COMPILATION_CACHE_DIR := $(CACHE)-newest
test-newest: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0.2
test-newest: $(NEWEST_VENV)/.installed
	rm -rf "$(CACHE)-newest"
	@$(NEWEST_PY) -c 'import jax, sys; print("jax", jax.__version__, "on Python", sys.version.split()[0])'
	export JATTN_FAST_XLA_FLAGS="$(KNOWN_FAST_NEWEST)" && export XLA_FLAGS="$$JATTN_FAST_XLA_FLAGS$$XLA_FLAGS" && \
	$(call sessions,$(NEWEST_PY),newest and not heavy,test-newest)

# Every Triton kernel of jattn (forward, dq, dk/dv, tangent, one-pass jvp; with and without dropout, a
# score mod, sinks; D 64/128/256; bf16, f16, f32) lowered by jax 0.10.2 and compiled by Triton 3.8.0 for
# sm_80 and sm_90: fails on a compile error, shared memory over the chips' limit, or spills over the
# targets (bench/triton_compile.py; docs/design/pallas.md, "Launches and compile statistics").
# Then every Mosaic GPU kernel (forward, dq, dk/dv, the one-pass jvp, the tangent, the paged kernel; plain and with
# features; D 64/128/256; bf16, f16) lowered by the newest jax and compiled by JAX's CUDA plugin for sm_90a and
# sm_100a: fails on a compile error or spills over the measured ceilings (bench/mosaic_compile.py). Both run.
compile-check: $(VENV)/.installed $(TRITON_VENV)/.installed $(MOSAIC_VENV)/.installed
	status=0; TRITON_PY=$(TRITON_VENV)/bin/python $(PY) -m bench.triton_compile || status=1; \
	MOSAIC_PY=$(MOSAIC_VENV)/bin/python FAKE_CUDA_DIR=$(MOSAIC_VENV)/fake-cuda $(NEWEST_PY) -m bench.mosaic_compile || status=1; \
	exit $$status

# The jax_triton route for when JAX drops Pallas' Triton backend: jattn's forward in Triton's DSL
# (bench/triton_dsl.py) checked in Triton's interpreter against float64, compiled for sm_80/sm_90, and lowered
# for CUDA through jax_triton; not in make ci (its venvs download torch and JAX's CUDA plugin)
jax-triton-route: $(TRITON_VENV)/.torch $(JAX_TRITON_VENV)/.installed
	$(TRITON_VENV)/bin/python -m bench.jax_triton_route values
	$(TRITON_VENV)/bin/python -m bench.jax_triton_route stats
	$(JAX_TRITON_VENV)/bin/python -W error::DeprecationWarning -m bench.jax_triton_route lower

# What CI runs (.ci/run): every test once at least (make test, the heavy tests, the newest JAX), then the GPU
# kernels' compile check; all run and report
ci:
	status=0; $(MAKE) test || status=1; $(MAKE) test-heavy || status=1; $(MAKE) test-newest || status=1; \
	$(MAKE) compile-check || status=1; exit $$status

# The differential fuzz's slow mode: 5,000 cases, about an hour on 2 cores (README: chunks, progress log).
fuzz: $(VENV)/.installed
	XLA_FLAGS="$(KNOWN_FAST)$$XLA_FLAGS" $(PY) -m pytest -n 2 --slow -s -p no:cacheprovider tests/test_contract.py -k differential

bench: $(VENV)/.installed
	$(PY) -m bench $(ARGS)
