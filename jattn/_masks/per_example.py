"""Per-example masks (batch first): padding and segment ids, their row forms, per-example arrays on a call's lead.

The linear family (:func:`jattn.gated_linear_attention`'s ``segment_ids`` and ``kv_mask``,
:func:`jattn.linear_attention`'s ``kv_mask``) reads its per-step arrays by the same convention
(:func:`per_example_steps`).

:class:`Padding` and :class:`SegmentIds` read arrays of B examples (their constructors, with the
argument checks, are in :mod:`jattn._masks.constructors`). A blockwise kernel reads them in row form, one
row per row of B·N (:meth:`jattn.masks.Mask._rows`): :class:`RowPadding` and
:class:`RowSegments`, whose tiles are classified on device. :func:`on_batch_axis` places a
per-example array on the call's leading shape.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._masks.base import Leaf, Mask, leaf_dataclass, per_tile

__all__ = ["Padding", "PerExample", "RowPadding", "RowSegments", "SegmentIds", "on_batch_axis", "per_example_steps"]

_NO_LIMIT = np.iinfo(np.int32).max  # a length that masks nothing


def on_batch_axis(x: ArrayLike, lead: tuple[int, ...], axis: int) -> Array:
    """A per-example array ``(B|1, ...)`` broadcast to ``(*lead, ...)``, its batch on ``lead[axis]``.

    ``axis`` is where q's first axis lands in the call's leading shape (:func:`jattn._checks.call_lead`).
    """
    x = jnp.asarray(x)
    rest = x.shape[1:]
    x = x.reshape((1,) * axis + (x.shape[0],) + (1,) * (len(lead) - axis - 1) + rest)
    return jnp.broadcast_to(x, (*lead, *rest))


def per_example_steps(name: str, x: Array, lead: tuple[int, ...]) -> Array:
    """A per-step array ``x (..., L)`` of a call whose q, k, v broadcast to the leading shape ``lead``, read as masks read.

    ``(L,)``: every sequence alike. ``(B, L)``: per example, batch first (on ``lead[0]``) and shared by the other
    leading axes (the heads), as :func:`jattn.masks.segment_ids` reads ``(B, T)``: returned as ``(B, 1, ..., 1, L)``.
    One axis per axis of ``lead`` (or more): per leading index, as it is (``(B, N, L)``: per batch and head). Between
    those (``(B, K, L)`` with ``lead`` ``(B, K, G)``), which axes it spans could be read two ways: a ValueError that
    says how to write it.
    """
    axes, rank = x.ndim - 1, len(lead)
    if axes == 1:
        return x.reshape(x.shape[0], *(1,) * max(rank - 1, 0), x.shape[-1])
    if axes == 0 or axes >= rank:
        return x
    first = (*x.shape[:-1], *(1,) * (rank - axes), x.shape[-1])
    raise ValueError(
        f"{name} {x.shape} has {axes} leading axes and q, k, v {rank} {lead}: which of them it spans is ambiguous. "
        f"Give it one axis per leading axis (1 where it is shared), e.g. {first} if it spans the first ones "
        f"({name}{'[' + ', '.join([':'] * axes + ['None'] * (rank - axes)) + ', :]'}), or (B, {x.shape[-1]}) per "
        f"example (batch first, shared by the heads)"
    )


def _row_form(x: Array, lead: tuple[int, ...], axis: int) -> Array:
    """A per-example array ``(B|1, ...)`` as rows ``(R|1, ...)`` of ``lead`` flattened, its batch on ``lead[axis]``."""
    if x.shape[0] == 1:
        return x
    return on_batch_axis(x, lead, axis).reshape(math.prod(lead), *x.shape[1:])


@dataclasses.dataclass(frozen=True, eq=False)
class PerExample(Mask):
    """Base of masks that read per-example arrays (batch first)."""

    per_example = True

    @property
    def batch(self) -> int:
        """The batch B of its arrays (1 where they broadcast)."""
        parts = (getattr(self, f.name) for f in dataclasses.fields(self))
        return max(jnp.shape(x)[0] for x in parts if x is not None)


@dataclasses.dataclass(frozen=True, eq=False)
class Padding(PerExample):
    """Per example ``b``: query ``t < q_lengths[b]`` and key ``s < kv_lengths[b]`` (relative to offsets)."""

    q_lengths: Array | None
    kv_lengths: Array | None

    def allowed(self, i, j):
        # i: (B|1, 1, T, 1) positions; lengths are counted from the first query/key position.
        ok = jnp.ones((), bool)
        if self.q_lengths is not None:
            t = i - i[..., :1, :]
            ok = ok & (t < jnp.asarray(self.q_lengths, jnp.int32).reshape(-1, 1, 1, 1))
        if self.kv_lengths is not None:
            s = j - j[..., :, :1]
            ok = ok & (s < jnp.asarray(self.kv_lengths, jnp.int32).reshape(-1, 1, 1, 1))
        return ok

    def _rows(self, lead, axis=0):
        def rows(x):
            return (
                jnp.full((1,), _NO_LIMIT, jnp.int32) if x is None else _row_form(jnp.asarray(x, jnp.int32), lead, axis)
            )

        return RowPadding(rows(self.q_lengths), rows(self.kv_lengths))


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentIds(PerExample):
    """Packed sequences: query ``t`` sees key ``s`` when ``q_segments[b, t] == kv_segments[b, s]``."""

    q_segments: Array
    kv_segments: Array

    def allowed(self, i, j):
        q = jnp.asarray(self.q_segments)
        kv = jnp.asarray(self.kv_segments)
        return q.reshape(q.shape[0], 1, -1, 1) == kv.reshape(kv.shape[0], 1, 1, -1)

    def _rows(self, lead, axis=0):
        q, kv = jnp.asarray(self.q_segments), jnp.asarray(self.kv_segments)
        ids = np.promote_types(q.dtype, kv.dtype)  # one integer type (strict promotion compares no mixed ones)
        return RowSegments(_row_form(q.astype(ids), lead, axis), _row_form(kv.astype(ids), lead, axis))

    def _check_lengths(self, T, S):
        q, kv = jnp.shape(self.q_segments), jnp.shape(self.kv_segments)
        if q[-1] != T or kv[-1] != S:
            raise ValueError(
                f"segment_ids q_segments {q} and kv_segments {kv} must have shapes (B, T={T}) and (B, S={S})"
            )


@leaf_dataclass
class RowPadding(Leaf):
    """:func:`jattn.masks.padding` as rows: ``q_lengths``, ``kv_lengths`` ``(R|1,)`` int32, one per row of B·N."""

    q_lengths: Array
    kv_lengths: Array

    def allowed(self, i, j):  # i (bq, 1), j (1, bk) -> (R|1, bq, bk)
        t, s = self._grid(i, j)
        return (t[None] < self.q_lengths[:, None, None]) & (s[None] < self.kv_lengths[:, None, None])

    def _tiles(self, i0, i1, j0, j1, tiling):
        T, S, bq, bk = tiling
        t0 = np.arange(0, T, bq, dtype=np.int32)[None, :, None]  # int32 like the lengths (x64 would make int64)
        s0 = np.arange(0, S, bk, dtype=np.int32)[None, None, :]
        t1, s1 = np.minimum(t0 + bq, T) - 1, np.minimum(s0 + bk, S) - 1
        ql, kl = self.q_lengths[:, None, None], self.kv_lengths[:, None, None]
        return (t0 >= ql) | (s0 >= kl), (t1 < ql) & (s1 < kl)


@leaf_dataclass
class RowSegments(Leaf):
    """:func:`jattn.masks.segment_ids` as rows: ``q (R|1, T)``, ``kv (R|1, S)`` int32, one row of ids per row of B·N."""

    q: Array
    kv: Array

    def allowed(self, i, j):  # i (bq, 1), j (1, bk) -> (R|1, bq, bk); grid padding reads the last id
        t, s = self._grid(i, j)
        qs = jnp.take(self.q, jnp.clip(t[:, 0], 0, self.q.shape[-1] - 1), axis=-1)
        ks = jnp.take(self.kv, jnp.clip(s[0], 0, self.kv.shape[-1] - 1), axis=-1)
        return qs[:, :, None] == ks[:, None, :]

    def _tiles(self, i0, i1, j0, j1, tiling):
        """Per tile: empty where the ids' ranges ``[min, max]`` of its queries and keys are disjoint, full where both hold one id."""
        T, S, bq, bk = tiling
        q_lo, q_hi = (per_tile(self.q, 1, -(-T // bq), bq, "edge", f)[:, :, None] for f in (jnp.min, jnp.max))
        k_lo, k_hi = (per_tile(self.kv, 1, -(-S // bk), bk, "edge", f)[:, None, :] for f in (jnp.min, jnp.max))
        return (q_hi < k_lo) | (q_lo > k_hi), (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
