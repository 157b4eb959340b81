"""The plan of one blockwise call: its frozen key, what follows from it, and the traced tile kinds.

A :class:`Plan` is a static (hashable) argument of the blockwise custom VJP and the key of its
kernels' cache (:mod:`jattn._blockwise.attention`). Its fields are the facts the traced program depends on:
sizes ``T``, ``S`` and tiles ``bq`` x ``bk``, the mask's skeleton, offsets, scale, compute dtype,
platform and threads, the score modification, sinks, bias, dropout and the fused forward's key
interval; two calls whose plans compare equal trace the same program. What follows from them
(the mask at these sizes, the tile schedule :class:`jattn._blockwise.tiles.Schedule`) is computed once per
plan, outside the key. :class:`Run` is the traced rest: the mask's arrays and the run-time kinds
of the scheduled tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn import _platform
from jattn._blockwise.tiles import Schedule, static_kinds
from jattn._masks import EMPTY, LOWER, KeyBelow, Mask, fill_arrays, row_kinds, shared_arrays

__all__ = ["OWN", "SHARED", "Plan", "Run"]

SHARED, OWN = 1, 2  # a bias (1, T|1, S|1) shared by every row of B, or one (B, T|1, S|1)


class Run(NamedTuple):
    """The traced part of a plan: the mask's arrays and the run-time kinds of the scheduled tiles.

    ``kind (B|1, nq, width)`` refines the static schedule's kinds, row by row, with what the
    arrays say (EMPTY tiles are skipped on device); ``arrays`` are the mask's array leaves in row
    form (:meth:`jattn._masks.base.Mask._rows`), each ``(B|1, ...)``: boolean ``(B|1, T|1, S|1)``,
    padding lengths ``(B|1,)``, segment ids ``(B|1, T)`` and ``(B|1, S)``; empty without them.
    """

    kind: Array
    arrays: tuple[Array, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Static facts of one call: sizes, tiles, the mask's skeleton and the rest of the key (hashable).

    Array leaves of the mask are slots here (:func:`jattn._masks.skeleton.split_arrays`): statically
    every tile they touch is scheduled, and :class:`Run` carries their arrays and run-time kinds.
    """

    T: int
    S: int
    bq: int
    bk: int
    mask: Mask | None  # the skeleton (None: no mask)
    q_offset: int
    kv_offset: int
    scale: float
    compute: jnp.dtype
    platform: str
    threads: int
    mod: Callable | None = None  # the closure-converted score_mod (or None)
    sinks: bool = False  # whether rows have sinks
    bias: int = 0  # 0, or the last of the kernels' arrays is a bias with SHARED or OWN rows
    dropout: float = 0.0  # the dropout rate (0.0: none)
    fused: tuple[int, int] | None = None  # (left, right): the forward is the fused CPU kernel's for this key interval
    remat: bool = False  # loops of static length with checkpointed bodies: reverse-differentiable (second order)
    kv_group: int = (
        1  # rows of q a row of k and v serves: grouped heads, k and v unrepeated (fused plans; see _blockwise)
    )

    @property
    def nq(self) -> int:
        """Query blocks: ``T`` over ``bq``, rounded up."""
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        """Key blocks: ``S`` over ``bk``, rounded up."""
        return -(-self.S // self.bk)

    @functools.cached_property
    def predicate(self) -> Mask:
        """The mask with keys past S (block padding) masked by a "key position < kv_offset + S" predicate."""
        limit = KeyBelow(self.kv_offset + self.S)
        return limit if self.mask is None else self.mask & limit

    @functools.cached_property
    def tiles(self) -> Schedule:
        """The tile schedule; tiles computed in parts only without a modification, bias or dropout."""
        halve = self.mod is None and not self.bias and not self.dropout
        kinds = static_kinds(self.mask, self.T, self.S, self.bq, self.bk, self.q_offset, self.kv_offset, halve=halve)
        return Schedule.of(kinds, self.platform, unbranched=not self.remat)

    @functools.cached_property
    def shared(self) -> tuple[int, ...]:
        """The mask arrays every row shares (:func:`jattn._masks.skeleton.shared_arrays`): they never fold under vmap."""
        return shared_arrays(self.mask)

    def group(self, b: int) -> int:
        """Rows of a leading axis of ``b`` per tile on this plan's platform and threads (:func:`jattn._platform.group_size`)."""
        return _platform.group_size(b, self.bq, self.bk, jnp.dtype(self.compute).itemsize, self.platform, self.threads)

    def predicate_with(self, arrays: tuple[Array, ...]) -> Mask:
        """The mask with its arrays put back and placed at this call's offsets."""
        return fill_arrays(self.predicate, arrays)._bind(self.q_offset, self.kv_offset)

    def split(self, arrays: tuple[Array, ...]) -> tuple[tuple[Array, ...], Array | None]:
        """The kernels' arrays as the mask's arrays and the bias ``(b|1, T|1, S|1)`` (or None)."""
        return (arrays[:-1], arrays[-1]) if self.bias else (arrays, None)

    def run(self, arrays: tuple[Array, ...]) -> Run:
        """The traced schedule kinds: the static ones, refined on device per row where the mask has arrays."""
        tiles = self.tiles
        if not arrays:
            return Run(jnp.asarray(tiles.kind)[None], ())
        kinds = row_kinds(
            self.predicate_with(arrays),
            self.nq * self.bq,
            self.nk * self.bk,
            self.bq,
            self.bk,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
        )  # (B|1, nq, nk)
        rows = np.arange(tiles.index.shape[0])[:, None]  # padding entries of the schedule stay EMPTY
        static = jnp.asarray(tiles.kind)[None]  # (1, nq, width)
        kind = kinds[:, rows, tiles.index]  # (B|1, nq, width)
        kind = jnp.where((static >= LOWER) & (kind != EMPTY), static, kind)  # a split tile is never FULL
        return Run(jnp.where(static == EMPTY, jnp.int8(EMPTY), kind), arrays)
