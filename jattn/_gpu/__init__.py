"""jattn's own fused attention kernel for GPU, in Pallas (Triton or Mosaic GPU lowering; interpret mode on CPU).

``attention`` is the entry (:func:`gpu_attention`: the call's refusals, its operands); ``rules``
the derivatives at every order (a custom JVP whose tangent is a linear pair); ``kernels`` the
forward, tangent, dq and dk/dv ``pallas_call`` bodies; ``tiles`` the grid of tiles,
their kinds computed outside the kernel and a partial tile's mask inside it; ``score_mod`` a
score modification read in the kernel; ``tuning`` the Triton kernel's tiles, launches and float32 dots per chip
(compute capability), head depth and dtype; ``deprecation`` JAX's deprecation of Pallas' Triton backend, answered.
``gpu_attention(..., backend=...)`` picks the kernels:
``"triton"`` (the default) those of ``kernels``; ``"mosaic_gpu"`` (Hopper: TMA and ``wgmma``) and
``"mosaic_gpu_tcgen05"`` (Blackwell: ``tcgen05`` into tensor memory) those of ``mosaic_kernels`` (Pallas' Mosaic
GPU backend: ``mosaic_forward``, ``mosaic_backward``, ``mosaic_tangent``, ``mosaic_tile``, ``mosaic_mod``,
``mosaic_support``) on the same operands; :func:`backend_for` names the one for a compute capability;
``mosaic_launch`` launches a Mosaic GPU kernel, compiled or interpreted one at a time, ``mosaic_swizzled`` and
``mosaic_load`` its shared tiles and their loads (the paged kernel's too).

May import: ``_autodiff``, ``_checks``, ``_dropout``, ``_masks``, ``_arrays``, ``_platform``. The rest of jattn imports this subpackage
through this face only: the names imported below, and nothing else. Its files import each other directly,
never through the face.
"""

from jattn._gpu.attention import MAX_DEPTH, gpu_attention, refuse
from jattn._gpu.deprecation import answer_triton_deprecation
from jattn._gpu.mosaic_support import backend_for
from jattn._gpu.mosaic_support import launch as mosaic_launch
from jattn._gpu.mosaic_support import load as mosaic_load
from jattn._gpu.mosaic_support import swizzled as mosaic_swizzled
