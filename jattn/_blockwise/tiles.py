"""The blockwise path's tiles: which tiles a mask leaves, in what order they run, and their size.

A tile is ``bq`` query rows against ``bk`` keys. :func:`static_kinds` classifies every tile of a
call as EMPTY, PARTIAL or FULL (and marks the PARTIAL ones computed in parts: LOWER, TOP_EMPTY,
STAIRS, :mod:`jattn._masks.kinds`); :func:`schedule` lists each query block's non-empty key blocks,
FULL ones first; :func:`auto_block` chooses the tile with the least work from the measured costs
of :mod:`jattn._platform`, and :func:`choose_tiles` the forward's and the backward's tiles of a
call. Everything here runs on NumPy at trace time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jattn import _platform
from jattn._masks import (
    EMPTY,
    FULL,
    LOWER,
    PARTIAL,
    SPLIT_AREA,
    STAIRS,
    TOP_EMPTY,
    KeyBelow,
    Mask,
    box_kinds,
    query_offset,
)

__all__ = ["Schedule", "auto_block", "choose_tiles", "schedule", "static_kinds"]


def static_kinds(
    mask: Mask | None, T: int, S: int, bq: int, bk: int, q_offset: int, kv_offset: int, halve: bool
) -> np.ndarray:
    """``(nq, nk)`` int8 kinds of the tiles of ``bq`` x ``bk``, keys past S masked; split kinds marked when ``halve``.

    ``halve`` (tiles of :data:`SPLIT_MIN` and up) marks a PARTIAL tile whose top-right quarter is
    empty (even sides) as LOWER (:data:`jattn._masks.kinds.LOWER`), computed as its two non-empty parts,
    and one whose first 1-3 quarters of rows are empty (``bq`` a multiple of 4) as TOP_EMPTY
    (:data:`jattn._masks.kinds.TOP_EMPTY`), computed as its other rows; the latter wins where both hold.
    A PARTIAL tile of :data:`STAIRS_MIN` and up (sides multiples of 4) whose every quarter of rows
    sees only the keys up to its own quarter is STAIRS (:data:`jattn._masks.kinds.STAIRS`), computed as
    four parts; TOP_EMPTY wins there too.
    """
    nq, nk = -(-T // bq), -(-S // bk)
    limit = KeyBelow(kv_offset + S)  # keys past S (block padding) are masked
    full = limit if mask is None else mask & limit
    kinds = full.block_kinds(nq * bq, nk * bk, bq, bk, q_offset=q_offset, kv_offset=kv_offset)
    if not halve or min(bq, bk) < _platform.SPLIT_MIN:
        return kinds
    qi, kj = np.nonzero(kinds == PARTIAL)  # only partial tiles split: their corners are classified alone
    i0, j0 = q_offset + qi * bq, kv_offset + kj * bk  # each one's first query and key position

    def empty(rows: int, keys: slice) -> np.ndarray:  # its first rows against keys[0] .. keys[1] - 1, all masked?
        return box_kinds(full, i0, i0 + rows - 1, j0 + keys.start, j0 + keys.stop - 1) == EMPTY

    split = kinds[qi, kj]
    if bq % 2 == bk % 2 == 0:
        split = np.where(empty(bq // 2, slice(bk // 2, bk)), np.int8(LOWER), split)
    if (
        bq % 4 == bk % 4 == 0 and min(bq, bk) >= _platform.STAIRS_MIN
    ):  # quarter r of the rows sees keys < (r + 1) bk / 4
        stairs = [
            box_kinds(full, i0 + r * bq // 4, i0 + (r + 1) * bq // 4 - 1, j0 + (r + 1) * bk // 4, j0 + bk - 1)
            for r in range(3)
        ]
        split = np.where(np.all(np.stack(stairs) == EMPTY, axis=0), np.int8(STAIRS), split)
    if bq % 4 == 0:  # more empty quarters of rows win
        for n, kind in enumerate(TOP_EMPTY, start=1):
            split = np.where(empty(n * bq // 4, slice(0, bk)), np.int8(kind), split)
    kinds[qi, kj] = split
    return kinds


def schedule(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query block, its non-empty key blocks ``(nq, width)`` and their kinds (EMPTY = padding).

    A row's FULL tiles come first (in key order, then the others), so that a loop can take them
    without a branch (the blockwise sweep, :mod:`jattn._blockwise.tile_loops`).
    """
    width = max(1, int((kinds != EMPTY).sum(1).max()))
    index = np.zeros((kinds.shape[0], width), np.int32)
    kind = np.full((kinds.shape[0], width), EMPTY, np.int8)
    for i, row in enumerate(kinds):
        cols = np.flatnonzero(row != EMPTY)
        cols = cols[np.argsort(row[cols] != FULL, kind="stable")]
        index[i, : len(cols)] = cols
        kind[i, : len(cols)] = row[cols]
    return index, kind


class Schedule(NamedTuple):
    """A plan's tiles in the order they run (:func:`schedule`), and what the loops over them know statically.

    ``index`` and ``kind`` ``(nq, width)``: per query block, its non-empty key blocks (FULL ones
    first) and their kinds, EMPTY where a row is padding; ``count (nq,)`` int32 its scheduled key
    blocks and ``full (nq,)`` its FULL ones. ``uniform``: the kind of every scheduled tile where
    they have one (no branch), else None; ``kinds`` the kinds that occur (EMPTY: padding);
    ``splits`` the kinds computed in parts (:data:`jattn._masks.kinds.SPLIT_AREA`). ``lead``: on CPU,
    with static kinds, a loop without a branch takes each query block's FULL tiles first (the
    blockwise sweep, :mod:`jattn._blockwise.tile_loops`).
    """

    index: np.ndarray
    kind: np.ndarray
    count: np.ndarray
    full: np.ndarray
    uniform: int | None
    kinds: tuple[int, ...]
    splits: tuple[int, ...]
    lead: bool

    @classmethod
    def of(cls, kinds: np.ndarray, platform: str, unbranched: bool = True) -> Schedule:
        """The schedule of the tile kinds ``(nq, nk)`` (:func:`static_kinds`) on ``platform``.

        ``unbranched=False``: no loop of FULL tiles first (``lead``), as in a plan's reverse-differentiable loops.
        """
        splits = tuple(k for k in SPLIT_AREA if np.any(kinds == k))  # the kinds computed in parts
        index, kind = schedule(kinds)  # per query block: its key blocks
        count = (kind != EMPTY).sum(1).astype(np.int32)  # per query block: its scheduled key blocks
        full = (kind == FULL).sum(1).astype(np.int32)  # per query block: its FULL ones, scheduled first
        same = kind[0, 0] if np.all(kind == kind[0, 0]) else EMPTY
        uniform = None if same == EMPTY else int(same)  # every scheduled tile of one kind
        occur = tuple(int(x) for x in np.unique(kind))  # the kinds that occur (EMPTY: padding)
        # On CPU, with static kinds, a loop without a branch takes each query block's FULL tiles (sweep).
        lead = unbranched and platform == "cpu" and uniform is None and bool(full.any())
        return cls(index, kind, count, full, uniform, occur, splits, lead)

    def branches(self, static: bool) -> tuple[int | None, tuple[int, ...] | None]:
        """:func:`jattn._online.per_block`'s ``uniform`` and ``kinds``: known only with ``static`` kinds (no mask arrays).

        FULL is left out where the sweep takes those tiles in a loop of their own (``lead``).
        """
        if not static:
            return None, None
        return self.uniform, tuple(k for k in self.kinds if not (self.lead and k == FULL))


def auto_block(
    mask: Mask | None,
    T: int,
    S: int,
    q_offset: int | None,
    kv_offset: int,
    tiling: str | None = None,
    split: bool = True,
) -> tuple[int, int]:
    """The tile of ``TILINGS[tiling]`` (default :func:`jattn._platform.tiling`) with the least work on the mask's non-empty tiles.

    Work is ``tiles x tile area x cost of an entry``, a tile computed in parts (the causal
    diagonal: LOWER, TOP_EMPTY, STAIRS) at the share of its area they compute, ties to the first listed:
    full attention keeps the largest tile; causal attention and narrow sliding windows take
    smaller ones where they waste fewer masked entries. A mask with arrays (padding, documents)
    keeps to tiles of 512 and less, which its run-time kinds can skip (statically every tile they
    touch counts). ``split``: tiles may be computed in parts (no bias, score modification or
    dropout).
    """
    cost = _platform.TILINGS[_platform.tiling() if tiling is None else tiling]
    tiles = tuple(cost)
    if T == 0 or S == 0:  # no tiles
        return tiles[0]
    if mask is not None and (mask.has_arrays or mask.per_example):  # run-time kinds skip small tiles best
        tiles = tuple(t for t in tiles if max(t) <= 512)
    q_offset = query_offset(q_offset, kv_offset, T, S)

    def work(tile):
        bq, bk = min(tile[0], T), min(tile[1], S)
        kinds = static_kinds(mask, T, S, bq, bk, q_offset, kv_offset, halve=split)
        count = np.count_nonzero(kinds != EMPTY) - sum(
            (1 - a) * np.count_nonzero(kinds == k) for k, a in SPLIT_AREA.items()
        )
        return count * bq * bk * cost[tile]

    return min(tiles, key=work)


def choose_tiles(
    mask: Mask | None,
    T: int,
    S: int,
    q_offset: int | None,
    kv_offset: int,
    blocks: tuple[int, int] | None,
    split: bool,
) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The forward's tile ``(bq, bk)`` and the backward's (None: the forward's) of one call.

    ``blocks`` given (the caller's ``block_size``) fixes both. Otherwise :func:`auto_block`, and a
    backward whose sides are capped at :data:`jattn._platform.BACKWARD_SIDE` where the platform
    has an entry (several CPU threads). ``split`` as for :func:`auto_block`.
    """
    if blocks is not None:
        return blocks, None
    bq, bk = auto_block(mask, T, S, q_offset, kv_offset, split=split)
    side = _platform.BACKWARD_SIDE.get(_platform.tiling())
    return (bq, bk), None if side is None else (min(bq, side), min(bk, side))
