"""The module kinds, one record each: what ``kind=`` computes, which options it takes, its cache and its decoding.

A :class:`ModuleKind` holds what :mod:`jattn.nnx` and :mod:`jattn.linen` do differently by kind: its attention over
the heads (:mod:`jattn._modules.multihead`), its empty decoding cache (:mod:`jattn._modules.cache`), one decoding
step from it (:mod:`jattn._modules.decoding`), whether it forms scores (the options that act on them and the
choice of path are the softmax kind's), whether cross-attention takes it, whether its kv heads must be its query
heads (a state a head), whether it reads a feature map, and for a recurrent kind its record
(:class:`jattn._linear.kinds.RecurrentKind`: gates, parameters, DeltaProduct's sub-steps). :func:`module_kind`
finds a name's record: ``'softmax'``, ``'linear'``, or one for each recurrent kind, including those registered
later (:func:`jattn.register_kind`). The options, the cache, the call and the heads read these records only: no
other file of the modules compares a kind's name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jattn._linear import RECURRENT, RecurrentKind
from jattn._modules import cache as _cache
from jattn._modules import decoding
from jattn._modules.multihead import linear_heads, recurrent_heads, softmax_heads

__all__ = ["ModuleKind", "kind_names", "module_kind"]


@dataclasses.dataclass(frozen=True)
class ModuleKind:
    """A module kind (module docstring); ``what`` is how its refusals name it."""

    name: str
    what: str
    heads: Callable  # (qh, kh, vh, Heads) -> (out, weights, state)
    cache: Callable  # (config, batch_size, max_length, window, pinned, dtype) -> the cache's arrays but "next"
    decode: Callable  # (q, k, v, cache, Step, attend) -> (out, weights, cache, bad)
    scores: bool = False
    cross: bool = False
    same_heads: bool = False
    feature_map: bool = False
    recurrent: RecurrentKind | None = None
    paged: bool = False  # serves from a paged pool (jattn.paged_attention, jattn._modules.paged)

    @property
    def householder(self) -> bool:
        """Whether it takes DeltaProduct's ``num_householder``."""
        return self.recurrent is not None and self.recurrent.householder


SOFTMAX = ModuleKind(
    "softmax",
    "jattn.attention",
    softmax_heads,
    _cache.softmax_cache,
    decoding.softmax_step,
    scores=True,
    cross=True,
    paged=True,
)
LINEAR = ModuleKind(
    "linear",
    "linear_attention",
    linear_heads,
    _cache.linear_cache,
    decoding.linear_step,
    cross=True,
    feature_map=True,
)


@functools.cache
def _recurrent_module(kind: RecurrentKind) -> ModuleKind:
    return ModuleKind(
        kind.name,
        "gated_linear_attention: a state per head, no scores",
        recurrent_heads,
        _cache.state_cache,
        decoding.state_step,
        same_heads=True,
        recurrent=kind,
    )


def kind_names() -> tuple[str, ...]:
    """Every module kind's name: ``'softmax'``, ``'linear'``, then the recurrent kinds (registered ones included)."""
    return (SOFTMAX.name, LINEAR.name, *RECURRENT)


def module_kind(name: str) -> ModuleKind:
    """The record of the kind ``name`` (a ValueError naming the kinds where there is none)."""
    if not isinstance(name, str) or name not in kind_names():
        raise ValueError(f"kind must be one of {kind_names()}, got {name!r}")
    if name == SOFTMAX.name:
        return SOFTMAX
    if name == LINEAR.name:
        return LINEAR
    return _recurrent_module(RECURRENT[name])
