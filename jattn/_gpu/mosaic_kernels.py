"""The Mosaic GPU kernels (Hopper sm_90) under :mod:`jattn._gpu.kernels`' names and signatures.

:mod:`jattn._gpu.rules` picks this module or :mod:`jattn._gpu.kernels` (Triton) by ``Spec.backend``; the
operands (tile kinds and bounds, sinks, seeds, the mask's arrays, the score modification's values) are the
same, built once by :func:`jattn._gpu.attention.gpu_attention`. The forward is
:func:`jattn._gpu.mosaic_forward.forward`, the backward :mod:`jattn._gpu.mosaic_backward`'s dq and dk/dv, the
tangent (forward mode) :mod:`jattn._gpu.mosaic_tangent`'s.
"""

from __future__ import annotations

from jattn._gpu.mosaic_backward import dkdv, dq
from jattn._gpu.mosaic_forward import forward
from jattn._gpu.mosaic_tangent import forward_tangent, tangent

__all__ = ["dkdv", "dq", "forward", "forward_tangent", "tangent"]
