"""The blockwise path: a call's plan and tiles, the sweeps over them, their derivatives, the fused CPU kernels.

``attention`` is the entry (:func:`blockwise_attention`), ``path`` the path :func:`jattn.attention` runs; ``plan`` a call's frozen plan, ``tiles``
the tiles a mask leaves and their size, ``tile_loops`` and ``tile_ops`` the loops and one tile;
``forward``, ``backward`` and ``tangent`` the sweeps of one group of rows, ``kernels`` one plan's
kernels group by group, ``rules`` the derivatives at every order;
``fused_cpu`` (with its C++ source ``fused_cpu.cc``, package data) and ``fused_rows`` the fused CPU
kernels (paged attention's among them: :func:`paged_forward`).

May import: ``_autodiff``, ``_checks``, ``_masks``, ``_arrays``, ``_online``, ``_dropout``, ``_softmax``,
``_platform``. The rest of jattn imports this subpackage through this face only: the names imported
below, and nothing else. Its files import each other directly, never through the face.
"""

from jattn._blockwise.attention import blockwise_attention
from jattn._blockwise.fused_cpu import BLOCK_KV as FUSED_BLOCK_KV
from jattn._blockwise.fused_cpu import SPLIT_KV, paged_forward
from jattn._blockwise.fused_cpu import available as fused_cpu_available
from jattn._blockwise.path import blockwise_path
from jattn._blockwise.tiles import choose_tiles
