"""One Mosaic GPU kernel compiled to a cubin on a machine without a GPU: the compiler venv's half of
``python -m bench.mosaic_compile``. Imports nothing of jax or jattn.

``python bench/mosaic_cubin.py MODULE`` hands Mosaic GPU's serialized module to ``MosaicGpuCompile`` of JAX's CUDA
PJRT plugin (``jax-cuda13-pjrt``, the same version as the jaxlib that lowered it): the plugin's own pipeline,
the one a GPU runs (Mosaic GPU's passes, LLVM's NVPTX backend, then NVIDIA's PTX compiler linked into the
plugin), with ``MOSAIC_GPU_DUMP_PTXAS=1`` so that the PTX compiler prints its statistics. The plugin asks the
CUDA driver for the compute capability only; bench/fake_cuda.c stands in for the driver (``libcuda.so.1`` on
``LD_LIBRARY_PATH``, the chip in ``FAKE_CUDA_CC``). After the cubin, the plugin JIT-compiles the kernel's host
launch code, which needs JAX's Mosaic GPU runtime and a real driver: that step fails here ("Symbols not found:
mosaic_gpu_build_kernel_spec"), so success is the PTX compiler's statistics, not the call's result.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def plugin_library() -> str:
    """The path of the CUDA PJRT plugin's shared library (without importing its package, which imports jax)."""
    spec = importlib.util.find_spec("jax_plugins")
    for root in spec.submodule_search_locations if spec else ():
        for name in ("xla_cuda13", "xla_cuda12"):
            path = os.path.join(root, name, "xla_cuda_plugin.so")
            if os.path.exists(path):
                return path
    raise SystemExit("no JAX CUDA PJRT plugin here (pip install --no-deps jax-cuda13-pjrt)")


def main(path: str) -> None:
    compile_module = ctypes.CDLL(plugin_library()).MosaicGpuCompile
    compile_module.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_module.restype = ctypes.POINTER(ctypes.c_void_p)
    with open(path, "rb") as fh:
        module = fh.read()
    sys.stdout.flush()
    compile_module(module, len(module))


if __name__ == "__main__":
    main(sys.argv[1])
