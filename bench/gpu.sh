#!/usr/bin/env bash
# The prepared GPU check (issues #15, #45), for a machine with an NVIDIA GPU and jax[cuda]
# (PYTHON=python3 where there is no .venv). Most valuable first, so a short loan still brings back
# issue 45's figures; each step runs even if an earlier one failed, and the status says if any did:
# 1. issue 45's targets (python -m bench.gpu_targets: causal vs cuDNN, window + softcap and packed
#    documents vs PyTorch flex_attention, jvp vs forward), writing $OUT/targets.json;
# 2. the GPU-relevant tests on the real backend (jattn's GPU kernel compiled by Triton, not
#    interpreted: tests/test_gpu_kernel.py, tests/test_pallas.py; the Mosaic GPU kernels compiled for the
#    GPU at hand: tests/test_mosaic_gpu.py; its CUDA lowering; jax.nn's xla
#    and cuDNN paths), if pytest and hypothesis are installed there;
# 3. the broad benchmark: jattn (auto, pallas, cudnn, blockwise) against jax.nn cuDNN and PyTorch
#    SDPA (flash; skipped if torch is not installed), bf16, fwd and fwd+bwd, T = 2048..32768
#    (bench.suite.GPU_PRESET), writing $OUT/results.json (and results.png with matplotlib).
# OUT defaults to bench/results-gpu, REPEATS to 5.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-bench/results-gpu}
mkdir -p "$OUT"
failed=0
step() { echo "== $*"; "$@" || { echo "== failed ($?): $*"; failed=1; }; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.__version__, jax.devices())' || exit 1
step "$PY" -m bench.gpu_targets --repeats "${REPEATS:-5}" --out "$OUT/targets.json"
if "$PY" -c 'import pytest, hypothesis' 2>/dev/null; then
    parallel=()
    "$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 0)
    step "$PY" -m pytest -q ${parallel[@]+"${parallel[@]}"} tests/test_gpu_kernel.py tests/test_mosaic_gpu.py tests/test_lowering.py tests/test_pallas.py \
        "tests/test_contract.py::test_every_cell_of_the_support_table" tests/test_compat.py
else
    echo "== skipped the compiled tests: pytest or hypothesis is not installed"
fi
step "$PY" -m bench --gpu --repeats "${REPEATS:-5}" --out "$OUT" "$@"
exit $failed
