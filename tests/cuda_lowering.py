"""Lowering for CUDA on a machine without a GPU, for a chosen compute capability (tests/test_lowering.py).

jax 0.10's Pallas lowers Triton kernels for sm_90 where no GPU is present (its fallback). From jax 0.11 it asks
the device, and with none raises "No supported GPU devices found, please specify an abstract GPU device using
AbstractDevice": the target is an abstract mesh whose abstract device names a GPU (``device_kind``), whose
compute capability JAX's table gives. The Pallas Triton backend's deprecation warning (jax 0.11+) is
jattn's GPU kernel's to answer (jattn/_gpu/deprecation.py): lowering here lets nothing through, so under the
suite's warnings-as-errors a warning that reached the user fails the test.
"""

from __future__ import annotations

import contextlib
import importlib.util

import jax

#: The architectures lowered for, each with the device kind that JAX's GPU table maps to it.
DEVICE_KINDS = {"sm_80": "NVIDIA A100", "sm_90": "NVIDIA H100", "sm_100": "NVIDIA B200"}

#: jax 0.11+ reads the target from an abstract device (``jax._src.gpu_info``; 0.11's in ``jax._src.pallas.triton``);
#: 0.10 lowers for sm_90 only.
TARGETS_BY_DEVICE_KIND = any(
    importlib.util.find_spec(m) is not None for m in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info")
)
ARCHS = ["sm_80", "sm_90"] if TARGETS_BY_DEVICE_KIND else ["sm_90"]
#: With Blackwell (sm_100), whose kernel the automatic choice picks by compute capability.
ARCHS_CHOSEN = [*ARCHS, "sm_100"] if TARGETS_BY_DEVICE_KIND else ARCHS


def _target(arch: str):
    """A context in which Pallas lowers Triton for ``arch`` (nothing to set on jax 0.10: sm_90)."""
    if not TARGETS_BY_DEVICE_KIND:
        assert arch == "sm_90", f"jax {jax.__version__} lowers Triton for sm_90 only without a GPU, not {arch}"
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[arch], num_cores=None, platform="gpu")
    auto = (jax.sharding.AxisType.Auto,)  # no explicit sharding: the program is the one a GPU user traces
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("_",), auto, abstract_device=device))


def cuda_text(fn, *args, arch: str = "sm_90") -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for CUDA, its Triton kernels for ``arch``."""
    with _target(arch):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
