"""The GPU kernel's tiles: the grid of one call, its per-tile kinds computed outside the kernel, and a tile's mask inside.

A call's queries are cut into ``nq`` blocks of ``bq`` rows and its keys into ``nk`` blocks of
``bk`` (q, k and v padded with zeros to ``Tp = nq·bq`` and ``Sp = nk·bk``). Every tile is
classified before the kernel runs (:func:`tile_kinds`, by :mod:`jattn._masks`' own machinery:
statically from positions, refined per row on device from padding lengths and segment ids):
EMPTY tiles are never visited, FULL ones are computed without a mask, PARTIAL ones evaluate the
mask's predicate in the kernel (:func:`tile_mask`) from the tile's positions and the row's
per-example arrays. :func:`bounds` gives each query block the range of its non-empty key blocks
(and each key block its range of query blocks, for the dk/dv kernel), so a causal or windowed
call loops over its band only. Dimension key in :mod:`jattn._core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import Array

from jattn._masks import (
    EMPTY,
    KeyBelow,
    Mask,
    RowPadding,
    RowSegments,
    fill_arrays,
    map_slots,
    row_kinds,
)

__all__ = ["Grid", "bounds", "grid_of", "kernel_arrays", "slot_kinds", "tile_kinds", "tile_mask"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """Static facts of one call's tiles (hashable): sizes, blocks, offsets and the mask's skeleton.

    ``mask`` is the skeleton (:func:`jattn._masks.split_arrays`) with the keys padded past S
    masked (``& KeyBelow(kv_offset + S)``); its slots are padding lengths or segment ids in row form.
    """

    T: int
    S: int
    bq: int
    bk: int
    q_offset: int
    kv_offset: int
    mask: Mask

    @property
    def nq(self) -> int:
        """Query blocks: ``ceil(T / bq)``."""
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        """Key blocks: ``ceil(S / bk)``."""
        return -(-self.S // self.bk)

    @property
    def t_pad(self) -> int:
        """T padded to the query blocks."""
        return self.nq * self.bq

    @property
    def s_pad(self) -> int:
        """S padded to the key blocks."""
        return self.nk * self.bk


def grid_of(skeleton: Mask | None, T: int, S: int, bq: int, bk: int, q_offset: int, kv_offset: int) -> Grid:
    """The :class:`Grid` of a call: the skeleton (or None) with the padded keys masked."""
    limit = KeyBelow(kv_offset + S)
    return Grid(T, S, bq, bk, q_offset, kv_offset, limit if skeleton is None else skeleton & limit)


def tile_kinds(grid: Grid, arrays: tuple[Array, ...]) -> Array:
    """``(R|1, nq, nk)`` int32 EMPTY / PARTIAL / FULL of every tile; ``R`` rows where the mask's arrays have them.

    Static (from positions, :meth:`jattn.masks.Mask.block_kinds`) without arrays; with them the
    static kinds refined on device per row (:func:`jattn._masks.row_kinds`).
    """
    static = grid.mask.block_kinds(
        grid.t_pad, grid.s_pad, grid.bq, grid.bk, q_offset=grid.q_offset, kv_offset=grid.kv_offset
    )
    kinds = jnp.asarray(static, jnp.int32)[None]
    if arrays:
        bound = fill_arrays(grid.mask, arrays)._bind(grid.q_offset, grid.kv_offset)
        rows = row_kinds(
            bound, grid.t_pad, grid.s_pad, grid.bq, grid.bk, q_offset=grid.q_offset, kv_offset=grid.kv_offset
        )
        kinds = jnp.where(kinds == EMPTY, EMPTY, rows.astype(jnp.int32))
    return kinds


def row_mask(grid: Grid, arrays: tuple[Array, ...]) -> Mask:
    """The mask in row form (:func:`jattn._masks.as_rows`) from the kernel's arrays (:func:`kernel_arrays`), ids cut to T and S.

    What the kernel reads, for its reference path (second order, on the blockwise path).
    """
    out = list(arrays)

    def cut(slot: Mask) -> Mask:
        if slot.kind is RowSegments:
            for n, size in ((slot.index, grid.T), (slot.index + 1, grid.S)):
                out[n] = out[n][:, :size]
        return slot

    map_slots(grid.mask, cut)
    return fill_arrays(grid.mask, out)


def bounds(kinds: Array, axis: int) -> Array:
    """``(R, n, 2)`` int32 ``[lo, hi)``: per row and block of the other axis, the range of non-empty blocks along ``axis``.

    ``kinds (R, nq, nk)``; ``axis=-1`` gives each query block its key blocks, ``axis=-2`` each key
    block its query blocks. An all-empty range is ``[0, 0)``.
    """
    live = kinds != EMPTY
    if axis == -2:
        live = jnp.swapaxes(live, -1, -2)
    n = live.shape[-1]
    lo = jnp.argmax(live, axis=-1).astype(jnp.int32)
    hi = (n - jnp.argmax(live[..., ::-1], axis=-1)).astype(jnp.int32)
    anything = jnp.any(live, axis=-1)
    return jnp.stack([jnp.where(anything, lo, 0), jnp.where(anything, hi, 0)], axis=-1)


def kernel_arrays(grid: Grid, arrays: tuple[Array, ...]) -> tuple[Array, ...]:
    """The mask's row-form arrays as the kernel reads them: lengths ``(R|1,)`` int32, ids padded to ``Tp`` and ``Sp``."""
    out = list(arrays)

    def pad(slot: Mask) -> Mask:
        if slot.kind is RowSegments:
            for n, size in ((slot.index, grid.t_pad), (slot.index + 1, grid.s_pad)):
                x = out[n]
                out[n] = jnp.pad(x, ((0, 0), (0, size - x.shape[-1])), mode="edge")
        return slot

    map_slots(grid.mask, pad)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class _Local(Mask):
    """A leaf's tile already evaluated in the kernel: ``keep (bq, bk)``."""

    keep: Array

    def allowed(self, i, j):
        return self.keep


def tile_mask(grid: Grid, read: Callable[[int, slice | None], Array], t: Array, s: Array) -> Array:
    """``(bq, bk)`` bool: the mask on one tile, inside the kernel.

    ``t (bq,)`` and ``s (bk,)`` are the tile's query and key indices in the padded grid; ``read(n,
    window)`` loads array ``n`` of :func:`kernel_arrays` at the kernel's row (its ``window`` of
    positions, or the scalar where ``window`` is None). Position masks are evaluated at absolute
    positions; padding lengths and segment ids from the row's arrays.
    """

    def local(slot: Mask) -> Mask:
        if slot.kind is RowPadding:
            ql, kl = read(slot.index, None), read(slot.index + 1, None)
            return _Local((t[:, None] < ql) & (s[None, :] < kl))
        if slot.kind is RowSegments:
            return _Local(read(slot.index, "q")[:, None] == read(slot.index + 1, "kv")[None, :])
        raise AssertionError(f"no tile form for {slot.kind}")  # refused before (jattn._gpu.attention)

    i, j = grid.q_offset + t, grid.kv_offset + s
    keep = map_slots(grid.mask, local).allowed(i[:, None], j[None, :])
    return jnp.broadcast_to(jnp.asarray(keep).reshape(jnp.shape(keep)[-2:]), (t.shape[0], s.shape[0]))


def slot_kinds(grid: Grid) -> list:
    """The kinds of the skeleton's slots (their leaf classes), left to right."""
    kinds: list = []
    map_slots(grid.mask, lambda slot: kinds.append(slot.kind) or slot)
    return kinds
