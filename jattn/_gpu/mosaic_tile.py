"""One tile of the Mosaic GPU kernels in registers: its positions, its mask and its scores (``wgmma`` layout).

A tile is query block ``i`` by key block ``j`` of kernel row ``r`` (:mod:`jattn._gpu.tiles`' grid, 64 by 64).
Mosaic GPU keeps a warpgroup's ``(bq, bk)`` values in the ``wgmma`` accumulator's register layout, and a row's
``(bq,)`` values in its reduction over keys, so positions are whole ``(bq, bk)`` iotas (no ``(bq, 1)`` by ``(1,
bk)`` broadcasting) and the mask's predicate (:mod:`jattn._masks`) is evaluated on them; a row's padding
lengths are scalars read from global memory, its segment ids windows that TMA copies into shared memory.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._gpu.mosaic_support import load, taken
from jattn._gpu.tiles import Grid, _Local
from jattn._masks import EMPTY, Mask, RowPadding, RowSegments, map_slots

__all__ = ["Ids", "positions", "tile_keep", "unless_empty", "windows"]


def windows(mask: Mask, n_mask: int) -> tuple[str | None, ...]:
    """For each of the kernel's mask arrays: ``"q"`` / ``"kv"`` (segment ids, read by window), None (a length)."""
    out: list[str | None] = [None] * n_mask

    def note(slot: Mask) -> Mask:
        if slot.kind is RowSegments:
            out[slot.index], out[slot.index + 1] = "q", "kv"
        return slot

    map_slots(mask, note)
    return tuple(out)


class Ids:
    """The segment-id windows of one tile: each array's ``(bq,)`` or ``(bk,)`` ids copied into shared memory."""

    def __init__(self, refs, smem, barrier, kinds: tuple[str | None, ...], layout):
        self.refs, self.smem, self.barrier, self.kinds, self.layout = refs, smem, barrier, kinds, layout

    @classmethod
    def windowed(cls, refs, windows, barrier, kinds: tuple[str | None, ...], layout) -> Ids:
        """``Ids`` whose shared-memory ``windows`` belong, in order, to the arrays that have one (a kind not None)."""
        return cls(refs, dict(zip((n for n, w in enumerate(kinds) if w), windows, strict=True)), barrier, kinds, layout)

    def read(self, n: int, r, i, j, grid: Grid, transposed: bool = False, cols=None) -> Array:
        """Array ``n`` at row ``r``: a length (a scalar), or the tile's ids broadcast over it (transposed too).

        ``cols``: the tile's columns taken (a ``pl.ds``; None: all of them).
        """
        ref = self.refs[n]
        row = r if ref.shape[0] > 1 else 0
        if self.kinds[n] is None:
            return ref[row]
        q = self.kinds[n] == "q"
        at = pl.ds(i * grid.bq, grid.bq) if q else pl.ds(j * grid.bk, grid.bk)
        plgpu.commit_smem()  # the previous tile's loads of this window done before TMA overwrites it
        plgpu.copy_gmem_to_smem(ref.at[row, at], self.smem[n], self.barrier)
        plgpu.barrier_wait(self.barrier)
        first = q != transposed  # the ids run along the tile's first axis
        shape = _shape(grid, transposed, cols)
        ids = load(self.smem[n] if first else taken(self.smem[n], cols), self.layout.reduce(1 if first else 0))
        return lax.broadcast_in_dim(ids, shape, [0] if first else [1])


def _shape(grid: Grid, transposed: bool, cols) -> tuple[int, int]:
    """A tile's shape, ``(bq, bk)`` (transposed ``(bk, bq)``), or its rows by the ``cols`` taken."""
    rows, width = (grid.bk, grid.bq) if transposed else (grid.bq, grid.bk)
    return rows, width if cols is None else cols.size


def positions(grid: Grid, i, j, layout, transposed: bool = False, cols=None) -> tuple[Array, Array]:
    """The tile's grid positions: query ``t``, key ``s``, ``(bq, bk)`` (transposed ``(bk, bq)``), ``wgmma`` layout.

    ``cols``: the tile's columns taken (a ``pl.ds``; None: all of them).
    """
    t0, s0, c = i * grid.bq, j * grid.bk, 0 if cols is None else cols.start
    if c:  # the chunk's first column: a query (transposed) or a key
        t0, s0 = (t0 + c, s0) if transposed else (t0, s0 + c)
    shape = _shape(grid, transposed, cols)
    t = plgpu.broadcasted_iota(jnp.int32, shape, int(transposed), layout=layout) + t0
    s = plgpu.broadcasted_iota(jnp.int32, shape, 1 - int(transposed), layout=layout) + s0
    return t, s


def tile_keep(grid: Grid, ids: Ids, r, i, j, transposed: bool = False, cols=None) -> Array:
    """``(bq, bk)`` bool (``(bk, bq)`` transposed): the mask on tile ``(i, j)`` of row ``r``, on whole iotas.

    :func:`jattn._gpu.tiles.tile_mask`'s predicate, evaluated elementwise on the tile's positions (on the
    columns ``cols`` only, a ``pl.ds``, where given).
    """
    t, s = positions(grid, i, j, ids.layout, transposed, cols)
    read = functools.partial(ids.read, r=r, i=i, j=j, grid=grid, transposed=transposed, cols=cols)

    def local(slot: Mask) -> Mask:
        if slot.kind is RowPadding:
            ql, kl = read(slot.index), read(slot.index + 1)
            return _Local((t < ql) & (s < kl))
        if slot.kind is RowSegments:
            return _Local(read(slot.index) == read(slot.index + 1))
        raise AssertionError(f"no tile form for {slot.kind}")  # refused before (jattn._gpu.attention)

    return map_slots(grid.mask, local).allowed(grid.q_offset + t, grid.kv_offset + s)


def unless_empty(kinds_ref, r, i, j, tile, carry):
    """``tile(carry)`` on tile ``(i, j)`` of row ``r`` unless its kind is EMPTY (then ``carry``)."""
    kind = kinds_ref[r if kinds_ref.shape[0] > 1 else 0, i, j]
    return lax.cond(kind == EMPTY, lambda c: c, tile, carry)
