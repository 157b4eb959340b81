"""A fused CPU attention forward in C++, measured against PyTorch SDPA: evidence, not a jattn path.

``kernel.cc`` runs each (head, block of query rows) on one thread with the online softmax fused
between two products, its own (a 6 x 64 AVX-512 micro-kernel over kᵀ packed in panels) or a
CBLAS library's (README, "The 2-thread forward's floor"). It covers full attention in
float32 only, with no masks, no gradient and no NaN contract: it answers how fast a fused kernel
would be here, as the starting point of an XLA FFI kernel. ``python -m bench.fused_cpu`` runs it.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("kernel.cc")


def numpy_openblas() -> Path:
    """The OpenBLAS library inside NumPy's wheel (``numpy.libs/libscipy_openblas64_*.so``)."""
    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    if not libs:
        raise FileNotFoundError("no libscipy_openblas64_*.so beside numpy: pass blas= (e.g. MKL's libmkl_rt.so)")
    return libs[0]


class Fused:
    """The compiled kernel with its own products (``blas=None``) or a CBLAS library's.

    ``blas``: ``"openblas"`` for the one in NumPy's wheel, or a library's path; MKL's ``libmkl_rt``
    must run sequentially: set ``MKL_THREADING_LAYER=SEQUENTIAL`` first.
    """

    def __init__(self, blas: Path | str | None = None, build_dir: Path | None = None):
        build_dir = Path(build_dir or tempfile.mkdtemp(prefix="jattn-fused-"))
        lib = build_dir / "libfused.so"
        cmd = ["g++", "-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", str(SOURCE), "-o", str(lib), "-ldl"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(str(lib))
        self.lib.fused_init.argtypes = [ctypes.c_char_p]
        i64 = ctypes.c_int64
        ptr = ctypes.c_void_p
        self.lib.fused_forward.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_float, i64, i64, ctypes.c_int]
        self.lib.fused_forward.restype = None
        self.blas = numpy_openblas() if blas == "openblas" else blas and Path(blas)
        if self.lib.fused_init(str(self.blas or "").encode()) != 0:
            raise OSError(f"cannot use {self.blas} as CBLAS (no scipy_cblas_sgemm64_ or cblas_sgemm)")

    def __call__(self, q, k, v, *, rows: int = 512, keys: int = 512, threads: int = 1) -> np.ndarray:
        """softmax(q kᵀ / √D) v for q (H, T, D), k and v (H, S, D) float32: out (H, T, D)."""
        q, k, v = (np.ascontiguousarray(x, np.float32) for x in (q, k, v))
        (H, T, D), S = q.shape, k.shape[1]
        if k.shape != (H, S, D) or v.shape != (H, S, D):
            raise ValueError(f"q (H, T, D), k and v (H, S, D): got q {q.shape}, k {k.shape}, v {v.shape}")
        out = np.empty_like(q)
        data = (x.ctypes.data for x in (q, k, v, out))
        self.lib.fused_forward(*data, H, T, S, D, D**-0.5, rows, keys, threads)
        return out
