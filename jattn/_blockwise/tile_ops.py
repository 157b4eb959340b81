"""One tile of a blockwise plan: its positions, mask, scores, bias, score modification, dropout and parts.

Tile (i, j) of a :class:`jattn._blockwise.plan.Plan` is query block i (``bq`` rows) against key block j
(``bk`` keys), both traced block indices; a group's ``b`` rows of B compute it at once, so its
scores are ``(b, bq, bk)``. :class:`Tile` reads what the plan says about one tile; a query block
is scaled once for all its tiles (:func:`prescale`), and a tile of a split kind is computed as
the parts :func:`parts` lists.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._blockwise.plan import Plan
from jattn._dropout import keep_mask, keep_scale
from jattn._masks import LOWER, STAIRS, TOP_EMPTY
from jattn._online import bind_mod, scaled_scores

__all__ = ["Tile", "parts", "prescale"]


class Tile(NamedTuple):
    """Tile (i, j) of ``plan``: query block ``i`` against key block ``j`` (traced block indices)."""

    plan: Plan
    i: Array
    j: Array

    def positions(self) -> tuple[Array, Array]:
        """Absolute positions ``(bq,)`` of query block i and ``(bk,)`` of key block j (int32, traced)."""
        plan = self.plan
        rows = plan.q_offset + self.i * plan.bq + jnp.arange(plan.bq, dtype=jnp.int32)
        return rows, plan.kv_offset + self.j * plan.bk + jnp.arange(plan.bk, dtype=jnp.int32)

    def allowed(self, arrays: tuple[Array, ...]) -> Array:
        """``(1|B, bq, bk)`` mask of query block i against key block j."""
        rows, cols = self.positions()
        keep = self.plan.predicate_with(arrays).allowed(rows[:, None], cols[None, :])
        keep = keep.reshape((1,) * (3 - keep.ndim) + keep.shape)  # a mask of keys alone is (1, 1, bk)
        return jnp.broadcast_to(keep, (keep.shape[0], self.plan.bq, self.plan.bk))  # whole, so LOWER tiles can cut it

    def scores(self, qb: Array, kb: Array, masked: bool, precision, arrays=(), scale=None) -> tuple:
        """Scaled scores ``(B, bq, bk)`` and, for a partial block, its mask ``(1|B, bq, bk)``.

        ``scale`` (default the plan's) is what :func:`prescale` left for the scores.
        """
        plan = self.plan
        s = scaled_scores(qb, kb, plan.scale if scale is None else scale, plan.compute, precision)
        return s, (self.allowed(arrays) if masked else None)

    def bias_window(self, bias: Array) -> tuple[tuple, tuple]:
        """Start and size of the tile in a bias ``(b|1, T|1, S|1)`` (a unit axis is read whole)."""
        bq, bk = self.plan.bq, self.plan.bk
        start = (0, self.i * bq if bias.shape[1] > 1 else 0, self.j * bk if bias.shape[2] > 1 else 0)
        start = tuple(jnp.asarray(x, jnp.int32) for x in start)  # one index type (i may be int64 under x64)
        size = (bias.shape[0], bq if bias.shape[1] > 1 else 1, bk if bias.shape[2] > 1 else 1)
        return start, size

    def biased(self, s: Array, bias: Array | None) -> Array:
        """Scores ``s (b, bq, bk)`` plus the bias's tile."""
        if bias is None:
            return s
        start, size = self.bias_window(bias)
        return s + jax.lax.dynamic_slice(bias, start, size).astype(self.plan.compute)

    def modifier(self, rows: Array):
        """``mod(s, consts)`` of the tile for the rows ``(B, 2)`` (:func:`jattn._online.bind_mod`), or None."""
        plan = self.plan
        return None if plan.mod is None else bind_mod(plan.mod, rows, *self.positions(), plan.compute)

    def dropped(self, seeds: Array) -> Array | None:
        """Dropout's factor ``(b, bq, bk)`` on the tile of the rows with ``seeds (b,)``, or None without dropout.

        The bits come from the tile's indices in the ``(T, S)`` grid, not its block numbers, so any
        tiling (and the dense path) gives the same ones (:mod:`jattn._dropout`).
        """
        plan = self.plan
        if not plan.dropout:
            return None
        t = self.i * plan.bq + jnp.arange(plan.bq, dtype=jnp.int32)
        s = self.j * plan.bk + jnp.arange(plan.bk, dtype=jnp.int32)
        keep = keep_mask(seeds[:, None, None], t[None, :, None], s[None, None, :], plan.dropout)
        return keep_scale(keep, plan.dropout, plan.compute)


def prescale(plan: Plan, q: Array) -> tuple[Array, float]:
    """A query block ``q (B, bq, D)`` with the logit scale folded in, and the scale left for the scores.

    Folding it into q saves a pass over every score tile, and keeps the scores one rounded dot
    product: a scale multiplied onto them can fuse with the max subtraction into one
    multiply-add (XLA on CPU), leaving the row maximum's exponent below 0 (see jattn._core).
    A 16-bit q is upcast first, so its scaled values are not rounded again.
    """
    return q.astype(plan.compute) * jnp.asarray(plan.scale, plan.compute), 1.0


def parts(kind: int, bq: int, bk: int) -> tuple[tuple[slice, slice | None], ...]:
    """A split tile's rows, in order, each with the keys it is computed against (None: not computed).

    LOWER: top rows x first keys, bottom rows x all keys; TOP_EMPTY: the empty quarters of rows
    x none, the rest x all keys; STAIRS: quarter r of the rows x the first r + 1 quarters of keys.
    """
    if kind == LOWER:
        return (slice(0, bq // 2), slice(0, bk // 2)), (slice(bq // 2, None), slice(None))
    if kind == STAIRS:
        q4, k4 = bq // 4, bk // 4
        return tuple((slice(r * q4, (r + 1) * q4), slice(0, (r + 1) * k4)) for r in range(4))
    top = (TOP_EMPTY.index(kind) + 1) * bq // 4
    return (slice(0, top), None), (slice(top, None), slice(None))
