"""The :class:`Mask` base class, its combinations (``&``, ``|``, ``~``) and the masks read from arrays.

A mask is a predicate of absolute query position ``i`` and key position ``j`` (positions and
offsets: :mod:`jattn._masks.constructors`). This module holds what every mask shares: :class:`Mask` itself
(dense materialisation, static block kinds, the combining operators), the combinations
:class:`And`, :class:`Or`, :class:`Not`, the base of masks read from arrays over the ``(t, s)``
grid of one call (:class:`Leaf`, :func:`leaf_dataclass`) and the explicit boolean array
(:class:`ArrayMask`), which any mask combines with. The predicates: :mod:`jattn._masks.positions`,
:mod:`jattn._masks.per_example`, :mod:`jattn._masks.predicates`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._masks.kinds import box_kinds, grid_boxes
from jattn._scalars import check_int

__all__ = [
    "And",
    "ArrayMask",
    "Combination",
    "Leaf",
    "Mask",
    "Not",
    "Or",
    "as_mask",
    "broadcast_ranked",
    "check_lengths",
    "conjuncts",
    "leaf_dataclass",
    "mask_of_array",
    "per_tile",
    "query_offset",
]


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
        return And(self, as_mask(other))

    def __rand__(self, other: ArrayLike) -> Mask:
        return And(as_mask(other), self)

    def __or__(self, other: Mask | ArrayLike) -> Mask:
        return Or(self, as_mask(other))

    def __ror__(self, other: ArrayLike) -> Mask:
        return Or(as_mask(other), self)

    def __invert__(self) -> Mask:
        return Not(self)

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
        alone has ``R = 1``. See :func:`jattn.masks.tile_kinds`.
        """
        empty, full = self._blocks(i0, i1, j0, j1)
        shape = (1, *np.broadcast_shapes(np.shape(i0), np.shape(j0)))
        return jnp.broadcast_to(jnp.asarray(empty), shape), jnp.broadcast_to(jnp.asarray(full), shape)

    def _check_lengths(self, T: int, S: int) -> None:
        """Raises unless this mask's arrays fit queries of length T and keys of length S (see :func:`check_lengths`)."""

    def dense(self, T: int, S: int, *, q_offset: ArrayLike | None = None, kv_offset: ArrayLike = 0) -> Array:
        """The boolean mask ``(T, S)``; ``(B, 1, T, S)`` per example; ``(..., T, S)`` with arrays.

        ``(T, S)``, ``(B, 1, T, S)`` when it depends on the example, or ``(..., T, S)`` with the
        leading dimensions of its arrays. ``T`` and ``S`` are non-negative ints; offsets are scalars or per example ``(B,)``.
        """
        T, S = check_int("T", T, min=0), check_int("S", S, min=0)
        check_lengths(self, T, S)
        i, j = _positions(T, S, q_offset, kv_offset, self.per_example)
        m = self._bind(i[..., :1, :], j[..., :, :1]).allowed(i, j)
        return jnp.broadcast_to(m, broadcast_ranked(m.shape, i.shape, j.shape))

    def block_kinds(
        self, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int | None = None, kv_offset: int = 0
    ) -> np.ndarray:
        """``(ceil(T/block_q), ceil(S/block_kv))`` int8 of EMPTY / PARTIAL / FULL (static offsets).

        ``T``, ``S`` are non-negative ints and ``block_q``, ``block_kv`` positive ints.
        """
        T, S = check_int("T", T, min=0), check_int("S", S, min=0)
        block_q, block_kv = check_int("block_q", block_q, min=1), check_int("block_kv", block_kv, min=1)
        q_offset = query_offset(q_offset, kv_offset, T, S)
        return box_kinds(self, *grid_boxes(T, S, block_q, block_kv, q_offset, kv_offset))

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
    return mask_of_array(m)


def check_lengths(mask: Mask | None, T: int, S: int) -> None:
    """Raises unless every ``segment_ids`` and explicit array inside ``mask`` fits lengths T and S."""
    if mask is not None:
        mask._check_lengths(T, S)


def broadcast_ranked(*shapes: tuple[int, ...]) -> tuple[int, ...]:
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


class Combination(Mask):
    """Base of the masks that combine others (``&``, ``|``, ``~``): its parts are :meth:`_parts`.

    What the parts hold (arrays, examples, rows) the combination holds; binding, row forms and
    the length check pass to every part.
    """

    def _parts(self) -> tuple[Mask, ...]:
        """The masks combined, left to right."""
        raise NotImplementedError

    def _with_parts(self, parts: Sequence[Mask]) -> Mask:
        """The same combination of other ``parts`` (as many as :meth:`_parts`)."""
        raise NotImplementedError

    @property
    def per_example(self) -> bool:  # type: ignore[override]
        return any(p.per_example for p in self._parts())

    @property
    def has_arrays(self) -> bool:  # type: ignore[override]
        return any(p.has_arrays for p in self._parts())

    @property
    def per_row(self) -> bool:  # type: ignore[override]
        return any(p.per_row for p in self._parts())

    def _bind(self, q0, k0):
        return self._with_parts([p._bind(q0, k0) for p in self._parts()])

    def _rows(self, lead, axis=0):
        return self._with_parts([p._rows(lead, axis) for p in self._parts()])

    def _check_lengths(self, T, S):
        for p in self._parts():
            p._check_lengths(T, S)


@dataclasses.dataclass(frozen=True)
class _Binary(Combination):
    a: Mask
    b: Mask

    def _parts(self):
        return self.a, self.b

    def _with_parts(self, parts):
        a, b = parts
        return dataclasses.replace(self, a=a, b=b)


class And(_Binary):
    """``a & b``: allowed where both are."""

    def allowed(self, i, j):
        return jnp.logical_and(*_align(self.a.allowed(i, j), self.b.allowed(i, j)))

    def _blocks(self, *box):
        (ea, fa), (eb, fb) = self.a._blocks(*box), self.b._blocks(*box)
        return ea | eb, fa & fb

    def _tiles(self, *box):
        (ea, fa), (eb, fb) = self.a._tiles(*box), self.b._tiles(*box)
        return ea | eb, fa & fb


class Or(_Binary):
    """``a | b``: allowed where either is."""

    def allowed(self, i, j):
        return jnp.logical_or(*_align(self.a.allowed(i, j), self.b.allowed(i, j)))

    def _blocks(self, *box):
        (ea, fa), (eb, fb) = self.a._blocks(*box), self.b._blocks(*box)
        return ea & eb, fa | fb

    def _tiles(self, *box):
        (ea, fa), (eb, fb) = self.a._tiles(*box), self.b._tiles(*box)
        return ea & eb, fa | fb


@dataclasses.dataclass(frozen=True)
class Not(Combination):
    """``~a``: allowed where ``a`` is not."""

    a: Mask

    def _parts(self):
        return (self.a,)

    def _with_parts(self, parts):
        (a,) = parts
        return Not(a)

    def allowed(self, i, j):
        return ~self.a.allowed(i, j)

    def _blocks(self, *box):
        empty, full = self.a._blocks(*box)
        return full, empty

    def _tiles(self, *box):
        empty, full = self.a._tiles(*box)
        return full, empty


def conjuncts(mask: Mask) -> list[Mask]:
    """The terms ``[a, b, ...]`` of a top-level ``a & b & ...`` (``[mask]`` for any other mask)."""
    return [t for part in (mask.a, mask.b) for t in conjuncts(part)] if isinstance(mask, And) else [mask]


class Leaf(Mask):
    """Base of masks read from arrays over the ``(t, s)`` grid of one call.

    Fields (made by :func:`leaf_dataclass`): the arrays (see :meth:`leaves`), then ``q0``, ``k0``:
    the positions of grid row 0 and column 0, bound per call (:meth:`Mask._bind`), so row ``t`` is
    query position ``q0 + t``.
    """

    has_arrays = True
    q0: Any = None
    k0: Any = None

    def leaves(self) -> tuple[Array, ...]:
        """The arrays of this leaf, in field order (what :func:`jattn._masks.skeleton.split_arrays` takes out)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("q0", "k0"))

    def rebuilder(self) -> Any:
        """A hashable callable that makes this leaf again from :meth:`leaves` (:func:`jattn._masks.skeleton.fill_arrays`)."""
        return type(self)

    def _bind(self, q0, k0):
        return dataclasses.replace(self, q0=q0, k0=k0)

    def _grid(self, i, j) -> tuple[Array, Array]:
        """Grid indices ``t (..., T, 1)`` and ``s (..., 1, S)`` of positions ``i``, ``j``."""
        if self.q0 is None:
            raise ValueError("an array mask is read only inside a call that places it (attention, Mask.dense)")
        return i - self.q0, j - self.k0


def leaf_dataclass(cls: type[Leaf]) -> type[Leaf]:
    """``cls`` as a frozen dataclass (equal by identity) with, after its own fields, ``q0`` and ``k0`` (None until bound)."""
    cls.__annotations__ = {**inspect.get_annotations(cls), "q0": "Any", "k0": "Any"}
    cls.q0 = cls.k0 = None
    return dataclasses.dataclass(frozen=True, eq=False)(cls)


def per_tile(x: Array, axis: int, count: int, size: int, fill, reduce) -> Array:
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


@leaf_dataclass
class ArrayMask(Leaf):
    """An explicit boolean array ``(..., T, S)`` over the ``(t, s)`` grid of one call (True = attend).

    It broadcasts like NumPy against the call's ``(..., T, S)``; a 1-D array is ``(S,)``. Made by
    :func:`array`. Its leading dimensions broadcast against those of q (they are not a batch
    axis of their own); offsets place the grid: row ``t`` is query position ``q0 + t``.
    """

    array: Array

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

        def per_tiles(fill, reduce):  # (L, nq, nk); padding is neutral for `reduce`
            x = per_tile(m, 1, n[0], bq, fill, reduce)
            x = per_tile(x, 2, n[1], bk, fill, reduce)
            return jnp.broadcast_to(x, (m.shape[0], *n))

        return ~per_tiles(False, jnp.any), per_tiles(True, jnp.all)

    def _check_lengths(self, T, S):
        shape = self.array.shape
        if shape[-2] not in (1, T) or shape[-1] not in (1, S):
            held = " (as masks.array holds it: a 1-D (S,) array is (1, S))" if len(shape) == 2 and shape[0] == 1 else ""
            raise ValueError(f"mask of shape {shape}{held} does not broadcast to (..., T, S) = (..., {T}, {S})")


def mask_of_array(m: ArrayLike) -> ArrayMask:
    """The :class:`ArrayMask` of a boolean array (what :func:`jattn.masks.array` returns), held at rank 2 at least."""
    m = jnp.asarray(m)
    if m.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {m.dtype} with shape {m.shape}")
    return ArrayMask(m.reshape((1,) * max(0, 2 - m.ndim) + m.shape))
