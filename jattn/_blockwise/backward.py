"""The blockwise backward of one group of rows: each tile's shares of dq, dk, dv in one sweep.

Shapes follow :mod:`jattn._core` with leading dimensions flattened to ``B``; a group is ``b`` of
its rows (:class:`jattn._blockwise.tile_loops.Rows`). Per query block (:func:`_query_block`), a loop over
its scheduled key blocks (:func:`jattn._blockwise.tile_loops.sweep`, :func:`_key_block`) recomputes each
tile's weights ``p`` from the saved ``lse`` and adds the tile's shares
(:func:`jattn._online.tile_grads`): whole (:func:`_tile`), or as its parts where its kind is
split (:func:`_parts`). dq stays in the query block's small carry, dk and dv, transposed, are
added into their key block of the group's ``(b, D|E, S)`` accumulators, in place; a bias's
gradient into its tile's window, the score modification's arrays' gradients summed.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._arrays import Tree, vary
from jattn._blockwise.plan import OWN, Plan
from jattn._blockwise.tile_loops import Rows, add_block, put, sweep
from jattn._blockwise.tile_ops import Tile, parts, prescale
from jattn._online import per_block, scaled_scores, score_grads, tile_grads, transposed

__all__ = ["backward"]


class _Sweep(NamedTuple):
    """What the loops of one group's backward read.

    ``q``, ``k``, ``v`` and ``d_out`` whole ``(B, ...)``, read through ``group``
    (:class:`jattn._blockwise.tile_loops.Rows`); the group's ``lse`` and ``delta`` ``(b, T)``, ``rows (b, 2)``
    and ``seeds (b,)``; the scheduled key blocks ``index (nq, width)`` and their run-time
    ``kind (b|1, nq, width)``; the mask's ``arrays`` ``(b|1, ...)``, the ``bias (b|1, T|1, S|1)``
    (or None) and the modification's ``consts``; ``scale`` the logit scale ``()``; ``like``, the
    inputs a loop's fresh state varies as under ``shard_map``.
    """

    q: Array
    k: Array
    v: Array
    d_out: Array
    lse: Array
    delta: Array
    rows: Array
    seeds: Array
    kind: Array
    index: Array
    arrays: tuple[Array, ...]
    bias: Array | None
    consts: tuple
    scale: Array
    like: tuple[Array, ...]
    plan: Plan
    precision: Any
    group: Rows


class _QueryBlock(NamedTuple):
    """What the backward's tiles of query block i read of its rows, sliced once per query block."""

    i: Array
    q: Array  # (b, bq, D) scaled (:func:`jattn._blockwise.tile_ops.prescale`)
    q_scale: float  # the scale prescale left for the scores
    d_out: Array  # (b, bq, E)
    lse: Array  # (b, bq)
    delta: Array  # (b, bq)
    qt: Array  # (b, D, bq): q (unscaled) transposed, for tile_grads
    dot: Array  # (b, E, bq): d_out transposed


def backward(
    q, k, v, d_out, lse, delta, rows, seeds, kind: Array, arrays, consts, plan: Plan, precision, group: Rows
) -> tuple:
    """``(dq (b, T, D), dk (b, S, D), dv (b, S, E))`` and the consts' gradients of the group's b rows of B.

    One sweep over the group's tiles; q, k, v and d_out are whole ``(B, ...)``, the rest the
    group's: ``lse`` and ``delta`` ``(b, T)`` as :func:`jattn._online.backward_rows` gives them.
    Returns ``((grads, own db), (dconsts, shared db))``: a bias with rows of its own comes back by
    rows, a shared one summed over the groups (:func:`jattn._blockwise.tile_loops.by_group`).
    """
    compute = plan.compute
    like = (q, k, v, d_out, lse, delta, rows, seeds, *arrays, *consts)  # a loop's fresh state varies as these
    arrays, bias = plan.split(arrays)
    index, scale = jnp.asarray(plan.tiles.index), jnp.asarray(plan.scale, compute)
    b = group.size
    loops = _Sweep(
        q, k, v, d_out, lse, delta, rows, seeds, kind, index, arrays, bias, consts, scale, like, plan, precision, group
    )
    db = () if bias is None else jnp.zeros(bias.shape, compute)
    carry = vary(
        (
            jnp.zeros((b, *q.shape[1:]), compute),
            jnp.zeros((b, k.shape[2], k.shape[1]), compute),
            jnp.zeros((b, v.shape[2], v.shape[1]), compute),
            jax.tree.map(jnp.zeros_like, consts),
            db,
        ),
        *like,
    )  # fmt: skip  dk and dv transposed, (b, D|E, S), as tile_grads gives them
    block = functools.partial(_query_block, loops)
    (dq, dk, dv, dc, db), _ = jax.lax.scan(block, carry, jnp.arange(plan.nq, dtype=jnp.int32))
    grads = dq.astype(q.dtype), transposed(dk).astype(k.dtype), transposed(dv).astype(v.dtype)
    db = () if bias is None else (db.astype(bias.dtype),)
    own = plan.bias == OWN  # a bias with rows of its own comes back by rows, a shared one summed over groups
    return ((grads, db), (dc, ())) if own else ((grads, ()), (dc, db))


def _query_block(loops: _Sweep, carry: Tree, i: Array) -> tuple[Tree, None]:
    """``(dq, dk, dv, dconsts, dbias)`` with query block i's tiles added: dq ``(b, T, D)`` gets block i's rows."""
    plan, group = loops.plan, loops.group
    qb, dob = group.block(loops.q, i, plan.bq), group.block(loops.d_out, i, plan.bq)  # (b, bq, D|E)
    whole = Rows(0, group.size)  # lse and delta are the group's already
    lse_i, delta_i = whole.block(loops.lse, i, plan.bq), whole.block(loops.delta, i, plan.bq)  # (b, bq)
    qb_scaled, s_scale = prescale(plan, qb)  # per query block: no scaled copy of all of q
    qt, dot = transposed(qb), transposed(dob)  # (b, D|E, bq), for tile_grads
    block = _QueryBlock(i, qb_scaled, s_scale, dob, lse_i, delta_i, qt, dot)
    dq_all, *rest = carry
    init = (vary(jnp.zeros((group.size, plan.bq, loops.q.shape[-1]), plan.compute), *loops.like), *rest)
    key_block = functools.partial(_key_block, loops, block)
    dq, dk, dv, dc, db = sweep(plan, key_block, init, i, loops.index, loops.kind, static=not loops.arrays)
    return (put(dq_all, i, plan.bq, dq), dk, dv, dc, db), None


def _key_block(loops: _Sweep, block: _QueryBlock, carry: Tree, jk: tuple[Array, Array | int]) -> tuple[Tree, None]:
    """The carry with tile (i, j)'s shares added, ``jk = (j, kind)``, by its kind (:func:`jattn._online.per_block`)."""
    plan, group, bias = loops.plan, loops.group, loops.bias
    j, kd = jk
    dq, dk, dv, dc, db = carry
    kb, vb = group.block(loops.k, j, plan.bk), group.block(loops.v, j, plan.bk)  # (b, bk, D|E)
    tile = Tile(plan, block.i, j)
    window = None if bias is None else tile.bias_window(bias)
    zeros = vary(
        (
            jnp.zeros_like(dq), jnp.zeros((*dk.shape[:2], plan.bk), plan.compute),
            jnp.zeros((*dv.shape[:2], plan.bk), plan.compute),
            jax.tree.map(jnp.zeros_like, dc),
            () if bias is None else jnp.zeros(window[1], plan.compute),
        ),
        *loops.like,
    )  # fmt: skip
    whole = functools.partial(_tile, loops, tile, block, kb, vb, window)
    splits = {kind: functools.partial(_parts, loops, tile, block, kb, vb, kind=kind) for kind in plan.tiles.splits}
    gq, gk, gv, gc, gb = per_block(kd, whole, zeros, *plan.tiles.branches(not loops.arrays), splits)
    dc = jax.tree.map(jnp.add, dc, gc)
    if bias is not None:
        db = jax.lax.dynamic_update_slice(db, jax.lax.dynamic_slice(db, *window) + gb, window[0])
    dk, dv = add_block(dk, j, plan.bk, gk), add_block(dv, j, plan.bk, gv)
    return (dq + gq, dk, dv, dc, db), None


def _tile(loops: _Sweep, tile: Tile, block: _QueryBlock, kb: Array, vb: Array, window, _: Tree, masked: bool) -> tuple:
    """The whole tile's ``(dq (b, bq, D), dkᵀ (b, D, bk), dvᵀ (b, E, bk), dconsts, dbias)``.

    ``kb (b, bk, D)``, ``vb (b, bk, E)`` are key block j's, ``window`` the tile's in the bias
    (:meth:`jattn._blockwise.tile_ops.Tile.bias_window`; None without one); bias, modification and dropout included.
    """
    compute, precision, bias = tile.plan.compute, loops.precision, loops.bias
    s, keep = tile.scores(block.q, kb, masked, precision, loops.arrays, block.q_scale)
    s = tile.biased(s, bias)
    mod = tile.modifier(loops.rows)
    p, ds, gc, dx = score_grads(
        s, keep, block.lse, block.d_out, vb, block.delta, loops.scale, precision, compute, mod, loops.consts,
        tile.dropped(loops.seeds),
    )  # fmt: skip
    if bias is None:
        gb = ()
    else:  # the tile's dx summed over the axes where the bias broadcasts
        axes = tuple(a for a, n in enumerate(window[1]) if n == 1 and dx.shape[a] != 1)
        gb = jnp.sum(dx, axes, keepdims=True) if axes else dx
    return (*tile_grads(p, ds, block.qt, kb, block.dot, precision, compute), gc, gb)


def _parts(loops: _Sweep, tile: Tile, block: _QueryBlock, kb: Array, vb: Array, zeros: tuple, kind: int) -> tuple:
    """A tile's shares as its parts' (:func:`jattn._blockwise.tile_ops.parts`; no modification, bias or dropout here)."""
    plan, compute, precision = tile.plan, tile.plan.compute, loops.precision
    keep, gq, (zq, gk, gv, gc, gb) = tile.allowed(loops.arrays), [], zeros
    for r, c in parts(kind, plan.bq, plan.bk):
        if c is None:  # rows not computed: no share of dq
            gq.append(zq[:, r])
            continue
        s = scaled_scores(block.q[:, r], kb[:, c], block.q_scale, compute, precision)
        p, ds, _, _ = score_grads(
            s, keep[:, r, c], block.lse[:, r], block.d_out[:, r], vb[:, c], block.delta[:, r], loops.scale,
            precision, compute,
        )  # fmt: skip
        dq_r, dk_c, dv_c = tile_grads(p, ds, block.qt[..., r], kb[:, c], block.dot[..., r], precision, compute)
        gq.append(dq_r)
        gk, gv = gk.at[..., c].add(dk_c), gv.at[..., c].add(dv_c)
    return jnp.concatenate(gq, axis=1), gk, gv, gc, gb
