"""Per-example masks for the fused CPU kernels: each query row's key bounds and document ids, computed on device.

A mask the fused kernels serve is a key interval (:func:`jattn._masks.positions.key_interval`: none,
causal, sliding windows) ``&`` at most one :func:`jattn.masks.padding` and at most one
:func:`jattn.masks.segment_ids`, as rows of the call's leading dimensions flattened to ``B``
(:func:`jattn._masks.as_rows` of :class:`jattn._checks.Operands`' leading shape; their arrays ``(B|1, ...)``, :func:`jattn._masks.skeleton.split_arrays`).
The kernels take, besides the static interval, ``lo (R, T)`` and ``hi (R, T)`` int32 (R = B or 1):
query row t sees only keys ``lo <= s < hi``; with segment ids also ``q_ids (R, T)`` and ``kv_ids (R, S)``,
and a key inside the bounds counts only where its id is the row's. The bounds of a row with segment
ids are its document's first and last key (every key of it, wherever the ids repeat), so documents
need not be contiguous; where they are, the bounds are exactly each document's keys and the kernels
visit only its tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._masks import Mask, RowPadding, RowSegments, conjuncts, is_slot, key_interval

__all__ = ["fused_window", "row_bounds"]


def fused_window(skeleton: Mask | None) -> tuple[int, int] | None:
    """The static key interval ``(left, right)`` of a mask the fused kernels serve (see the module docstring), else None."""
    if skeleton is None:
        return key_interval(None)
    positions, kinds = [], []
    for term in conjuncts(skeleton):
        if is_slot(term):
            kinds.append(term.kind)
        else:
            positions.append(term)
    if any(kind not in (RowPadding, RowSegments) for kind in kinds) or len(set(kinds)) != len(kinds):
        return None
    window = [key_interval(None), *(key_interval(m) for m in positions)]
    if any(w is None for w in window):
        return None
    return min(w[0] for w in window), min(w[1] for w in window)


def row_bounds(skeleton: Mask | None, arrays: tuple[Array, ...], T: int, S: int) -> tuple[Array, ...] | None:
    """``(lo (R, T), hi (R, T), q_ids (R', T), kv_ids (R'', S))`` int32 of a :func:`fused_window` mask, or None.

    None where the mask has no per-example part (the kernels then read no row operands). ``T``
    (at least the mask's own length) is the kernels' query length: rows past the mask's get no
    keys there. ``q_ids`` and ``kv_ids`` are None without segment ids; with them, int32 keys of the
    documents (equal where the ids are), whatever the ids' integer type.
    """
    slots = [] if skeleton is None else [t for t in conjuncts(skeleton) if is_slot(t)]
    if not slots:
        return None
    lo, hi = jnp.zeros((1, T), jnp.int32), jnp.full((1, T), S, jnp.int32)
    q_ids = kv_ids = None
    for slot in slots:
        leaf = arrays[slot.index : slot.index + len(slot.shapes)]
        if slot.kind is RowPadding:
            q_len, kv_len = (jnp.asarray(x, jnp.int32)[:, None] for x in leaf)
            hi = jnp.minimum(hi, jnp.where(jnp.arange(T)[None] < q_len, jnp.minimum(kv_len, S), 0))
        else:
            first, end, q_ids, kv_ids = _document_keys(*(jnp.asarray(x) for x in leaf))
            lo, hi, q_ids = jnp.maximum(lo, _rows_of(first, T)), jnp.minimum(hi, _rows_of(end, T)), _rows_of(q_ids, T)
    rows = max(lo.shape[0], hi.shape[0])
    lo, hi = (jnp.broadcast_to(x, (rows, T)) for x in (lo, hi))
    return lo, jnp.maximum(hi, lo), q_ids, kv_ids


def _rows_of(x: Array, T: int) -> Array:
    """``x (R, T')`` as ``(R, T)``: cut, or padded with zeros at the end."""
    return x[:, :T] if x.shape[1] >= T else jnp.pad(x, ((0, 0), (0, T - x.shape[1])))


def _document_keys(q_ids: Array, kv_ids: Array) -> tuple[Array, Array, Array, Array]:
    """Each query's document's first key and one past its last, and int32 document keys of queries and keys.

    Bounds ``(R, T)`` (``(0, 0)`` where a query has no key); keys ``(R, T)`` and ``(R, S)``, equal where
    the ids are. Self-attention over documents in order (the ids the same for queries and keys, and sorted): the run of
    equal ids around the query's own position (2 ms for 32 rows of 8192 on 2 cores); else by a stable sort of
    each row's key ids (:func:`_by_sorting`, 40 ms there).
    """
    rows = max(q_ids.shape[0], kv_ids.shape[0])
    q_ids = jnp.broadcast_to(q_ids, (rows, q_ids.shape[1]))
    kv_ids = jnp.broadcast_to(kv_ids, (rows, kv_ids.shape[1]))
    if q_ids.shape != kv_ids.shape:
        return _by_sorting(q_ids, kv_ids)
    in_order = jnp.all(kv_ids[:, 1:] >= kv_ids[:, :-1]) & jnp.all(q_ids == kv_ids)
    return jax.lax.cond(in_order, _runs, _by_sorting, q_ids, kv_ids)


def _runs(q_ids: Array, kv_ids: Array) -> tuple[Array, Array, Array, Array]:
    """Where ``q_ids == kv_ids`` and each id is one run: the run around each position, ``[start, end)``.

    The run's start is its document key.
    """
    S = kv_ids.shape[1]
    at = jnp.arange(S, dtype=jnp.int32)[None]
    new = jnp.concatenate([jnp.ones_like(kv_ids[:, :1], bool), kv_ids[:, 1:] != kv_ids[:, :-1]], axis=1)
    last = jnp.concatenate([kv_ids[:, 1:] != kv_ids[:, :-1], jnp.ones_like(kv_ids[:, :1], bool)], axis=1)
    start = jax.lax.cummax(jnp.where(new, at, 0), axis=1)
    end = jax.lax.cummin(jnp.where(last, at + 1, S), axis=1, reverse=True)
    start = start.astype(jnp.int32)
    return start, end.astype(jnp.int32), start, start


def _by_sorting(q_ids: Array, kv_ids: Array) -> tuple[Array, Array, Array, Array]:
    """Any ids, by a stable sort of each row's key ids.

    A query's id spans ``[left, right)`` of the sorted row, whose first and last entries hold the
    smallest and largest key index with that id; an id's document key is ``left``, its first place in
    the sorted row (a query whose id no key has gets no keys, whatever its document key).
    """
    order = jnp.argsort(kv_ids, axis=-1, stable=True).astype(jnp.int32)
    ids = jnp.take_along_axis(kv_ids, order, axis=-1)
    left = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(ids, q_ids).astype(jnp.int32)
    right = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right"))(ids, q_ids).astype(jnp.int32)
    last = kv_ids.shape[1] - 1
    first = jnp.take_along_axis(order, jnp.clip(left, 0, last), axis=-1)
    end = jnp.take_along_axis(order, jnp.clip(right - 1, 0, last), axis=-1) + 1
    found = right > left
    keys = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(ids, kv_ids).astype(jnp.int32)
    return jnp.where(found, first, 0), jnp.where(found, end, 0), left, keys
