"""The paths of :func:`jattn.attention` but the blockwise one, what each honours, and the choice between them.

``registry`` holds ``PATHS``, each path's one function; ``choice`` ``IMPLEMENTATIONS``, ``SUPPORT`` and
the choice of path, ``transforms`` the
``TRANSFORMS`` table and the kernels' refusals; ``dense`` the dense path (the reference of the
others), ``xla`` the hand-over to ``jax.nn.dot_product_attention``, ``pallas`` the platform's Pallas
kernel (jattn's own GPU kernel, :mod:`jattn._gpu`) and ``splash`` TPU's splash attention.

May import: ``_blockwise``, ``_checks``, ``_gpu``, ``_masks``, ``_arrays``, ``_dropout``, ``_softmax``, ``_platform``. The
rest of jattn imports this subpackage through this face only: the names imported below, and nothing
else. Its files import each other directly, never through the face.
"""

from jattn._paths.choice import (
    AUTO_BLOCKWISE_MIN,
    AUTO_ORDER,
    IMPLEMENTATIONS,
    SUPPORT,
    candidate_paths,
    check_implementation,
    features_used,
)
from jattn._paths.dense import dense_weights
from jattn._paths.registry import PATHS
from jattn._paths.transforms import TRANSFORMS, refusals
