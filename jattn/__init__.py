"""jattn: attention for JAX and Flax, one pure core and thin modules over it.

The dimension key (B, T, S, N, K, G, D, E) is stated in :mod:`jattn._core`. Flax modules live in
:mod:`jattn.nnx` and :mod:`jattn.linen`; mask predicates in :mod:`jattn.masks`; score modifications
(``score_mod``) in :mod:`jattn.score_mods`; sequence-parallel
ring attention (``ring_attention`` inside ``jax.shard_map``, ``sequence_parallel_attention``
outside it) in :mod:`jattn._ring.attention`. :func:`dot_product_attention` takes ``jax.nn``'s signature and
layout (top-left causal alignment); :mod:`jattn.flax` has an ``attention_fn`` for Flax's modules.

``jattn.nnx``, ``jattn.linen`` and ``jattn.flax`` are imported on first access (PEP 562), so
``import jattn`` does not import Flax; they are left out of ``__all__`` for the same reason (a
``from jattn import *`` would import them). The linear family (``linear_attention``,
``gated_linear_attention``, ``log_linear_attention``, ``LinearState``, ``RECURRENT_KINDS``, and a module kind's record:
``RecurrentKind``, ``Gate``, ``register_kind``) and ring attention are in
``__all__`` but load their subpackages on first access too, so a softmax-only program never
imports them.
"""

import importlib
from typing import TYPE_CHECKING, Any

from jattn import _xla_flags

_xla_flags.apply()  # before anything could start JAX's backend: XLA reads XLA_FLAGS once, then

from jattn import masks, score_mods
from jattn._core import CHECKPOINT_NAMES, attention, attention_weights, choose_implementation
from jattn._dot_product_attention import dot_product_attention
from jattn._paged import PAGED_IMPLEMENTATIONS, SPLIT_KV, TILE_KV, paged_attention
from jattn._paths import AUTO_BLOCKWISE_MIN, AUTO_ORDER, IMPLEMENTATIONS, SUPPORT, TRANSFORMS
from jattn._rope import rope
from jattn._softmax import SoftmaxParts, softmax, softmax_parts

__all__ = [
    "AUTO_BLOCKWISE_MIN",
    "AUTO_ORDER",
    "CHECKPOINT_NAMES",
    "IMPLEMENTATIONS",
    "PAGED_IMPLEMENTATIONS",
    "RECURRENT_KINDS",
    "SPLIT_KV",
    "SUPPORT",
    "TILE_KV",
    "TRANSFORMS",
    "Gate",
    "LinearState",
    "RecurrentKind",
    "SoftmaxParts",
    "attention",
    "attention_weights",
    "choose_implementation",
    "dot_product_attention",
    "gated_linear_attention",
    "linear_attention",
    "log_linear_attention",
    "masks",
    "paged_attention",
    "register_kind",
    "ring_attention",
    "rope",
    "score_mods",
    "sequence_parallel_attention",
    "softmax",
    "softmax_parts",
    "unzigzag",
    "zigzag",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # the lazy names, for type checkers (explicit re-exports)
    from jattn import flax as flax
    from jattn import linen as linen
    from jattn import nnx as nnx
    from jattn._linear import RECURRENT_KINDS as RECURRENT_KINDS
    from jattn._linear import Gate as Gate
    from jattn._linear import LinearState as LinearState
    from jattn._linear import RecurrentKind as RecurrentKind
    from jattn._linear import gated_linear_attention as gated_linear_attention
    from jattn._linear import linear_attention as linear_attention
    from jattn._linear import log_linear_attention as log_linear_attention
    from jattn._linear import register_kind as register_kind
    from jattn._ring import ring_attention as ring_attention
    from jattn._ring import sequence_parallel_attention as sequence_parallel_attention
    from jattn._ring import unzigzag as unzigzag
    from jattn._ring import zigzag as zigzag

_LAZY_SUBMODULES = ("flax", "linen", "nnx")  # they import Flax
#: Names whose subpackage loads on first access: the linear family and ring attention (13 modules
#: that a softmax-only user never runs; ``import jattn`` loads 47 of its modules, not 58).
_LAZY_NAMES = {
    **dict.fromkeys(
        (
            *("RECURRENT_KINDS", "LinearState", "gated_linear_attention", "linear_attention", "log_linear_attention"),
            *("Gate", "RecurrentKind", "register_kind"),
        ),
        "_linear",
    ),
    **dict.fromkeys(("ring_attention", "sequence_parallel_attention", "unzigzag", "zigzag"), "_ring"),
}


def __getattr__(name: str) -> Any:
    """Imports ``jattn.nnx``, ``jattn.linen``, ``jattn.flax`` and the subpackages of :data:`_LAZY_NAMES` on first access."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import also binds it here
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazy ones."""
    return sorted({*globals(), *_LAZY_SUBMODULES, *_LAZY_NAMES})
