#!/usr/bin/env bash
# The prepared GPU check (issues #15, #45), for a machine with an NVIDIA GPU and jax[cuda] in .venv:
# 1. the benchmark: jattn (auto, pallas, cudnn, blockwise) against jax.nn cuDNN and PyTorch SDPA
#    (flash; skipped if torch is not installed), bf16, fwd and fwd+bwd, T = 2048..32768
#    (bench.suite.GPU_PRESET), writing bench/results-gpu/results.json and results.png;
#    then issue 45's targets (python -m bench.gpu_targets: causal vs cuDNN, window + softcap and packed
#    documents vs PyTorch flex_attention, jvp vs forward), writing bench/results-gpu/targets.json;
# 2. the GPU-relevant tests on the real backend (jattn's GPU kernel compiled by Triton, not
#    interpreted: tests/test_gpu_kernel.py, tests/test_pallas.py; its CUDA lowering; jax.nn's xla
#    and cuDNN paths).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.__version__, jax.devices())'
"$PY" -m bench --gpu --repeats "${REPEATS:-5}" --out "${OUT:-bench/results-gpu}" "$@"
"$PY" -m bench.gpu_targets --repeats "${REPEATS:-5}" --out "${OUT:-bench/results-gpu}/targets.json"
"$PY" -m pytest -q -n 0 tests/test_gpu_kernel.py tests/test_lowering.py tests/test_pallas.py \
    "tests/test_contract.py::test_every_cell_of_the_support_table" tests/test_compat.py
