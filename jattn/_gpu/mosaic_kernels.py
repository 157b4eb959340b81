"""The Mosaic GPU kernels (Hopper sm_90, Blackwell sm_100) under :mod:`jattn._gpu.kernels`' names and signatures.

:mod:`jattn._gpu.rules` picks this module or :mod:`jattn._gpu.kernels` (Triton) by ``Spec.backend``; the
operands (tile kinds and bounds, sinks, seeds, the mask's arrays, the score modification's values) are the
same, built once by :func:`jattn._gpu.attention.gpu_attention`. The forward is
:func:`jattn._gpu.mosaic_forward.forward`, the backward :mod:`jattn._gpu.mosaic_backward`'s dq and dk/dv; the
tangent (forward mode) is not written yet and refuses by name (raised when JAX traces the derivative, before
anything runs).
"""

from __future__ import annotations

from jattn._checks import KernelRefusalError
from jattn._gpu.mosaic_backward import dkdv, dq
from jattn._gpu.mosaic_forward import forward

__all__ = ["dkdv", "dq", "forward", "forward_tangent", "tangent"]


def _no(what: str) -> KernelRefusalError:
    return KernelRefusalError(
        f"implementation='pallas' with the Mosaic GPU kernel (sm_90 / sm_100) has no {what} yet: "
        "use implementation='blockwise' (or 'dense') to differentiate"
    )


def tangent(spec, *args):
    """Refused: the Mosaic GPU kernel has no tangent (forward-mode) kernel yet."""
    raise _no("tangent (jvp, forward-mode derivative)")


def forward_tangent(spec, *args):
    """Refused: the Mosaic GPU kernel has no tangent (forward-mode) kernel yet."""
    raise _no("tangent (jvp, forward-mode derivative)")
