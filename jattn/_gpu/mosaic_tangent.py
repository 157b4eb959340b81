"""The Mosaic GPU tangent kernels (forward mode): the forward and its tangent in one sweep, or the tangent from ``lse``.

Operands as :func:`jattn._gpu.kernels.forward_tangent`'s and :func:`jattn._gpu.kernels.tangent`'s (dimension
key in :mod:`jattn._core`): q, k, v and their tangents dq ``(b, Tp, Dp)``, dk ``(b/G, Sp, Dp)``, dv ``(b/G, Sp,
Ep)``, the sinks' ``(b,)``. Each tile's scores ``x`` and their tangent ``dx = (dq k^T + q dk^T) scale`` are
tensor-core products of shared-memory tiles; the sweep accumulates ``sum p dx v + p dv`` and ``d lse = sum p dx``
(the weights ``p`` from the online softmax in one sweep, or ``exp(x - lse)`` from the forward's ``lse``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._gpu.mosaic_mod import check_mod, dropped, modified_jvp, row_values
from jattn._gpu.mosaic_support import (
    acc_add,
    acc_chunks,
    acc_scratch,
    acc_zero,
    depth,
    launch,
    load,
    over_columns,
    scores,
    spread,
    swizzled,
    taken,
    target,
)
from jattn._gpu.mosaic_tile import Ids, positions, tile_keep, unless_empty, windows
from jattn._masks import PARTIAL

__all__ = ["forward_tangent", "tangent"]

_NEG = -float("inf")


def _tile(spec, fixed: bool, refs, r, i, j, carry):
    """Tile ``(i, j)``'s steps (one, or one a column chunk): ``(max, denominator, acc, tangent acc, d lse)``.

    The accumulators are None where they are in tensor memory (``tmems``, Blackwell), and ``acc`` where ``fixed``.
    """
    g, (q_s, dq_s, k_s, v_s, dk_s, dv_s, bars, tmems), gm = spec.grid, *refs
    k_ref, v_ref, dk_ref, dv_ref, kinds_ref, ids, row = gm
    seed, values, dvalues = row
    at = (lax.div(r, spec.G), pl.ds(j * g.bk, g.bk))
    for (src, dst), bar in zip(((k_ref, k_s), (v_ref, v_s), (dk_ref, dk_s), (dv_ref, dv_s)), bars, strict=True):
        plgpu.copy_gmem_to_smem(src.at[at], dst, bar)
    for bar in bars:
        plgpu.barrier_wait(bar)

    def keys(cols, carry):  # the keys cols of the tile (all of them on Hopper)
        x = scores(spec, q_s, k_s, cols) * spec.scale
        dx = scores(spec, dq_s, k_s, cols, plus=(q_s, dk_s)) * spec.scale  # one accumulator for both
        t, s = positions(g, i, j, ids.layout, cols=cols)
        x, dx = modified_jvp(spec, x, dx, g.q_offset + t, g.kv_offset + s, values, dvalues)

        def keep(xs):
            kept = tile_keep(g, ids, r, i, j, cols=cols)
            return jnp.where(kept, xs[0], _NEG), jnp.where(kept, xs[1], 0.0)

        kind = kinds_ref[r if kinds_ref.shape[0] > 1 else 0, i, j]
        x, dx = lax.cond(kind == PARTIAL, keep, lambda xs: xs, (x, dx))
        m, den, acc, tacc, dlse = carry
        top = m if fixed else jnp.maximum(m, x.max(axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)
        p, alpha = jnp.exp(x - spread(safe, x.shape)), (1.0 if fixed else jnp.exp(m - safe))
        pdx, pz, dt = p * dx, dropped(spec, seed, t, s, p), v_s.dtype  # d lse sums the undropped weights' tangents
        sums = lambda: ((den if fixed else alpha * den + p.sum(axis=1)), alpha * dlse + pdx.sum(axis=1))  # noqa: E731
        early = sums() if tmems[1] is not None else None  # in tensor memory: p freed before the products
        v_cols, dv_cols = taken(v_s, cols), taken(dv_s, cols)
        tacc = acc_add(spec, tacc, tmems[1], (pz * dx).astype(dt), v_cols, None if fixed else alpha)
        tacc = acc_add(spec, tacc, tmems[1], pz.astype(dt), dv_cols)
        acc = acc if fixed else acc_add(spec, acc, tmems[0], pz.astype(dt), v_cols, alpha)
        den, dlse = early or sums()
        return top, den, acc, tacc, dlse

    return over_columns(spec, g.bk, keys, carry)


def _sweep(spec, fixed, scratch, gm, r, i, init):
    """Copies the query block and its tangent in, then runs :func:`_tile` over the non-empty key blocks."""
    g = spec.grid
    (
        (q_s, dq_s, k_s, v_s, dk_s, dv_s, bars, bar_ids, id_s, tmems),
        (q_ref, dq_ref, k_ref, v_ref, dk_ref, dv_ref, kinds_ref, bounds_ref, masks, kinds_of, row),
    ) = scratch, gm
    rows = pl.ds(i * g.bq, g.bq)
    plgpu.copy_gmem_to_smem(q_ref.at[r, rows], q_s, bars[0])
    plgpu.copy_gmem_to_smem(dq_ref.at[r, rows], dq_s, bars[1])
    plgpu.barrier_wait(bars[0])
    plgpu.barrier_wait(bars[1])
    ids = Ids.windowed(masks, id_s, bar_ids, kinds_of, target(spec).layout)
    refs = ((q_s, dq_s, k_s, v_s, dk_s, dv_s, bars, tmems), (k_ref, v_ref, dk_ref, dv_ref, kinds_ref, ids, row))
    kr = r if kinds_ref.shape[0] > 1 else 0
    tile = functools.partial(_tile, spec, fixed, refs, r, i)
    step = lambda j, c: unless_empty(kinds_ref, r, i, j, functools.partial(tile, j), c)  # noqa: E731
    return lax.fori_loop(bounds_ref[kr, i, 0], bounds_ref[kr, i, 1], step, init)


def _split(spec, refs, seeds_ref, n_out: int) -> tuple:
    """``(masks, (seed, values, dvalues) of row r, outputs, scratch)`` from the refs after the seeds."""
    nm, nc, nf = spec.n_mask, spec.mod_count, 0 if spec.mod is None else sum(spec.mod.floats)
    r = lax.axis_index("r")
    masks, consts, dconsts, refs = refs[:nm], refs[nm : nm + nc], refs[nm + nc : nm + nc + nf], refs[nm + nc + nf :]
    return masks, (seeds_ref[r], row_values(consts, r), row_values(dconsts, r)), refs[:n_out], refs[n_out:]


def _init(spec, width: int, m, tmems, fixed: bool) -> tuple:
    """The sweep's first carry: ``(m, 0, acc 0 (None where fixed), tangent acc 0, 0)`` (:func:`_tile`)."""
    g, L = spec.grid, target(spec).layout
    rows = plgpu.layout_cast(jnp.zeros((g.bq,), jnp.float32), L.reduce(1))
    acc = None if fixed else acc_zero(spec, tmems[0], (g.bq, width))
    return m, rows, acc, acc_zero(spec, tmems[1], (g.bq, width)), rows


def _sink(spec, sinks_ref, dsinks_ref, r, lse, dlse):
    """``d lse`` with the sink's share ``exp(sink - lse) d sink`` (lse is finite with a sink)."""
    return dlse + jnp.exp(sinks_ref[r] - lse) * dsinks_ref[r] if spec.sinks else dlse


def _store(pairs, rows, written=()) -> None:
    """Values into shared tiles, then TMA copies of them and of the ``written`` ``(tile, output)`` to their rows."""
    for value, smem, _ in pairs:
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for smem, ref in (*written, *((smem, ref) for _, smem, ref in pairs)):
        plgpu.copy_smem_to_gmem(smem, ref.at[rows])
    plgpu.wait_smem_to_gmem(0)


def _one_pass_kernel(spec, kinds_of, n_tmem, *refs):
    """One query block: ``o``, ``lse``, the max logit, ``d o`` and ``d lse`` in one sweep.

    ``n_tmem``: 2 where the accumulators are in tensor memory (Blackwell, the first scratch), else 0.
    """
    g = spec.grid
    q_ref, k_ref, v_ref, dq_ref, dk_ref, dv_ref, kinds_ref, bounds_ref, sinks_ref, dsinks_ref, seeds_ref, *refs = refs
    masks, row, outs, refs = _split(spec, refs, seeds_ref, 5)
    tmems, refs = (tuple(refs[:2]) if n_tmem else (None, None)), refs[n_tmem:]
    q_s, dq_s, ((k_s, v_s, dk_s, dv_s), (o_s, do_s, lse_s, top_s, dlse_s)), *bars = refs[:8]
    r, i = lax.axis_index("r"), lax.axis_index("i")
    gm = (q_ref, dq_ref, k_ref, v_ref, dk_ref, dv_ref, kinds_ref, bounds_ref, masks, kinds_of, row)
    scratch = (q_s, dq_s, k_s, v_s, dk_s, dv_s, bars[:4], bars[4], refs[8:], tmems)
    m0 = plgpu.layout_cast(jnp.full((g.bq,), _NEG, jnp.float32), target(spec).layout.reduce(1))
    m, den, acc, tacc, dlse = _sweep(spec, False, scratch, gm, r, i, _init(spec, o_s.shape[1], m0, tmems, False))
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), _NEG)
    if spec.sinks:
        top = jnp.maximum(lse, sinks_ref[r])
        lse = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sinks_ref[r] - top))
    weight = jnp.where(seen, jnp.exp(m - jnp.where(seen, lse, 0.0)), 0.0)
    o_ref, lse_ref, top_ref, do_ref, dlse_ref = outs
    rows, stats = pl.ds(i * g.bq, g.bq), ((lse, lse_s, lse_ref.at[r]), (m, top_s, top_ref.at[r]))
    if tmems[0] is None:  # in registers
        o = acc * spread(weight, acc.shape)
        dlse = _sink(spec, sinks_ref, dsinks_ref, r, lse, dlse * weight)
        do = tacc * spread(weight, acc.shape) - spread(dlse, acc.shape) * o
        _store(((o, o_s, o_ref.at[r]), *stats, (do, do_s, do_ref.at[r]), (dlse, dlse_s, dlse_ref.at[r])), rows)
        return
    dlse = _sink(spec, sinks_ref, dsinks_ref, r, lse, dlse * weight)
    for (part, a), (_, ta) in zip(acc_chunks(acc, tmems[0]), acc_chunks(tacc, tmems[1]), strict=True):
        o = a * spread(weight, a.shape)
        o_s.at[:, part][...] = o.astype(o_s.dtype)
        do_s.at[:, part][...] = (ta * spread(weight, a.shape) - spread(dlse, a.shape) * o).astype(do_s.dtype)
    _store((*stats, (dlse, dlse_s, dlse_ref.at[r])), rows, ((o_s, o_ref.at[r]), (do_s, do_ref.at[r])))


def _tangent_kernel(spec, kinds_of, n_tmem, *refs):
    """One query block: ``sum p dx v + p dv`` ``(bq, Ep)`` float32 and ``d lse`` from the forward's ``lse``.

    ``n_tmem``: 1 where the accumulator is in tensor memory (Blackwell, the first scratch), else 0.
    """
    g = spec.grid
    (
        q_ref,
        k_ref,
        v_ref,
        lse_ref,
        dq_ref,
        dk_ref,
        dv_ref,
        kinds_ref,
        bounds_ref,
        sinks_ref,
        dsinks_ref,
        seeds_ref,
        *refs,
    ) = refs
    masks, row, (acc_ref, dlse_ref), refs = _split(spec, refs, seeds_ref, 2)
    tmems, refs = (None, refs[0] if n_tmem else None), refs[n_tmem:]
    q_s, dq_s, ((k_s, v_s, dk_s, dv_s), (acc_s, dlse_s), (lse_s,)), *bars = refs[:9]
    r, i = lax.axis_index("r"), lax.axis_index("i")
    plgpu.copy_gmem_to_smem(lse_ref.at[r, pl.ds(i * g.bq, g.bq)], lse_s, bars[5])
    plgpu.barrier_wait(bars[5])
    lse = load(lse_s, target(spec).layout.reduce(1))
    plgpu.commit_smem()  # lse read before TMA writes the key tiles over it (they share its memory)
    lse = jnp.where(lse == _NEG, jnp.inf, lse)  # a row that sees no key: weights 0
    gm = (q_ref, dq_ref, k_ref, v_ref, dk_ref, dv_ref, kinds_ref, bounds_ref, masks, kinds_of, row)
    scratch = (q_s, dq_s, k_s, v_s, dk_s, dv_s, bars[:4], bars[4], refs[9:], tmems)
    _, _, _, tacc, dlse = _sweep(spec, True, scratch, gm, r, i, _init(spec, acc_s.shape[1], lse, tmems, True))
    dlse = _sink(spec, sinks_ref, dsinks_ref, r, lse, dlse)
    for part, x in acc_chunks(tacc, tmems[1]):
        acc_s.at[:, part][...] = x
    _store(((dlse, dlse_s, dlse_ref.at[r]),), pl.ds(i * g.bq, g.bq), ((acc_s, acc_ref.at[r]),))


def _operands(spec, q, k, v, dq, dk, dv, outputs: tuple, before: tuple = ()):
    """The six operands widened for ``wgmma`` (:func:`jattn._gpu.mosaic_support.depth`), the tiles and id scratch.

    The tiles: q's and dq's, then one union of the key tiles (k, v, dk, dv) with the ``outputs``' staging tiles
    and the tiles read ``before`` the loop: the outputs are written once the key loop is done with its tiles, so
    they share its shared memory (without it the jvp at D = E = 256 needs more than a block's 227 KiB).
    """
    g, Dw, Ew = spec.grid, depth(spec.Dp), depth(spec.Ep)
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[-1])))  # noqa: E731
    ops = (pad(q, Dw), pad(k, Dw), pad(v, Ew), pad(dq, Dw), pad(dk, Dw), pad(dv, Ew))
    keys = tuple(swizzled(s, q.dtype) for s in ((g.bk, Dw), (g.bk, Ew), (g.bk, Dw), (g.bk, Ew)))
    union = plgpu.RefUnion(keys, outputs, *((before,) if before else ()))
    tiles = [swizzled((g.bq, Dw), q.dtype), swizzled((g.bq, Dw), q.dtype), union]
    kinds_of = windows(g.mask, spec.n_mask)
    ids = [plgpu.SMEM((g.bq if w == "q" else g.bk,), jnp.int32) for w in kinds_of if w]
    return ops, tiles, kinds_of, ids


def forward_tangent(spec, q, k, v, dq, dk, dv, kinds, bounds, sinks, seeds, dsinks, masks, consts, dconsts) -> list:
    """``[o, lse, max logit, d o, d lse]`` as :func:`jattn._gpu.kernels.forward_tangent`, on Mosaic GPU."""
    check_mod(spec)
    g, b = spec.grid, q.shape[0]
    row = plgpu.SMEM((g.bq,), jnp.float32)
    staged = [*(swizzled((g.bq, depth(spec.Ep)), v.dtype) for _ in "od"), row, row, row]  # o, d o, lse, top, d lse
    (q, k, v, dq, dk, dv), tiles, kinds_of, ids = _operands(spec, q, k, v, dq, dk, dv, tuple(staged))
    o = jax.ShapeDtypeStruct((b, g.t_pad, v.shape[2]), v.dtype)
    rows = jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32)
    tmem = acc_scratch(spec, *((g.bq, depth(spec.Ep)),) * 2)  # Blackwell: o's and d o's accumulators
    outs = launch(
        functools.partial(_one_pass_kernel, spec, kinds_of, len(tmem)),
        name="jattn_mosaic_forward_tangent",
        out_type=[o, rows, rows, o, rows],
        scratch_types=[
            *tmem,
            *tiles,
            *(plgpu.Barrier() for _ in range(5)),
            *ids,
        ],
        grid=(b, g.nq),
        grid_names=("r", "i"),
        interpret=spec.interpret,
    )(q, k, v, dq, dk, dv, kinds, bounds, sinks, dsinks, seeds, *masks, *consts, *dconsts)
    o, lse, top, d_o, d_lse = outs
    return [o[..., : spec.Ep], lse, top, d_o[..., : spec.Ep], d_lse]


def tangent(spec, q, k, v, o, lse, dq, dk, dv, kinds, bounds, sinks, seeds, dsinks, masks, consts, dconsts):
    """``(d o (b, Tp, Ep), d lse (b, Tp))`` as :func:`jattn._gpu.kernels.tangent`: ``d o = acc - d lse o`` outside."""
    check_mod(spec)
    g, b = spec.grid, q.shape[0]
    row = plgpu.SMEM((g.bq,), jnp.float32)
    staged = (plgpu.SMEM((g.bq, depth(spec.Ep)), jnp.float32), row)  # acc, d lse
    (q, k, v, dq, dk, dv), tiles, kinds_of, ids = _operands(spec, q, k, v, dq, dk, dv, staged, (row,))  # lse
    tmem = acc_scratch(spec, (g.bq, depth(spec.Ep)))  # Blackwell: the accumulator
    acc, d_lse = launch(
        functools.partial(_tangent_kernel, spec, kinds_of, len(tmem)),
        name="jattn_mosaic_tangent",
        out_type=[
            jax.ShapeDtypeStruct((b, g.t_pad, v.shape[2]), jnp.float32),
            jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32),
        ],
        scratch_types=[
            *tmem,
            *tiles,
            *(plgpu.Barrier() for _ in range(6)),
            *ids,
        ],
        grid=(b, g.nq),
        grid_names=("r", "i"),
        interpret=spec.interpret,
    )(q, k, v, lse, dq, dk, dv, kinds, bounds, sinks, dsinks, seeds, *masks, *consts, *dconsts)
    d_o = acc[..., : spec.Ep] - d_lse[..., None] * o.astype(jnp.float32)
    return d_o.astype(o.dtype), d_lse
