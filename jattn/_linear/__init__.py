"""Linear attention and the gated / delta-rule family, with the modules' gates.

``linear`` holds :func:`jattn.linear_attention` and its state; ``gated``
:func:`jattn.gated_linear_attention`, ``gated_inputs`` its checked inputs, ``gated_forms`` its
chunkwise and recurrent forms, ``dplr_inputs`` and ``dplr_forms`` the same for its diagonal-plus-low-rank
(RWKV-7) transition, ``gated_parallel`` its sequence-parallel form, ``householder`` DeltaProduct's sub-steps;
``log_linear`` :func:`jattn.log_linear_attention` (Fenwick-level states over the scalar-gate kinds),
``log_linear_forms`` its chunkwise and recurrent forms, ``log_linear_parallel`` its sequence-parallel form;
``module_gates`` the modules' recurrent kinds and their gates.

May import: ``_checks``, ``_scalars``, ``_masks``, ``_online``. The rest of jattn imports this
subpackage through this face only: the names imported below, and nothing else. Its files import each
other directly, never through the face.
"""

from jattn._linear.gated import gated_linear_attention
from jattn._linear.linear import LinearState, feature_fn, linear_attention
from jattn._linear.log_linear import log_linear_attention
from jattn._linear.log_linear_forms import levels_needed
from jattn._linear.module_gates import (
    DELTAPRODUCT_KINDS,
    LOG_KINDS,
    LOG_LEVELS,
    RECURRENT_KINDS,
    gate_params,
    gates,
    head_inputs,
)
