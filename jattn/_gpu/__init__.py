"""jattn's own fused attention kernel for GPU, in Pallas (Triton lowering; interpret mode on CPU).

``attention`` is the entry (:func:`gpu_attention`: the call's refusals, its operands, the custom
VJP); ``kernels`` the forward, dq and dk/dv ``pallas_call`` bodies; ``tiles`` the grid of tiles,
their kinds computed outside the kernel and a partial tile's mask inside it; ``score_mod`` a
score modification read in the kernel.

May import: ``_checks``, ``_masks``, ``_online``. The rest of jattn imports this subpackage through
this face only: the names imported below, and nothing else. Its files import each other directly,
never through the face.
"""

from jattn._gpu.attention import MAX_DEPTH, gpu_attention, refuse
