"""Masks as composable predicates of (query position, key position).

A :class:`Mask` answers "may the query at absolute position ``i`` attend to the key at absolute
position ``j``?". Queries ``t = 0..T-1`` sit at positions ``q_offset + t`` and keys
``s = 0..S-1`` at ``kv_offset + s``. By default ``kv_offset = 0`` and ``q_offset = S - T``:
queries are aligned **bottom-right**, at the end of the keys, which is where the newest tokens
of a KV cache sit; for ``T == S`` this is the usual alignment. Offsets may be per example
(shape ``(B,)``), as in a ragged batch.

Masks combine with ``&``, ``|`` and ``~``. Each can

* materialise the dense boolean mask (:meth:`Mask.dense`), ``(T, S)`` or, for a mask that
  depends on the example (``padding``, ``segment_ids``, per-example offsets), ``(B, 1, T, S)``
  with the batch on the first axis; and
* classify the blocks of a tiling of ``(T, S)`` as empty, partial or full
  (:meth:`Mask.block_kinds`), statically from the positions alone where the predicate allows
  (example-dependent masks are reported partial here, and classified on device by
  :func:`tile_kinds`, per example), so that a blockwise kernel can skip empty blocks and drop
  the mask on full ones.

An explicit boolean array is a mask too (:func:`array`, or implicitly when combined with a
predicate by ``&``/``|``): it indexes the ``(t, s)`` grid of one call, broadcasts like NumPy
(a 1-D ``(S,)`` array masks keys), and its blocks are classified at run time
(:func:`tile_kinds`), so a blockwise kernel still skips its all-False tiles.

Example: Longformer's global + sliding window is ``sliding_window(w, w) | global_tokens([0])``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._checks import broadcast_all, check_int, int_array, is_traced

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "ArrayMask",
    "Mask",
    "array",
    "causal",
    "chunked",
    "global_tokens",
    "padding",
    "predicate",
    "prefix_lm",
    "segment_ids",
    "sliding_window",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


def query_offset(q_offset: ArrayLike | None, kv_offset: ArrayLike, T: int, S: int) -> ArrayLike:
    """The first query's absolute position: ``q_offset``, or by default ``kv_offset + S - T``.

    The default aligns the queries bottom-right, at the end of the keys (a KV cache's last
    tokens). Ints give an int (static), arrays an array.
    """
    return kv_offset + (S - T) if q_offset is None else q_offset


class Mask:
    """A predicate ``allowed(i, j)`` of query position ``i`` and key position ``j``."""

    per_example = False  # True when the predicate reads per-example arrays (batch first)
    has_arrays = False  # True when an explicit boolean array (ArrayMask) is part of the mask
    per_row = False  # True when a predicate of (batch, head, ...) (:func:`predicate`) is part of the mask

    def allowed(self, i: Array, j: Array) -> Array:
        """Boolean, broadcasting ``i`` ``(..., T, 1)`` against ``j`` ``(..., 1, S)``."""
        raise NotImplementedError

    def _blocks(self, i0, i1, j0, j1) -> tuple[np.ndarray, np.ndarray]:
        """``(empty, full)`` for blocks of positions ``[i0, i1] x [j0, j1]`` (NumPy, inclusive).

        Sound: ``empty`` only where no pair is allowed, ``full`` only where every pair is.
        The default knows nothing: every block is partial.
        """
        shape = np.broadcast_shapes(np.shape(i0), np.shape(j0))
        return np.zeros(shape, bool), np.zeros(shape, bool)

    def __and__(self, other: Mask | ArrayLike) -> Mask:
        return _And(self, as_mask(other))

    def __rand__(self, other: ArrayLike) -> Mask:
        return _And(as_mask(other), self)

    def __or__(self, other: Mask | ArrayLike) -> Mask:
        return _Or(self, as_mask(other))

    def __ror__(self, other: ArrayLike) -> Mask:
        return _Or(as_mask(other), self)

    def __invert__(self) -> Mask:
        return _Not(self)

    __array_ufunc__ = None  # ``ndarray & mask`` defers to Mask.__rand__

    def _bind(self, q0: ArrayLike, k0: ArrayLike) -> Mask:
        """The mask with its array leaves told the positions of grid row 0 and column 0."""
        return self

    def _rows(self, lead: tuple[int, ...], axis: int = 0) -> Mask:
        """The mask with its array leaves as rows ``(R|1, ...)`` of the leading shape ``lead`` flattened.

        Per-example leaves (``padding``, ``segment_ids``) become their row forms (one row of B·N
        per batch and head; their batch is axis ``axis`` of ``lead``: q's first axis), array masks
        are flattened: what a blockwise kernel reads per row.
        """
        return self

    def _tiles(self, i0, i1, j0, j1, tiling) -> tuple[Array, Array]:
        """Traced ``(empty, full)`` of each tile, ``(R|1, nq, nk)``; array leaves are read at run time.

        ``R`` is the rows of the leaves' leading axis (see :meth:`_rows`); a predicate of positions
        alone has ``R = 1``. See :func:`tile_kinds`.
        """
        empty, full = self._blocks(i0, i1, j0, j1)
        shape = (1, *np.broadcast_shapes(np.shape(i0), np.shape(j0)))
        return jnp.broadcast_to(jnp.asarray(empty), shape), jnp.broadcast_to(jnp.asarray(full), shape)

    def dense(self, T: int, S: int, *, q_offset: ArrayLike | None = None, kv_offset: ArrayLike = 0) -> Array:
        """The boolean mask ``(T, S)``; ``(B, 1, T, S)`` per example; ``(..., T, S)`` with arrays.

        ``(T, S)``, ``(B, 1, T, S)`` when it depends on the example, or ``(..., T, S)`` with the
        leading dimensions of its arrays. ``T`` and ``S`` are non-negative ints; offsets are scalars or per example ``(B,)``.
        """
        T, S = check_int("T", T, min=0), check_int("S", S, min=0)
        check_lengths(self, T, S)
        i, j = _positions(T, S, q_offset, kv_offset, self.per_example)
        m = self._bind(i[..., :1, :], j[..., :, :1]).allowed(i, j)
        return jnp.broadcast_to(m, _broadcast_ranked(m.shape, i.shape, j.shape))

    def block_kinds(
        self, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int | None = None, kv_offset: int = 0
    ) -> np.ndarray:
        """``(ceil(T/block_q), ceil(S/block_kv))`` int8 of EMPTY / PARTIAL / FULL (static offsets).

        ``T``, ``S`` are non-negative ints and ``block_q``, ``block_kv`` positive ints.
        """
        T, S = check_int("T", T, min=0), check_int("S", S, min=0)
        block_q, block_kv = check_int("block_q", block_q, min=1), check_int("block_kv", block_kv, min=1)
        q_offset = query_offset(q_offset, kv_offset, T, S)
        i0 = q_offset + np.arange(0, T, block_q)[:, None]
        i1 = np.minimum(i0 + block_q, q_offset + T) - 1
        j0 = kv_offset + np.arange(0, S, block_kv)[None, :]
        j1 = np.minimum(j0 + block_kv, kv_offset + S) - 1
        return box_kinds(self, i0, i1, j0, j1)

    def render(self, T: int, S: int | None = None, **offsets) -> str:
        """Rows of ``#`` (attend) and ``.`` (masked), one per query; first example if per-example."""
        S = T if S is None else S
        m = np.asarray(self.dense(T, S, **offsets)).reshape(-1, T, S)[0]
        return "\n".join("".join("#" if a else "." for a in row) for row in m)


def as_mask(m: object) -> Mask:
    """``m`` itself if a :class:`Mask`, else ``array(m)`` for a boolean array."""
    if isinstance(m, Mask):
        return m
    if isinstance(m, (bool, int, float, str)) or m is None:
        raise TypeError(f"masks combine only with masks or boolean arrays, got {type(m).__name__} {m!r}")
    return array(m)


def _broadcast_ranked(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes of any ranks (strict rank promotion is kept by callers)."""
    return tuple(np.broadcast_shapes(*shapes))


def _align(a: Array, b: Array) -> tuple[Array, Array]:
    """``a`` and ``b`` left-padded with unit axes to one rank."""
    n = max(a.ndim, b.ndim)
    return a.reshape((1,) * (n - a.ndim) + a.shape), b.reshape((1,) * (n - b.ndim) + b.shape)


def _positions(
    T: int, S: int, q_offset: ArrayLike | None, kv_offset: ArrayLike, per_example: bool
) -> tuple[Array, Array]:
    """Absolute positions of queries and keys.

    ``i (T, 1)`` and ``j (1, S)``; or ``(B|1, 1, T, 1)`` and ``(B|1, 1, 1, S)`` when the mask or
    an offset ``(B,)`` is per example.
    """
    kv_offset = jnp.asarray(kv_offset, jnp.int32)
    q_offset = jnp.asarray(query_offset(q_offset, kv_offset, T, S), jnp.int32)
    for name, off in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if off.ndim > 1:
            raise ValueError(f"{name} must be a scalar or per-example (B,), got shape {off.shape}")
    if not (per_example or q_offset.ndim or kv_offset.ndim):
        return q_offset + jnp.arange(T, dtype=jnp.int32)[:, None], kv_offset + jnp.arange(S, dtype=jnp.int32)[None]
    i = q_offset.reshape(-1, 1, 1, 1) + jnp.arange(T, dtype=jnp.int32).reshape(1, 1, T, 1)
    j = kv_offset.reshape(-1, 1, 1, 1) + jnp.arange(S, dtype=jnp.int32).reshape(1, 1, 1, S)
    return i, j


@dataclasses.dataclass(frozen=True)
class _Binary(Mask):
    a: Mask
    b: Mask

    @property
    def per_example(self) -> bool:  # type: ignore[override]
        return self.a.per_example or self.b.per_example

    @property
    def has_arrays(self) -> bool:  # type: ignore[override]
        return self.a.has_arrays or self.b.has_arrays

    @property
    def per_row(self) -> bool:  # type: ignore[override]
        return self.a.per_row or self.b.per_row

    def _bind(self, q0, k0):
        return dataclasses.replace(self, a=self.a._bind(q0, k0), b=self.b._bind(q0, k0))

    def _rows(self, lead, axis=0):
        return dataclasses.replace(self, a=self.a._rows(lead, axis), b=self.b._rows(lead, axis))


class _And(_Binary):
    def allowed(self, i, j):
        return jnp.logical_and(*_align(self.a.allowed(i, j), self.b.allowed(i, j)))

    def _blocks(self, *box):
        (ea, fa), (eb, fb) = self.a._blocks(*box), self.b._blocks(*box)
        return ea | eb, fa & fb

    def _tiles(self, *box):
        (ea, fa), (eb, fb) = self.a._tiles(*box), self.b._tiles(*box)
        return ea | eb, fa & fb


class _Or(_Binary):
    def allowed(self, i, j):
        return jnp.logical_or(*_align(self.a.allowed(i, j), self.b.allowed(i, j)))

    def _blocks(self, *box):
        (ea, fa), (eb, fb) = self.a._blocks(*box), self.b._blocks(*box)
        return ea & eb, fa | fb

    def _tiles(self, *box):
        (ea, fa), (eb, fb) = self.a._tiles(*box), self.b._tiles(*box)
        return ea & eb, fa | fb


@dataclasses.dataclass(frozen=True)
class _Not(Mask):
    a: Mask

    @property
    def per_example(self) -> bool:  # type: ignore[override]
        return self.a.per_example

    @property
    def has_arrays(self) -> bool:  # type: ignore[override]
        return self.a.has_arrays

    @property
    def per_row(self) -> bool:  # type: ignore[override]
        return self.a.per_row

    def _bind(self, q0, k0):
        return _Not(self.a._bind(q0, k0))

    def _rows(self, lead, axis=0):
        return _Not(self.a._rows(lead, axis))

    def allowed(self, i, j):
        return ~self.a.allowed(i, j)

    def _blocks(self, *box):
        empty, full = self.a._blocks(*box)
        return full, empty

    def _tiles(self, *box):
        empty, full = self.a._tiles(*box)
        return full, empty


class _Leaf(Mask):
    """Base of masks read from arrays over the ``(t, s)`` grid of one call.

    Fields: the arrays (see :meth:`leaves`), then ``q0``, ``k0``: the positions of grid row 0 and
    column 0, bound per call (:meth:`Mask._bind`), so row ``t`` is query position ``q0 + t``.
    """

    has_arrays = True

    def leaves(self) -> tuple[Array, ...]:
        """The arrays of this leaf, in field order (what :func:`split_arrays` takes out)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("q0", "k0"))

    def rebuilder(self) -> Any:
        """A hashable callable that makes this leaf again from :meth:`leaves` (:func:`fill_arrays`)."""
        return type(self)

    def _bind(self, q0, k0):
        return dataclasses.replace(self, q0=q0, k0=k0)

    def _grid(self, i, j) -> tuple[Array, Array]:
        """Grid indices ``t (..., T, 1)`` and ``s (..., 1, S)`` of positions ``i``, ``j``."""
        if self.q0 is None:
            raise ValueError("an array mask is read only inside a call that places it (attention, Mask.dense)")
        return i - self.q0, j - self.k0


def _per_tile(x: Array, axis: int, count: int, size: int, fill, reduce) -> Array:
    """``reduce`` over each tile of ``size`` along ``axis`` (of extent 1 or up to count·size), padded by ``fill``.

    ``fill`` is a constant neutral for ``reduce``, or ``'edge'`` to repeat the last entry. The
    axis becomes ``count`` tiles (or stays 1 where ``x`` has extent 1 on it).
    """
    if x.shape[axis] == 1:
        return reduce(x, axis=axis, keepdims=True)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, count * size - x.shape[axis])
    x = jnp.pad(x, widths, mode="edge") if fill == "edge" else jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(*x.shape[:axis], count, size, *x.shape[axis + 1 :])
    return reduce(x, axis=axis + 1)


def on_batch_axis(x: ArrayLike, lead: tuple[int, ...], axis: int) -> Array:
    """A per-example array ``(B|1, ...)`` broadcast to ``(*lead, ...)``, its batch on ``lead[axis]``.

    ``axis`` is where q's first axis lands in the call's leading shape (:func:`call_lead`).
    """
    x = jnp.asarray(x)
    rest = x.shape[1:]
    x = x.reshape((1,) * axis + (x.shape[0],) + (1,) * (len(lead) - axis - 1) + rest)
    return jnp.broadcast_to(x, (*lead, *rest))


def _row_form(x: Array, lead: tuple[int, ...], axis: int) -> Array:
    """A per-example array ``(B|1, ...)`` as rows ``(R|1, ...)`` of ``lead`` flattened, its batch on ``lead[axis]``."""
    if x.shape[0] == 1:
        return x
    return on_batch_axis(x, lead, axis).reshape(math.prod(lead), *x.shape[1:])


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayMask(_Leaf):
    """An explicit boolean array ``(..., T, S)`` over the ``(t, s)`` grid of one call (True = attend).

    It broadcasts like NumPy against the call's ``(..., T, S)``; a 1-D array is ``(S,)``. Made by
    :func:`array`. Its leading dimensions broadcast against those of q (they are not a batch
    axis of their own); offsets place the grid: row ``t`` is query position ``q0 + t``.
    """

    array: Array
    q0: Any = None
    k0: Any = None

    def _rows(self, lead, axis=0):
        m = self.array
        if all(n == 1 for n in m.shape[:-2]):
            return dataclasses.replace(self, array=m.reshape(1, *m.shape[-2:]))
        m = jnp.broadcast_to(m, (*lead, *m.shape[-2:]))
        return dataclasses.replace(self, array=m.reshape(-1, *m.shape[-2:]))

    def allowed(self, i, j):
        t, s = self._grid(i, j)  # (..., T, 1), (..., 1, S) grid indices
        if t.ndim != 2 or s.ndim != 2:
            raise ValueError("an array mask takes no per-example offsets or per-example masks beside it")
        m = self.array
        rows = jnp.clip(t[:, 0], 0, m.shape[-2] - 1) if m.shape[-2] > 1 else jnp.zeros_like(t[:, 0])
        cols = jnp.clip(s[0], 0, m.shape[-1] - 1) if m.shape[-1] > 1 else jnp.zeros_like(s[0])
        return jnp.take(jnp.take(m, rows, axis=-2), cols, axis=-1)

    def _tiles(self, i0, i1, j0, j1, tiling):
        """Per tile and leading row: empty where no entry is True, full where every entry is."""
        T, S, bq, bk = tiling  # the tiled grid, possibly padded past the array's own T and S
        n = (-(-T // bq), -(-S // bk))
        m = self.array.reshape(-1, *self.array.shape[-2:])  # (L, T|1, S|1)

        def per_tile(fill, reduce):  # (L, nq, nk); padding is neutral for `reduce`
            x = _per_tile(m, 1, n[0], bq, fill, reduce)
            x = _per_tile(x, 2, n[1], bk, fill, reduce)
            return jnp.broadcast_to(x, (m.shape[0], *n))

        return ~per_tile(False, jnp.any), per_tile(True, jnp.all)


def array(m: ArrayLike) -> ArrayMask:
    """An explicit boolean mask ``(..., T, S)`` (True = attend), broadcastable like NumPy.

    A 1-D ``(S,)`` array masks keys for every query; 0-D masks everything or nothing. It combines
    with predicates by ``&``, ``|`` and ``~``; a plain boolean array passed as ``mask=`` is read the
    same way.
    """
    m = jnp.asarray(m)
    if m.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {m.dtype} with shape {m.shape}")
    return ArrayMask(m.reshape((1,) * max(0, 2 - m.ndim) + m.shape))


_NO_LIMIT = np.iinfo(np.int32).max  # a length that masks nothing


@dataclasses.dataclass(frozen=True, eq=False)
class RowPadding(_Leaf):
    """:func:`padding` as rows: ``q_lengths``, ``kv_lengths`` ``(R|1,)`` int32, one per row of B·N."""

    q_lengths: Array
    kv_lengths: Array
    q0: Any = None
    k0: Any = None

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


@dataclasses.dataclass(frozen=True, eq=False)
class RowSegments(_Leaf):
    """:func:`segment_ids` as rows: ``q (R|1, T)``, ``kv (R|1, S)`` int32, one row of ids per row of B·N."""

    q: Array
    kv: Array
    q0: Any = None
    k0: Any = None

    def allowed(self, i, j):  # i (bq, 1), j (1, bk) -> (R|1, bq, bk); grid padding reads the last id
        t, s = self._grid(i, j)
        qs = jnp.take(self.q, jnp.clip(t[:, 0], 0, self.q.shape[-1] - 1), axis=-1)
        ks = jnp.take(self.kv, jnp.clip(s[0], 0, self.kv.shape[-1] - 1), axis=-1)
        return qs[:, :, None] == ks[:, None, :]

    def _tiles(self, i0, i1, j0, j1, tiling):
        """Per tile: empty where the ids' ranges ``[min, max]`` of its queries and keys are disjoint, full where both hold one id."""
        T, S, bq, bk = tiling
        q_lo, q_hi = (_per_tile(self.q, 1, -(-T // bq), bq, "edge", f)[:, :, None] for f in (jnp.min, jnp.max))
        k_lo, k_hi = (_per_tile(self.kv, 1, -(-S // bk), bk, "edge", f)[:, None, :] for f in (jnp.min, jnp.max))
        return (q_hi < k_lo) | (q_lo > k_hi), (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)


def lead_rows(lead: tuple[int, ...]) -> np.ndarray:
    """``(prod(lead), 2)`` int32 (batch, head) of each row of ``lead`` flattened.

    ``batch`` indexes the first leading axis, ``head`` the remaining ones flattened row-major.
    """
    b, n = math.prod(lead), math.prod(lead[1:])
    r = np.arange(b, dtype=np.int32)
    return np.stack([r // n, r % n], 1)


_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Predicate(Mask):
    """``fn(batch, head, q_pos, kv_pos) -> bool`` of scalars (FlexAttention's ``mask_mod``); see :func:`predicate`."""

    fn: Any

    per_row = True

    def _rows(self, lead, axis=0):
        rows = jnp.asarray(lead_rows(lead))
        # Every array fn closes over (ints too, which jax.closure_convert would leave inside) becomes
        # an explicit argument, so no tracer of an enclosing trace is captured by the kernels.
        closed = jax.make_jaxpr(self.fn)(_INDEX, _INDEX, _INDEX, _INDEX)
        consts = tuple(jnp.asarray(c)[None] for c in closed.consts)
        return PredicateRows(_jaxpr_fn(closed.jaxpr), rows[:, 0], rows[:, 1], consts)

    def allowed(self, i, j):
        raise ValueError(
            "a masks.predicate reads the batch and head: it is evaluated inside attention calls, not on positions alone"
        )


def _jaxpr_fn(jaxpr) -> Any:
    """``fn(batch, head, q_pos, kv_pos, *consts)`` evaluating a predicate's jaxpr with its consts given."""

    def fn(b, h, i, j, *consts):
        return jax.core.eval_jaxpr(jaxpr, consts, b, h, i, j)[0]

    return fn


@dataclasses.dataclass(frozen=True)
class _PredicateKind:
    """Rebuilds :class:`PredicateRows` around the converted ``fn`` (hashable: by the function)."""

    fn: Any

    def __call__(self, batch, head, *consts):
        return PredicateRows(self.fn, batch, head, consts)


@dataclasses.dataclass(frozen=True, eq=False)
class PredicateRows(_Leaf):
    """:class:`Predicate` as rows: ``batch``, ``head`` ``(R,)`` int32 per row of B·N, and ``fn``'s closed-over arrays.

    ``fn(batch, head, q_pos, kv_pos, *consts)`` is the closure-converted predicate of scalars;
    each const carries a leading unit axis, so the kernels share it between rows of B.
    """

    fn: Any
    batch: Array
    head: Array
    consts: tuple = ()
    q0: Any = None
    k0: Any = None

    def leaves(self):
        return (self.batch, self.head, *self.consts)

    def rebuilder(self):
        return _PredicateKind(self.fn)

    def allowed(self, i, j):  # i (t, 1), j (1, s) -> (R, t, s)
        consts = tuple(c[0] for c in self.consts)
        f = lambda b, h, q, kv: self.fn(b, h, q, kv, *consts)  # noqa: E731
        f = jax.vmap(f, (None, None, None, 0))
        f = jax.vmap(f, (None, None, 0, None))
        f = jax.vmap(f, (0, 0, None, None))
        return jnp.asarray(f(self.batch, self.head, i[:, 0], j[0]), bool)


def predicate(fn: Any) -> Predicate:
    """A mask from ``fn(batch, head, q_pos, kv_pos) -> bool``, a function of int32 scalars (vmapped over the grid).

    ``batch`` indexes the first leading axis of the call (after broadcasting q, k, v, mask and
    bias), ``head`` the remaining leading axes flattened row-major, ``q_pos``/``kv_pos`` the
    absolute positions (offsets included), as for ``score_mod``. ``fn`` may close over arrays
    (document ids, per-head window sizes), traced ones included. Combine with position predicates
    by ``&`` so the blockwise path skips their empty tiles; tiles of the predicate itself are all
    evaluated. Example: ``predicate(lambda b, h, q, kv: q - kv <= windows[h])``.
    """
    if not callable(fn):
        raise TypeError(f"predicate needs a callable fn(batch, head, q_pos, kv_pos) -> bool, got {fn!r}")
    return Predicate(fn)


@dataclasses.dataclass(frozen=True)
class _Slot(Mask):
    """Where an array leaf stood in a static skeleton (see :func:`split_arrays`)."""

    index: int  # its first array in the list
    kind: Any  # makes the leaf from its arrays: ArrayMask, RowPadding, RowSegments or a _PredicateKind
    shapes: tuple[tuple[int, ...], ...]

    has_arrays = True


def split_arrays(mask: Mask) -> tuple[Mask, tuple[Array, ...]]:
    """``(skeleton, arrays)``: a hashable mask with each array leaf replaced by a slot, and the arrays.

    The skeleton's static :meth:`Mask.block_kinds` treats the slots as unknown (every tile
    partial); :func:`fill_arrays` puts the arrays back.
    """
    arrays: list[Array] = []

    def split(m: Mask) -> Mask:
        if isinstance(m, _Leaf):
            leaves = m.leaves()
            arrays.extend(leaves)
            return _Slot(len(arrays) - len(leaves), m.rebuilder(), tuple(x.shape for x in leaves))
        if isinstance(m, _Binary):
            return dataclasses.replace(m, a=split(m.a), b=split(m.b))
        return _Not(split(m.a)) if isinstance(m, _Not) else m

    return split(mask), tuple(arrays)


def fill_arrays(skeleton: Mask, arrays: Sequence[Array]) -> Mask:
    """The inverse of :func:`split_arrays` (arrays may be reshaped, e.g. split by rows, in between)."""
    if isinstance(skeleton, _Slot):
        return skeleton.kind(*arrays[skeleton.index : skeleton.index + len(skeleton.shapes)])
    if isinstance(skeleton, _Binary):
        return dataclasses.replace(skeleton, a=fill_arrays(skeleton.a, arrays), b=fill_arrays(skeleton.b, arrays))
    return _Not(fill_arrays(skeleton.a, arrays)) if isinstance(skeleton, _Not) else skeleton


def shared_arrays(skeleton: Mask | None) -> tuple[int, ...]:
    """Indices, in :func:`split_arrays`'s list, of the arrays every row shares (a predicate's consts)."""
    if isinstance(skeleton, _Slot):
        if not isinstance(skeleton.kind, _PredicateKind):
            return ()
        return tuple(range(skeleton.index + 2, skeleton.index + len(skeleton.shapes)))  # after batch, head
    if isinstance(skeleton, _Binary):
        return shared_arrays(skeleton.a) + shared_arrays(skeleton.b)
    return shared_arrays(skeleton.a) if isinstance(skeleton, _Not) else ()


def conjuncts(mask: Mask) -> list[Mask]:
    """The terms ``[a, b, ...]`` of a top-level ``a & b & ...`` (``[mask]`` for any other mask)."""
    return [t for part in (mask.a, mask.b) for t in conjuncts(part)] if isinstance(mask, _And) else [mask]


def example_lead(mask: Mask | None, ndim: int) -> tuple[int, ...]:
    """The leading shape ``(B, 1, ...)`` (rank ``ndim - 2``) that a per-example mask adds to q's, or ``()``.

    ``ndim`` is q's rank; a per-example mask reads q's first axis as the batch, so q needs one.
    """
    leaves = _per_example_leaves(mask)
    if not leaves:
        return ()
    if ndim < 3:
        raise ValueError(f"a per-example mask needs a batch axis in q, got q of rank {ndim}")
    sizes = {leaf.batch for leaf in leaves} - {1}
    if len(sizes) > 1:
        raise ValueError(f"per-example masks must share the batch B, got batches {sorted(sizes)} in {mask!r}")
    return (max(sizes, default=1),) + (1,) * (ndim - 3)


def _per_example_leaves(mask: Mask | None) -> list[_PerExample]:
    return _leaves_of(mask, _PerExample)


def array_leaves(mask: Mask | None) -> list[ArrayMask]:
    """The explicit boolean arrays inside ``mask`` (its :class:`ArrayMask` leaves), left to right."""
    return _leaves_of(mask, ArrayMask)


def _leaves_of(mask: Mask | None, kind: type) -> list:
    if isinstance(mask, _Binary):
        return _leaves_of(mask.a, kind) + _leaves_of(mask.b, kind)
    if isinstance(mask, _Not):
        return _leaves_of(mask.a, kind)
    return [mask] if isinstance(mask, kind) else []


def as_rows(mask: Mask, lead: tuple[int, ...], axis: int = 0) -> Mask:
    """``mask`` with its array leaves as rows ``(R|1, ...)`` of ``lead`` flattened (:meth:`Mask._rows`).

    A per-example leaf's batch is axis ``axis`` of ``lead`` (where q's first axis lands).
    """
    return mask._rows(lead, axis)


def call_lead(mask: Mask, q: Array, k: Array, v: Array | None, bias: Array | None) -> tuple[tuple[int, ...], int]:
    """``(lead, axis)``: the call's leading shape and the axis of it where q's first axis lands.

    ``lead`` broadcasts q, k, v, bias, the mask's arrays (each checked against q and k) and a
    per-example mask's batch, which lies on ``lead[axis]``.
    """
    T, S = q.shape[-2], k.shape[-2]
    check_lengths(mask, T, S)
    lead = broadcast_all(q=q, k=k, v=v, bias=bias)
    leads = [broadcast_all(q=q, k=k, v=v, mask=a.array) for a in array_leaves(mask)]
    batch = example_lead(mask, q.ndim)
    try:
        lead = tuple(np.broadcast_shapes(lead, *leads, batch))
    except ValueError:
        raise ValueError(
            f"leading dimensions do not broadcast: q {q.shape}, k {k.shape}"
            + ("" if v is None else f", v {v.shape}")
            + ("" if bias is None else f", bias {bias.shape}")
            + "".join(f", mask array {a.array.shape}" for a in array_leaves(mask))
            + (f", the mask's batch {batch} (a per-example mask's B on q's first axis)" if batch else "")
        ) from None
    return lead, len(lead) - (q.ndim - 2)


def call_rows(mask: Mask, q: Array, k: Array, v: Array | None, bias: Array | None) -> tuple[tuple[int, ...], Mask]:
    """``(lead, rows)``: the call's leading shape (:func:`call_lead`) and ``mask`` as rows of it flattened."""
    lead, axis = call_lead(mask, q, k, v, bias)
    return lead, as_rows(mask, lead, axis)


def row_kinds(mask: Mask, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int, kv_offset: int) -> Array:
    """``(R|1, ceil(T/block_q), ceil(S/block_kv))`` int8 EMPTY / PARTIAL / FULL per row, traced.

    ``mask`` is in row form (:meth:`Mask._rows`) with its arrays bound; static offsets.
    """
    i0 = q_offset + np.arange(0, T, block_q)[:, None]
    i1 = np.minimum(i0 + block_q, q_offset + T) - 1
    j0 = kv_offset + np.arange(0, S, block_kv)[None, :]
    j1 = np.minimum(j0 + block_kv, kv_offset + S) - 1
    empty, full = mask._tiles(i0, i1, j0, j1, (T, S, block_q, block_kv))
    kinds = jnp.where(full, jnp.int8(FULL), jnp.int8(PARTIAL))
    return jnp.where(empty, jnp.int8(EMPTY), kinds)


def tile_kinds(mask: Mask, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int, kv_offset: int) -> Array:
    """``(ceil(T/block_q), ceil(S/block_kv))`` int8 EMPTY / PARTIAL / FULL, traced.

    As :meth:`Mask.block_kinds`, but array leaves and per-example masks (``padding``,
    ``segment_ids``) are read on device: a tile empty for every example (every entry of an array
    False) is empty, one full for every example full. Works under ``jit`` with traced arrays.
    Static ``q_offset``/``kv_offset``.
    """
    check_lengths(mask, T, S)
    leads = [a.array.shape[:-2] for a in array_leaves(mask)]
    ndim = 2 + max([1, *map(len, leads)])  # the rank of a q the leaves broadcast against
    lead = _broadcast_ranked(example_lead(mask, ndim), *leads)
    rows = as_rows(mask, lead)._bind(q_offset, kv_offset)
    return reduce_kinds(row_kinds(rows, T, S, block_q, block_kv, q_offset=q_offset, kv_offset=kv_offset))


def box_kinds(mask: Mask, i0, i1, j0, j1) -> np.ndarray:
    """int8 EMPTY / PARTIAL / FULL of the boxes of query positions ``[i0, i1]`` x key positions ``[j0, j1]``.

    Inclusive bounds, int arrays that broadcast together (static, as :meth:`Mask.block_kinds`,
    which is this on a grid).
    """
    empty, full = mask._blocks(i0, i1, j0, j1)
    kinds = np.full(np.broadcast_shapes(*map(np.shape, (i0, i1, j0, j1))), PARTIAL, np.int8)
    kinds[np.broadcast_to(full, kinds.shape)] = FULL
    kinds[np.broadcast_to(empty, kinds.shape)] = EMPTY
    return kinds


def reduce_kinds(kinds: Array) -> Array:
    """``(R, ...)`` kinds to one ``(...)``: EMPTY where every row is empty, FULL where every row is full."""
    empty, full = jnp.all(kinds == EMPTY, axis=0), jnp.all(kinds == FULL, axis=0)
    return jnp.where(empty, jnp.int8(EMPTY), jnp.where(full, jnp.int8(FULL), jnp.int8(PARTIAL)))


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


@dataclasses.dataclass(frozen=True, eq=False)
class _PerExample(Mask):
    """Base of masks that read per-example arrays (batch first)."""

    per_example = True

    @property
    def batch(self) -> int:
        """The batch B of its arrays (1 where they broadcast)."""
        parts = (getattr(self, f.name) for f in dataclasses.fields(self))
        return max(jnp.shape(x)[0] for x in parts if x is not None)


@dataclasses.dataclass(frozen=True, eq=False)
class Padding(_PerExample):
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
class SegmentIds(_PerExample):
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


def causal() -> Mask:
    """``j <= i``; with ``T != S`` queries align bottom-right (see the module docstring)."""
    return Causal()


def sliding_window(left: int, right: int = 0) -> Mask:
    """``i - left <= j <= i + right``; ``sliding_window(w)`` is a causal window of ``w + 1`` keys.

    ``left`` and ``right`` are non-negative ints (Python or NumPy integers, not bool).
    """
    return SlidingWindow(check_int("sliding_window left", left, min=0), check_int("sliding_window right", right, min=0))


def global_tokens(indices: Sequence[int]) -> Mask:
    """The tokens at ``indices`` (absolute positions: non-negative ints) see all and are seen by all."""
    if isinstance(indices, str) or not isinstance(indices, Sequence | np.ndarray | jax.Array) or is_traced(indices):
        raise TypeError(f"global_tokens indices must be a sequence of static ints, got {indices!r}")
    indices = tuple(check_int(f"global_tokens indices[{n}]", x, min=0) for n, x in enumerate(indices))
    if not indices:
        raise ValueError("global_tokens needs at least one index, got []")
    return GlobalTokens(indices)


def chunked(size: int) -> Mask:
    """Attention only within chunks ``[k*size, (k+1)*size)`` of positions; ``size`` a positive int."""
    return Chunked(check_int("chunked size", size, min=1))


def prefix_lm(prefix_length: int) -> Mask:
    """Bidirectional over the first ``prefix_length`` (a non-negative int) positions, causal after them."""
    return Causal() | KeyBelow(check_int("prefix_length", prefix_length, min=0))


@dataclasses.dataclass(frozen=True)
class KeyBelow(Mask):
    """``j < n``."""

    n: int

    def allowed(self, i, j):
        return j < self.n

    def _blocks(self, i0, i1, j0, j1):
        shape = np.broadcast_shapes(np.shape(i0), np.shape(j0))
        return np.broadcast_to(j0 >= self.n, shape), np.broadcast_to(j1 < self.n, shape)


def padding(q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None) -> Mask:
    """Per-example valid lengths ``(B,)`` of the queries and/or keys; the rest is masked.

    Lengths are non-negative integers; a length beyond the sequence means all of it is valid.
    Negative lengths raise a ValueError when they can be read; traced under ``jit``, a negative
    length counts as 0 (the whole example is masked, and a fully masked query row gives 0).
    """
    if q_lengths is None and kv_lengths is None:
        raise ValueError("padding needs q_lengths or kv_lengths")
    checked = []
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if x is not None:
            x = int_array(f"padding {name}", x, ndim=1, shape="(B,)")
            if not is_traced(x) and x.size and int(x.min()) < 0:
                raise ValueError(f"padding {name} must be non-negative, got {np.asarray(x).tolist()}")
        checked.append(x)
    q_lengths, kv_lengths = checked
    if q_lengths is not None and kv_lengths is not None and len({q_lengths.shape[0], kv_lengths.shape[0]} - {1}) > 1:
        raise ValueError(
            f"padding q_lengths and kv_lengths must share the batch B, got {q_lengths.shape} and {kv_lengths.shape}"
        )
    return Padding(q_lengths, kv_lengths)


def segment_ids(q_segments: ArrayLike, kv_segments: ArrayLike | None = None) -> Mask:
    """Document masking for packed sequences: ``q_segments (B, T)``, ``kv_segments (B, S)``.

    Integer segment ids; ``kv_segments`` defaults to ``q_segments`` (self-attention). The
    lengths T and S must equal those of the queries and keys the mask is used with.
    """
    kv_segments = q_segments if kv_segments is None else kv_segments
    q = int_array("segment_ids q_segments", q_segments, ndim=2, shape="(B, T)")
    kv = int_array("segment_ids kv_segments", kv_segments, ndim=2, shape="(B, S)")
    if len({q.shape[0], kv.shape[0]} - {1}) > 1:
        raise ValueError(
            f"segment_ids q_segments (B, T) and kv_segments (B, S) must share the batch B, got {q.shape} and {kv.shape}"
        )
    return SegmentIds(q, kv)


def check_lengths(mask: Mask, T: int, S: int) -> None:
    """Raises unless every ``segment_ids`` inside ``mask`` has lengths T and S."""
    if isinstance(mask, SegmentIds):
        q, kv = jnp.shape(mask.q_segments), jnp.shape(mask.kv_segments)
        if q[-1] != T or kv[-1] != S:
            raise ValueError(
                f"segment_ids q_segments {q} and kv_segments {kv} must have shapes (B, T={T}) and (B, S={S})"
            )
    if isinstance(mask, ArrayMask) and (mask.array.shape[-2] not in (1, T) or mask.array.shape[-1] not in (1, S)):
        shape = mask.array.shape
        held = " (as masks.array holds it: a 1-D (S,) array is (1, S))" if len(shape) == 2 and shape[0] == 1 else ""
        raise ValueError(f"mask of shape {shape}{held} does not broadcast to (..., T, S) = (..., {T}, {S})")
    if dataclasses.is_dataclass(mask):
        for field in dataclasses.fields(mask):
            part = getattr(mask, field.name)
            if isinstance(part, Mask):
                check_lengths(part, T, S)


#: A side of :func:`key_interval` without a bound.
UNBOUNDED = 2**62


def key_interval(mask: Mask | None) -> tuple[int, int] | None:
    """``(left, right)`` when ``mask`` lets query i see exactly the keys ``i - left <= j <= i + right``, else None.

    No mask, :class:`Causal`, :class:`SlidingWindow` and their ``&``; an unbounded side is
    :data:`UNBOUNDED` (the fused CPU forward's masks, :mod:`jattn._fused_cpu`).
    """
    if mask is None:
        return UNBOUNDED, UNBOUNDED
    if type(mask) is Causal:
        return UNBOUNDED, 0
    if type(mask) is SlidingWindow:
        return min(mask.left, UNBOUNDED), min(mask.right, UNBOUNDED)
    if type(mask) is _And:
        a, b = key_interval(mask.a), key_interval(mask.b)
        if a is not None and b is not None:
            return min(a[0], b[0]), min(a[1], b[1])
    return None
