"""The blockwise forward of one group of rows: an online softmax over each query block's key blocks.

Shapes follow :mod:`jattn._core` with leading dimensions flattened to ``B``; a group is ``b`` of
its rows (:class:`jattn._blockwise.tile_loops.Rows`). Per query block (:func:`_query_block`) a loop over
its scheduled key blocks (:func:`jattn._blockwise.tile_loops.sweep`) folds each tile into the running
state (:func:`jattn._online.accumulate`): whole (:func:`_tile`), or as its parts where its kind
is split (:func:`_parts`); the block's finished rows are written into the group's outputs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._arrays import Tree, vary
from jattn._blockwise.plan import Plan
from jattn._blockwise.tile_loops import Rows, put, sweep
from jattn._blockwise.tile_ops import Tile, parts, prescale
from jattn._online import accumulate, empty_state, finish, per_block, scaled_scores

__all__ = ["forward"]


class _Sweep(NamedTuple):
    """What the loops of one group's forward read.

    ``q``, ``k``, ``v`` whole ``(B, ...)``, read through ``group`` (:class:`jattn._blockwise.tile_loops.Rows`);
    the group's ``rows (b, 2)``, ``seeds (b,)`` and ``sinks (b,)``; the scheduled key blocks
    ``index (nq, width)`` and their run-time ``kind (b|1, nq, width)``; the mask's ``arrays``
    ``(b|1, ...)``, the ``bias (b|1, T|1, S|1)`` (or None) and the modification's ``consts``;
    ``like``, the inputs a loop's fresh state varies as under ``shard_map``.
    """

    q: Array
    k: Array
    v: Array
    rows: Array
    seeds: Array
    sinks: Array
    kind: Array
    index: Array
    arrays: tuple[Array, ...]
    bias: Array | None
    consts: tuple
    like: tuple[Array, ...]
    plan: Plan
    precision: Any
    group: Rows


def forward(
    q, k, v, rows, seeds, sinks, kind: Array, arrays: tuple[Array, ...], consts, plan: Plan, precision, group: Rows
) -> tuple[Array, Array, Array]:
    """``out (b, nq·bq, E)``, ``lse`` and max logit ``(b, nq·bq)`` of the group's b rows of B.

    Per query block, a loop over its key blocks (:func:`jattn._blockwise.tile_loops.sweep`); q, k, v are
    whole ``(B, ...)``, the rest the group's: ``rows (b, 2)``, ``seeds (b,)``, ``sinks (b,)``,
    ``kind (b|1, nq, width)`` and the kernels' ``arrays`` (the mask's and the bias, :meth:`Plan.split`).
    """
    like = (q, k, v, rows, seeds, sinks, *arrays, *consts)  # a loop's fresh state varies as these under shard_map
    arrays, bias = plan.split(arrays)
    index = jnp.asarray(plan.tiles.index)
    b, e = group.size, v.shape[-1]
    loops = _Sweep(q, k, v, rows, seeds, sinks, kind, index, arrays, bias, consts, like, plan, precision, group)
    t = plan.nq * plan.bq
    outs = vary(
        (jnp.zeros((b, t, e), plan.compute), jnp.zeros((b, t), plan.compute), jnp.zeros((b, t), plan.compute)), *like
    )
    block = functools.partial(_query_block, loops)
    outs, _ = jax.lax.scan(block, outs, jnp.arange(plan.nq, dtype=jnp.int32))  # written block by block
    return outs


def _query_block(loops: _Sweep, outs: Tree, i: Array) -> tuple[Tree, None]:
    """``outs`` with query block i's rows written: a loop over its key blocks from the empty state, then finished."""
    plan, group = loops.plan, loops.group
    qb, scale = prescale(plan, group.block(loops.q, i, plan.bq))  # per query block: no scaled copy of all of q
    init = vary(empty_state(group.size, plan.bq, loops.v.shape[-1], plan.compute), *loops.like)
    key_block = functools.partial(_key_block, loops, i, qb, scale)
    state = sweep(plan, key_block, init, i, loops.index, loops.kind, static=not loops.arrays)
    sink = loops.sinks[:, None].astype(plan.compute) if plan.sinks else None
    done = finish(state, plan.compute, sink)  # float32 (or 64): the backward's delta needs it unrounded
    return tuple(put(x, i, plan.bq, y) for x, y in zip(outs, done, strict=True)), None


def _key_block(
    loops: _Sweep, i: Array, qb: Array, scale: float, carry: Tree, jk: tuple[Array, Array | int]
) -> tuple[Tree, None]:
    """The state with tile (i, j) folded in, ``jk = (j, kind)``, by its kind (:func:`jattn._online.per_block`).

    ``qb (b, bq, D)`` is query block i prescaled (:func:`jattn._blockwise.tile_ops.prescale`), ``scale`` what it left.
    """
    j, kd = jk
    tile = Tile(loops.plan, i, j)
    whole = functools.partial(_tile, loops, tile, qb, scale)
    splits = {kind: functools.partial(_parts, loops, tile, qb, scale, kind=kind) for kind in loops.plan.tiles.splits}
    return per_block(kd, whole, carry, *loops.plan.tiles.branches(not loops.arrays), splits), None


def _tile(loops: _Sweep, tile: Tile, qb: Array, scale: float, carry: Tree, masked: bool) -> Tree:
    """The state with the whole tile folded in: scores ``(b, bq, bk)``, bias, modification, mask and dropout."""
    plan, group, precision = tile.plan, loops.group, loops.precision
    s, keep = tile.scores(qb, group.block(loops.k, tile.j, plan.bk), masked, precision, loops.arrays, scale)
    s = tile.biased(s, loops.bias)
    mod = tile.modifier(loops.rows)
    s = s if mod is None else mod(s, loops.consts)
    drop = tile.dropped(loops.seeds)
    return accumulate(carry, s, keep, group.block(loops.v, tile.j, plan.bk), precision, plan.compute, drop)


def _parts(loops: _Sweep, tile: Tile, qb: Array, scale: float, carry: Tree, kind: int) -> Tree:
    """A tile as its parts (:func:`jattn._blockwise.tile_ops.parts`), each row's state updated by its own part (or kept)."""
    plan, group, precision = tile.plan, loops.group, loops.precision
    kb, vb = group.block(loops.k, tile.j, plan.bk), group.block(loops.v, tile.j, plan.bk)
    keep = tile.allowed(loops.arrays)
    done = []
    for r, c in parts(kind, plan.bq, plan.bk):
        state = tuple(x[:, r] for x in carry)
        if c is not None:
            s = scaled_scores(qb[:, r], kb[:, c], scale, plan.compute, precision)
            state = accumulate(state, s, keep[:, r, c], vb[:, c], precision, plan.compute)
        done.append(state)
    return tuple(jnp.concatenate(xs, axis=1) for xs in zip(*done, strict=True))
