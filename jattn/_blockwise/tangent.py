"""The blockwise tangent (forward mode) of one group of rows: one sweep over its tiles with the lse known.

Shapes follow :mod:`jattn._core` with leading dimensions flattened to ``B``; a group is ``b`` of
its rows (:class:`jattn._blockwise.tile_loops.Rows`). With the saved ``lse`` a tile's weights are
``P = e^(x - lse)`` outright, so the tangent needs no running maximum: for tangents ``dq, dk, dv``
(and of a bias, a score modification's arrays and sinks) each tile adds

    dx = (dq kᵀ + q dkᵀ)·scale + d bias      (pushed through the score modification's jvp)
    A += (P∘M)·dv + (P∘dx∘M)·v,   c += rowsum(P∘dx)

(``M`` dropout's factor, 1 without), and the finished rows give ``d lse = c + e^(sink - lse)·d sink``
and ``d out = A - d lse · out``. Nothing of size T x S is kept: O(T) memory, like the forward.
Split tiles (:data:`jattn._masks.kinds.SPLIT_AREA`) are taken whole, masked. Rows with no key (lse
``-inf``) have tangents 0.
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
from jattn._blockwise.tile_ops import Tile, prescale
from jattn._online import per_block, scaled_scores
from jattn._softmax import exp_below_one

__all__ = ["tangent"]


class _Sweep(NamedTuple):
    """What the loops of one group's tangent read: whole ``(B, ...)`` operands and the group's rows.

    ``q, k, v`` and their tangents ``dq, dk, dv`` whole; ``rows (b, 2)``, ``seeds (b,)``, the
    scheduled key blocks ``index (nq, width)`` and their run-time ``kind (b|1, nq, width)``, the
    mask's ``arrays``, the ``bias`` and its tangent ``d_bias`` (or None), the modification's
    ``consts`` and their tangents; ``like``, what a loop's fresh state varies as under ``shard_map``.
    """

    q: Array
    k: Array
    v: Array
    dq: Array
    dk: Array
    dv: Array
    rows: Array
    seeds: Array
    kind: Array
    index: Array
    arrays: tuple[Array, ...]
    bias: Array | None
    d_bias: Array | None
    consts: tuple
    d_consts: tuple
    like: tuple[Array, ...]
    plan: Plan
    precision: Any
    group: Rows


def tangent(
    xs: tuple, rows, seeds, kind: Array, arrays: tuple, d_bias, consts, d_consts, plan: Plan, precision, group: Rows
) -> tuple[Array, Array]:
    """``d out (b, nq·bq, E)`` and ``d lse (b, nq·bq)`` of the group's b rows of B.

    ``xs = (q, k, v, dq, dk, dv, out, lse, sinks, d_sinks)``: the first six whole ``(B, ...)``,
    ``out`` (the compute dtype), ``lse``, ``sinks`` and ``d_sinks`` the group's; ``kind (b|1, nq, width)``
    and ``arrays`` (the mask's and the bias, :meth:`jattn._blockwise.plan.Plan.split`) the group's, ``d_bias``
    the bias's tangent (or None).
    """
    q, k, v, dq, dk, dv, out, lse, sinks, d_sinks = xs
    like = (q, k, v, dq, dk, dv, out, lse, rows, seeds, sinks, d_sinks, *arrays, *consts, *d_consts)
    arrays, bias = plan.split(arrays)
    index = jnp.asarray(plan.tiles.index)
    loops = _Sweep(q, k, v, dq, dk, dv, rows, seeds, kind, index, arrays, bias, d_bias, consts, d_consts, like, plan,
                   precision, group)  # fmt: skip
    finite = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), lse)  # empty rows have P = 0 by the mask anyway
    d_lse = _sweeps(loops, finite)
    d_out_acc, c = d_lse
    if plan.sinks:  # the sink joins lse: d lse += e^(sink - lse) d sink
        c = c + jnp.exp(sinks[:, None].astype(plan.compute) - finite) * d_sinks[:, None].astype(plan.compute)
    c = jnp.where(lse == -jnp.inf, jnp.zeros_like(c), c)
    return d_out_acc - c[..., None] * out.astype(plan.compute), c


def _sweeps(loops: _Sweep, lse: Array) -> tuple[Array, Array]:
    """``A (b, T, E)`` and ``c (b, T)`` of every query block: a loop over its key blocks each."""
    plan, b, e = loops.plan, loops.group.size, loops.v.shape[-1]
    t = plan.nq * plan.bq
    outs = vary((jnp.zeros((b, t, e), plan.compute), jnp.zeros((b, t), plan.compute)), *loops.like)
    block = functools.partial(_query_block, loops, lse)
    outs, _ = jax.lax.scan(block, outs, jnp.arange(plan.nq, dtype=jnp.int32))
    return outs


def _query_block(loops: _Sweep, lse: Array, outs: Tree, i: Array) -> tuple[Tree, None]:
    """``outs`` with query block i's ``A`` and ``c`` written: a loop over its key blocks from zero."""
    plan, group = loops.plan, loops.group
    qb, scale = prescale(plan, group.block(loops.q, i, plan.bq))
    dqb, _ = prescale(plan, group.block(loops.dq, i, plan.bq))
    lse_i = Rows(0, group.size).block(lse, i, plan.bq)  # lse is the group's already
    init = vary(
        (jnp.zeros((group.size, plan.bq, loops.v.shape[-1]), plan.compute), jnp.zeros((group.size, plan.bq), plan.compute)),
        *loops.like,
    )  # fmt: skip
    key_block = functools.partial(_key_block, loops, i, qb, dqb, scale, lse_i)
    acc = sweep(plan, key_block, init, i, loops.index, loops.kind, static=not loops.arrays)
    return tuple(put(x, i, plan.bq, y) for x, y in zip(outs, acc, strict=True)), None


def _key_block(
    loops: _Sweep, i: Array, qb: Array, dqb: Array, scale: float, lse: Array, carry: Tree, jk: tuple[Array, Array | int]
) -> tuple[Tree, None]:
    """The carry with tile (i, j) added, ``jk = (j, kind)``; split kinds are taken whole, masked."""
    j, kd = jk
    tile = Tile(loops.plan, i, j)
    whole = functools.partial(_tile, loops, tile, qb, dqb, scale, lse)
    splits = {kind: functools.partial(whole, masked=True) for kind in loops.plan.tiles.splits}
    return per_block(kd, whole, carry, *loops.plan.tiles.branches(not loops.arrays), splits), None


def _tile(loops: _Sweep, tile: Tile, qb, dqb, scale: float, lse: Array, carry: Tree, masked: bool) -> Tree:
    """``(A, c)`` with the tile's share: ``P = e^(x - lse)``, ``dx`` and their products with v and dv."""
    plan, group, precision = tile.plan, loops.group, loops.precision
    kb, dkb = group.block(loops.k, tile.j, plan.bk), group.block(loops.dk, tile.j, plan.bk)
    s, keep = tile.scores(qb, kb, masked, precision, loops.arrays, scale)
    ds = scaled_scores(dqb, kb, scale, plan.compute, precision) + scaled_scores(qb, dkb, scale, plan.compute, precision)
    s, ds = tile.biased(s, loops.bias), tile.biased(ds, loops.d_bias)
    mod = tile.modifier(loops.rows)
    if mod is not None:
        s, ds = jax.jvp(mod, (s, loops.consts), (ds, loops.d_consts))
    p = exp_below_one(s - lse[..., None])
    pds = p * ds
    if keep is not None:  # masked entries: P = 0, and no NaN from dx there
        zero = jnp.zeros((), plan.compute)
        p, pds = jnp.where(keep, p, zero), jnp.where(keep, pds, zero)
    a, c = carry
    drop = tile.dropped(loops.seeds)
    pm, pdsm = (p, pds) if drop is None else (p * drop, pds * drop)
    vb, dvb = group.block(loops.v, tile.j, plan.bk), group.block(loops.dv, tile.j, plan.bk)
    a = a + _dot(pm, dvb, plan.compute, precision) + _dot(pdsm, vb, plan.compute, precision)
    return a, c + jnp.sum(pds, -1)


def _dot(p: Array, vb: Array, compute, precision) -> Array:
    """``p (b, t, s) @ vb (b, s, E)`` accumulated in ``compute``."""
    return jnp.einsum("bts,bse->bte", p, vb.astype(compute), precision=precision, preferred_element_type=compute)
