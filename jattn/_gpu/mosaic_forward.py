"""The Mosaic GPU forward kernel: one warpgroup a query block, an online softmax over its non-empty key blocks.

Operands as :func:`jattn._gpu.kernels.forward`'s (dimension key in :mod:`jattn._core`): q ``(b, Tp, Dp)``,
k ``(b/G, Sp, Dp)``, v ``(b/G, Sp, Ep)`` (query row ``r`` reads kv row ``r // G``), the tile kinds and their
bounds, the sinks and the mask's arrays, all in global memory. Grid ``(b, nq)``: TMA copies the query block
into shared memory once, then each key block's k and v tiles a step ahead (:mod:`jattn._gpu.mosaic_ahead`);
``wgmma`` forms the scores ``q k^T`` and the product ``p v`` (accumulating in float32 registers on Hopper,
in tensor memory on Blackwell). EMPTY tiles are outside the loop's bounds or skipped, FULL ones unmasked,
PARTIAL ones masked by the predicate (:func:`jattn._gpu.mosaic_tile.tile_keep`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._gpu.mosaic_ahead import ahead, copy_keys
from jattn._gpu.mosaic_mod import check_mod, dropped, modified, row_values
from jattn._gpu.mosaic_support import (
    acc_add,
    acc_chunks,
    acc_scratch,
    acc_zero,
    depth,
    launch,
    over_columns,
    scores,
    spread,
    swizzled,
    taken,
    target,
)
from jattn._gpu.mosaic_tile import Ids, positions, tile_keep, windows
from jattn._masks import PARTIAL

__all__ = ["forward"]

_NEG = -float("inf")


def _tile(spec, refs, r, i, j, k_s, v_s, carry):
    """Key block ``j``'s steps of the online softmax: ``(max, denominator, acc)`` updated by tile ``(i, j)``.

    ``k_s``, ``v_s``: its tiles in shared memory. One step for the whole tile on Hopper, one per
    :func:`jattn._gpu.mosaic_support.over_columns` chunk on Blackwell; ``acc`` is None where the accumulator
    is in tensor memory (``acc_tmem``), updated in place.
    """
    g, (q_s, acc_tmem), (kinds_ref, ids, seed, values) = spec.grid, *refs
    kind = kinds_ref[r if kinds_ref.shape[0] > 1 else 0, i, j]

    def keys(cols, carry):  # the keys cols of the tile (all of them on Hopper)
        m, den, acc = carry
        t, s = positions(g, i, j, ids.layout, cols=cols)
        x = modified(spec, scores(spec, q_s, k_s, cols) * spec.scale, g.q_offset + t, g.kv_offset + s, values)
        masked = lambda x: jnp.where(tile_keep(g, ids, r, i, j, cols=cols), x, _NEG)  # noqa: E731
        x = lax.cond(kind == PARTIAL, masked, lambda x: x, x)
        top = jnp.maximum(m, x.max(axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)  # a row masked so far: its weights are 0, not NaN
        p, alpha = jnp.exp(x - spread(safe, x.shape)), jnp.exp(m - safe)
        v_cols = taken(v_s, cols)
        # In tensor memory: p's sum and its 16-bit copy first, freeing p. That order costs Hopper's registers
        # (254 where 240 at D = 256), so there the product comes first.
        if acc_tmem is not None:
            den, pz = alpha * den + p.sum(axis=1), dropped(spec, seed, t, s, p).astype(v_s.dtype)
            return top, den, acc_add(spec, None, acc_tmem, pz, v_cols, alpha)
        acc = acc_add(spec, acc, None, dropped(spec, seed, t, s, p).astype(v_s.dtype), v_cols, alpha)
        return top, alpha * den + p.sum(axis=1), acc  # the sum of undropped p normalises

    return over_columns(spec, g.bk, keys, carry)


def _finish(spec, sinks_ref, r, m, den):
    """``(weight (bq,), lse (bq,))`` of the loop's sums (``o = acc weight``); the sink joins every row's denominator."""
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), _NEG)
    if spec.sinks:
        sink = sinks_ref[r]
        top = jnp.maximum(lse, sink)
        lse = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sink - top))
    return jnp.where(seen, jnp.exp(m - jnp.where(seen, lse, 0.0)), 0.0), lse


def _kernel(spec, kinds, n_tmem, *refs):
    """One query block of row ``r``: ``o``, ``lse`` and the max logit through shared memory.

    ``n_tmem``: 1 where the accumulator is in tensor memory (Blackwell, the first scratch), else 0.
    """
    nm = spec.n_mask
    q_ref, k_ref, v_ref, kinds_ref, bounds_ref, sinks_ref, seeds_ref, *refs = refs
    nc = spec.mod_count
    masks, consts, (o_ref, lse_ref, top_ref), scratch = (
        refs[:nm],
        refs[nm : nm + nc],
        refs[nm + nc : nm + nc + 3],
        refs[nm + nc + 3 :],
    )
    acc_tmem = scratch[0] if n_tmem else None
    q_s, ((k_s, v_s), (o_s, lse_s, top_s)), bar_q, bar_k, bar_v, bar_ids, *id_s = scratch[n_tmem:]
    g, r, i = spec.grid, lax.axis_index("r"), lax.axis_index("i")
    plgpu.copy_gmem_to_smem(q_ref.at[r, pl.ds(i * g.bq, g.bq)], q_s, bar_q)
    plgpu.barrier_wait(bar_q)
    L = target(spec).layout
    ids = Ids.windowed(masks, id_s, bar_ids, kinds, L)
    refs = ((q_s, acc_tmem), (kinds_ref, ids, seeds_ref[r], row_values(consts, r)))
    copy = functools.partial(copy_keys, spec, (k_ref, v_ref), (k_s, v_s, bar_k, bar_v), r)
    init = (
        plgpu.layout_cast(jnp.full((g.bq,), _NEG, jnp.float32), L.reduce(1)),
        plgpu.layout_cast(jnp.zeros((g.bq,), jnp.float32), L.reduce(1)),
        acc_zero(spec, acc_tmem, o_s.shape),
    )
    kr = r if kinds_ref.shape[0] > 1 else 0

    def tile(j, slot, carry):
        return _tile(spec, refs, r, i, j, k_s.at[slot], v_s.at[slot], carry)

    bounds = (bounds_ref[kr, i, 0], bounds_ref[kr, i, 1])
    kind = lambda j: kinds_ref[kr, i, j]  # noqa: E731
    m, den, acc = ahead(bounds, kind, copy, tile, (bar_k, bar_v), init, buffers=2, loads=False)
    weight, lse = _finish(spec, sinks_ref, r, m, den)
    for cols, x in acc_chunks(acc, acc_tmem):
        o_s.at[:, cols][...] = (x * spread(weight, x.shape)).astype(o_s.dtype)
    lse_s[...], top_s[...] = lse, m
    plgpu.commit_smem()
    rows = pl.ds(i * g.bq, g.bq)
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[r, rows])
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[r, rows])
    plgpu.copy_smem_to_gmem(top_s, top_ref.at[r, rows])
    plgpu.wait_smem_to_gmem(0)


def forward(spec, q, k, v, kinds, bounds, sinks, seeds, masks, consts) -> tuple[Array, Array, Array]:
    """``(o (b, Tp, Ep), lse (b, Tp), max logit (b, Tp))`` as :func:`jattn._gpu.kernels.forward`, on Mosaic GPU."""
    check_mod(spec)
    g, b = spec.grid, q.shape[0]
    Dw, Ew = depth(spec.Dp), depth(spec.Ep)
    q, k = (jnp.pad(x, ((0, 0), (0, 0), (0, Dw - spec.Dp))) for x in (q, k))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, Ew - spec.Ep)))
    kinds_of = windows(g.mask, spec.n_mask)
    ids = [plgpu.SMEM((g.bq if w == "q" else g.bk,), jnp.int32) for w in kinds_of if w]
    keys = (swizzled((2, g.bk, Dw), q.dtype), swizzled((2, g.bk, Ew), q.dtype))  # two buffers (mosaic_ahead)
    staged = (swizzled((g.bq, Ew), q.dtype), *(plgpu.SMEM((g.bq,), jnp.float32),) * 2)  # o, lse, the max logit
    tmem = acc_scratch(spec, (g.bq, Ew))  # Blackwell's accumulator, in tensor memory
    scratch = [
        *tmem,
        swizzled((g.bq, Dw), q.dtype),
        plgpu.RefUnion(keys, staged),  # the outputs staged in the key tiles' memory once the loop is done
        plgpu.Barrier(num_arrivals=1),
        *(plgpu.Barrier(num_arrivals=1, num_barriers=2) for _ in range(2)),  # k's and v's, a buffer each
        plgpu.Barrier(num_arrivals=1),
        *ids,
    ]
    rows = jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32)
    o, lse, top = launch(
        functools.partial(_kernel, spec, kinds_of, len(tmem)),
        name="jattn_mosaic_forward",
        out_type=[jax.ShapeDtypeStruct((b, g.t_pad, Ew), v.dtype), rows, rows],
        scratch_types=scratch,
        grid=(b, g.nq),
        grid_names=("r", "i"),
        interpret=spec.interpret,
    )(q, k, v, kinds, bounds, sinks, seeds, *masks, *consts)
    return o[..., : spec.Ep], lse, top
