"""Tile kinds: the EMPTY / PARTIAL / FULL codes and the classification of a mask's boxes and tiles.

The blockwise path computes some PARTIAL tiles in parts, each kind a code of its own beside these
(:data:`LOWER`, :data:`TOP_EMPTY`, :data:`STAIRS`: every tile code in one place).

A box of query positions ``[i0, i1]`` x key positions ``[j0, j1]`` (inclusive) is EMPTY where the
mask allows no pair in it, FULL where it allows every pair, PARTIAL otherwise (or where it cannot
tell). :func:`box_kinds` classifies boxes statically, from positions alone (what
:meth:`jattn.masks.Mask.block_kinds` does on a grid); :func:`row_kinds` classifies the tiles of a
mask in row form on device, one row of B·N at a time, and :func:`reduce_kinds` merges the rows.
The masks themselves classify through their ``_blocks`` (static) and ``_tiles`` (traced) methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax import Array

if TYPE_CHECKING:
    from jattn._masks.base import Mask

__all__ = [
    "EMPTY",
    "FULL",
    "LOWER",
    "PARTIAL",
    "SPLIT_AREA",
    "STAIRS",
    "TOP_EMPTY",
    "box_kinds",
    "grid_boxes",
    "reduce_kinds",
    "row_kinds",
]

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The kind of a PARTIAL tile whose top-right quarter (first half of its query rows, last half of
#: its keys) is empty, as on the diagonal of causal attention: computed as its two non-empty parts
#: (top rows against the first half of the keys, bottom rows against all of them), 3/4 of the tile.
LOWER = 3

#: The kinds of a PARTIAL tile whose first 1, 2 or 3 quarters of query rows are empty, as on the
#: causal diagonal of a tall tile (1024 x 128): only its last 3, 2 or 1 quarters are computed.
TOP_EMPTY = (4, 5, 6)

#: The kind of a PARTIAL tile whose quarters of query rows see only the first 1, 2, 3 and 4
#: quarters of its keys, as on the diagonal of big square tiles of causal attention (2048²): each
#: quarter of rows computed against its own keys, a staircase, 10/16 of the tile.
STAIRS = 7

#: The kinds computed in parts (the codes from LOWER up), and the share of the tile's area each computes.
SPLIT_AREA = {LOWER: 0.75, TOP_EMPTY[0]: 0.75, TOP_EMPTY[1]: 0.5, TOP_EMPTY[2]: 0.25, STAIRS: 0.625}


def grid_boxes(
    T: int, S: int, block_q: int, block_kv: int, q_offset: int, kv_offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(i0, i1, j0, j1)``: the inclusive position bounds of the tiles of ``(T, S)``, static offsets.

    ``i0``, ``i1`` ``(ceil(T/block_q), 1)`` bound each block of queries, ``j0``, ``j1``
    ``(1, ceil(S/block_kv))`` each block of keys; the last blocks stop at T and S.
    """
    i0 = q_offset + np.arange(0, T, block_q)[:, None]
    i1 = np.minimum(i0 + block_q, q_offset + T) - 1
    j0 = kv_offset + np.arange(0, S, block_kv)[None, :]
    j1 = np.minimum(j0 + block_kv, kv_offset + S) - 1
    return i0, i1, j0, j1


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


def row_kinds(mask: Mask, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int, kv_offset: int) -> Array:
    """``(R|1, ceil(T/block_q), ceil(S/block_kv))`` int8 EMPTY / PARTIAL / FULL per row, traced.

    ``mask`` is in row form (:meth:`Mask._rows`) with its arrays bound; static offsets.
    """
    boxes = grid_boxes(T, S, block_q, block_kv, q_offset, kv_offset)
    empty, full = mask._tiles(*boxes, (T, S, block_q, block_kv))
    kinds = jnp.where(full, jnp.int8(FULL), jnp.int8(PARTIAL))
    return jnp.where(empty, jnp.int8(EMPTY), kinds)


def reduce_kinds(kinds: Array) -> Array:
    """``(R, ...)`` kinds to one ``(...)``: EMPTY where every row is empty, FULL where every row is full."""
    empty, full = jnp.all(kinds == EMPTY, axis=0), jnp.all(kinds == FULL, axis=0)
    return jnp.where(empty, jnp.int8(EMPTY), jnp.where(full, jnp.int8(FULL), jnp.int8(PARTIAL)))
