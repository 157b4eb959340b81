"""Masks of positions alone: causal, sliding window, global tokens, chunks, a key bound; and the band they describe.

Each classifies blocks of positions exactly (:meth:`jattn.masks.Mask.block_kinds`): no array is
read, so every call, traced or not, skips their empty tiles. Their constructors are in
:mod:`jattn._masks.constructors`. :func:`key_interval` reads the one interval of keys per query row that
causal, sliding windows and their ``&`` describe (what the fused CPU forward serves).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jattn._masks.base import And, Mask

__all__ = ["UNBOUNDED", "Causal", "Chunked", "GlobalTokens", "KeyBelow", "SlidingWindow", "key_interval"]


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """``j <= i``: each query sees itself and the past."""

    def allowed(self, i, j):
        return j <= i

    def _blocks(self, i0, i1, j0, j1):
        return j0 > i1, j1 <= i0


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """``i - left <= j <= i + right``: a band around the diagonal."""

    left: int
    right: int

    def allowed(self, i, j):
        return (j >= i - self.left) & (j <= i + self.right)

    def _blocks(self, i0, i1, j0, j1):
        empty = (j1 < i0 - self.left) | (j0 > i1 + self.right)
        full = (j0 >= i1 - self.left) & (j1 <= i0 + self.right)
        return empty, full


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """Tokens at the given positions see all keys and are seen by all queries."""

    indices: tuple[int, ...]

    def _member(self, x):
        hit = jnp.zeros(x.shape, bool)
        for g in self.indices:
            hit = hit | (x == g)
        return hit

    def allowed(self, i, j):
        return self._member(i) | self._member(j)

    def _blocks(self, i0, i1, j0, j1):
        g = np.asarray(self.indices)

        def count(lo, hi):  # how many global positions fall in [lo, hi]
            return ((g >= lo[..., None]) & (g <= hi[..., None])).sum(-1)

        nq, nk = count(i0, i1), count(j0, j1)
        full = (nq == i1 - i0 + 1) | (nk == j1 - j0 + 1)
        return (nq == 0) & (nk == 0), full


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
    """``i // size == j // size``: attention within fixed chunks of positions."""

    size: int

    def allowed(self, i, j):
        return (i // self.size) == (j // self.size)

    def _blocks(self, i0, i1, j0, j1):
        c = self.size
        empty = (j1 // c < i0 // c) | (j0 // c > i1 // c)
        full = (i0 // c == i1 // c) & (j0 // c == j1 // c) & (i0 // c == j0 // c)
        return empty, full


@dataclasses.dataclass(frozen=True)
class KeyBelow(Mask):
    """``j < n``."""

    n: int

    def allowed(self, i, j):
        return j < self.n

    def _blocks(self, i0, i1, j0, j1):
        shape = np.broadcast_shapes(np.shape(i0), np.shape(j0))
        return np.broadcast_to(j0 >= self.n, shape), np.broadcast_to(j1 < self.n, shape)


#: A side of :func:`key_interval` without a bound.
UNBOUNDED = 2**62


def key_interval(mask: Mask | None) -> tuple[int, int] | None:
    """``(left, right)`` when ``mask`` lets query i see exactly the keys ``i - left <= j <= i + right``, else None.

    No mask, :class:`Causal`, :class:`SlidingWindow` and their ``&``; an unbounded side is
    :data:`UNBOUNDED` (the fused CPU forward's masks, :mod:`jattn._blockwise.fused_cpu`).
    """
    if mask is None:
        return UNBOUNDED, UNBOUNDED
    if type(mask) is Causal:
        return UNBOUNDED, 0
    if type(mask) is SlidingWindow:
        return min(mask.left, UNBOUNDED), min(mask.right, UNBOUNDED)
    if type(mask) is And:
        a, b = key_interval(mask.a), key_interval(mask.b)
        if a is not None and b is not None:
            return min(a[0], b[0]), min(a[1], b[1])
    return None
