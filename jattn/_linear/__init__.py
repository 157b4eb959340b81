"""Linear attention and the gated / delta-rule family, by algorithm, with the modules' kinds.

``linear`` holds :func:`jattn.linear_attention` and its state. :func:`jattn.gated_linear_attention` is ``gated``
(validates, then dispatches); ``steps`` its checked inputs, ``forms`` how a family's chunkwise or recurrent form
runs, ``chunking`` what the chunkwise forms share, ``sequence_parallel`` its sequence-parallel form; the families,
each with its ``chunk`` and ``recurrent`` forms: ``gated_delta_rule/`` (decays per step or key feature and the
delta rule: retention, SSD, GLA, DeltaNet, Gated DeltaNet), ``kda/`` (Kimi Delta Attention's chunk and pair sums),
``dplr/`` (the diagonal-plus-low-rank transition: RWKV-7), ``deltaproduct`` (DeltaProduct's Householder
sub-steps); ``log_linear/`` :func:`jattn.log_linear_attention` (Fenwick-level states over SSD and Gated
DeltaNet). ``kinds`` the modules' recurrent kinds and their gates.

May import: ``_arrays``, ``_checks``, ``_scalars``, ``_masks``. The rest of jattn imports this subpackage through
this face only: the names imported below, and nothing else. Its files import each other directly, never through
the face.
"""

from jattn._linear.gated import gated_linear_attention
from jattn._linear.kinds import RECURRENT, RECURRENT_KINDS, Gate, RecurrentKind, register_kind
from jattn._linear.linear import LinearState, feature_fn, linear_attention
from jattn._linear.log_linear.attention import log_linear_attention
from jattn._linear.log_linear.levels import levels_needed
