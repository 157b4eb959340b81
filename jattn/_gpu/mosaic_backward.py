"""The Mosaic GPU backward kernels: dq (grid ``(b, nq)``) and dk/dv (grid ``(b/G, nk)``), flash attention 2.

Operands as :func:`jattn._gpu.kernels.dq`'s and :func:`jattn._gpu.kernels.dkdv`'s (dimension key in
:mod:`jattn._core`): q ``(b, Tp, Dp)``, k ``(b/G, Sp, Dp)``, v ``(b/G, Sp, Ep)``, ``do`` like q's rows with
Ep columns, ``lse`` and ``delta = rowsum(do o) - d lse`` ``(b, Tp)`` float32. Each tile recomputes its weights
``p = exp(x - lse)`` from the scores (``wgmma`` of shared-memory tiles that TMA copies in); dq accumulates
``ds k``, dk/dv (the key block's tile transposed, keys on the accumulator's rows) ``ds^T q`` and ``p^T do``
over the G query rows the key block serves and their non-empty query blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._gpu.mosaic_ahead import ahead, copy_keys
from jattn._gpu.mosaic_mod import check_mod, dropped, modified_vjp, row_values
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
from jattn._gpu.mosaic_tile import Ids, positions, tile_keep, windows
from jattn._masks import PARTIAL

__all__ = ["dkdv", "dq"]

_NEG = -float("inf")


def _copy_in(pairs, barriers) -> None:
    """TMA copies ``(global slice, shared tile)``, each on its barrier, then waits for them all.

    The warpgroup's earlier loads of the tiles (``lse``, ``delta``) are done before TMA overwrites them.
    """
    plgpu.commit_smem()
    for (src, dst), bar in zip(pairs, barriers, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, bar)
    for bar in barriers:
        plgpu.barrier_wait(bar)


def _lse(lse_s, axis: int, layout, cols=None) -> Array:
    """A query block's ``lse`` along tile ``axis``, ``+inf`` for a row that sees no key (its weights 0).

    ``cols``: the tile's columns taken, where ``lse`` runs along them (``axis=1``, a ``pl.ds``).
    """
    lse = load(taken(lse_s, cols), layout.reduce(1 - axis))
    return jnp.where(lse == _NEG, jnp.inf, lse)


def _delta(delta_s, axis: int, layout, cols=None) -> Array:
    """A query block's ``delta`` along tile ``axis`` (on the columns ``cols`` taken, as :func:`_lse`)."""
    return load(taken(delta_s, cols), layout.reduce(1 - axis))


def _masked(g, ids, r, i, j, kind, x, transposed: bool = False, cols=None) -> Array:
    """``x`` with ``-inf`` where the mask drops a score, on PARTIAL tiles (FULL ones as they are)."""
    keep = lambda x: jnp.where(tile_keep(g, ids, r, i, j, transposed, cols), x, _NEG)  # noqa: E731
    return lax.cond(kind == PARTIAL, keep, lambda x: x, x)


def _dq_tile(spec, refs, r, i, j, k_s, v_s, carry):
    """Key block ``j``'s share of query block ``i``'s ``dq`` and of the score modification's values' gradients."""
    g, (q_s, do_s, lse, delta, dq_tmem), (kinds_ref, ids, seed, values) = spec.grid, *refs
    kind = kinds_ref[r if kinds_ref.shape[0] > 1 else 0, i, j]

    def keys(cols, carry):  # the keys cols of the tile (all of them on Hopper)
        t, s = positions(g, i, j, ids.layout, cols=cols)
        x, pull = modified_vjp(spec, scores(spec, q_s, k_s, cols) * spec.scale, g.q_offset + t, g.kv_offset + s, values)
        x = _masked(g, ids, r, i, j, kind, x, cols=cols)
        p = jnp.exp(x - spread(lse, x.shape))
        dp = dropped(spec, seed, t, s, scores(spec, do_s, v_s, cols))
        ds, dcs = pull(p * (dp - spread(delta, x.shape)))
        acc, dvalues = carry
        dvalues = tuple(a + d.sum(axis=1) for a, d in zip(dvalues, dcs, strict=True))  # per query row
        return acc_add(spec, acc, dq_tmem, (ds * spec.scale).astype(k_s.dtype), taken(k_s, cols)), dvalues

    return over_columns(spec, g.bk, keys, carry)


def _dq_kernel(spec, kinds_of, n_tmem, *refs):
    """One query block of row ``r``: ``dq (bq, Dp)`` and each floating row value's gradient per query ``(bq,)``.

    ``n_tmem``: 1 where dq accumulates in tensor memory (Blackwell, the first scratch), else 0.
    """
    nm, nc, nf, g = spec.n_mask, spec.mod_count, _floats(spec), spec.grid
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kinds_ref, bounds_ref, seeds_ref, *refs = refs
    masks, consts, (dq_ref, *dc_refs), refs = (
        refs[:nm],
        refs[nm : nm + nc],
        refs[nm + nc : nm + nc + 1 + nf],
        refs[nm + nc + 1 + nf :],
    )
    dq_tmem, refs = (refs[0] if n_tmem else None), refs[n_tmem:]
    q_s, do_s, ((k_s, v_s), (dq_s, *dc_s)), lse_s, delta_s, *bars = refs[:12]
    id_s = refs[12:]
    r, i = lax.axis_index("r"), lax.axis_index("i")
    kr, rows = (r if kinds_ref.shape[0] > 1 else 0), pl.ds(i * g.bq, g.bq)
    ins = (
        (q_ref.at[r, rows], q_s),
        (do_ref.at[r, rows], do_s),
        (lse_ref.at[r, rows], lse_s),
        (delta_ref.at[r, rows], delta_s),
    )
    _copy_in(ins, bars[:4])
    L = target(spec).layout
    lse, delta = _lse(lse_s, 0, L), _delta(delta_s, 0, L)
    ids = Ids.windowed(masks, id_s, bars[6], kinds_of, target(spec).layout)
    refs = ((q_s, do_s, lse, delta, dq_tmem), (kinds_ref, ids, seeds_ref[r], row_values(consts, r)))

    def tile(j, slot, carry):
        return _dq_tile(spec, refs, r, i, j, k_s.at[slot], v_s.at[slot], carry)

    zero_rows = plgpu.layout_cast(jnp.zeros((g.bq,), jnp.float32), L.reduce(1))
    init = (acc_zero(spec, dq_tmem, dq_s.shape), (zero_rows,) * nf)
    bounds, kind = (bounds_ref[kr, i, 0], bounds_ref[kr, i, 1]), lambda j: kinds_ref[kr, i, j]
    copy = functools.partial(copy_keys, spec, (k_ref, v_ref), (k_s, v_s, *bars[4:6]), r)
    acc, dvalues = ahead(bounds, kind, copy, tile, bars[4:6], init, buffers=_buffers(spec), loads=False)
    for part, x in acc_chunks(acc, dq_tmem):
        dq_s.at[:, part][...] = x.astype(dq_s.dtype)
    for smem, d in zip(dc_s, dvalues, strict=True):
        smem[...] = d
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[r, rows])
    for smem, ref in zip(dc_s, dc_refs, strict=True):
        plgpu.copy_smem_to_gmem(smem, ref.at[r, rows])
    plgpu.wait_smem_to_gmem(0)


def _dkdv_tile(spec, refs, r, j, i, tiles, carry):
    """Query block ``i`` of row ``r``'s share of key block ``j``'s ``(dk, dv)``, the tile transposed ``(bk, bq)``.

    ``tiles``: its ``(q, do, lse, delta)`` in shared memory.
    """
    g, (kinds_ref, ids, seed, values), (k_s, v_s, (dk_tmem, dv_tmem)) = spec.grid, *refs
    q_s, do_s, lse_s, delta_s = tiles
    kind = kinds_ref[r if kinds_ref.shape[0] > 1 else 0, i, j]

    def queries(cols, carry):  # the queries cols of the tile (all of them on Hopper)
        t, s = positions(g, i, j, ids.layout, transposed=True, cols=cols)
        x, pull = modified_vjp(spec, scores(spec, k_s, q_s, cols) * spec.scale, g.q_offset + t, g.kv_offset + s, values)
        x = _masked(g, ids, r, i, j, kind, x, transposed=True, cols=cols)
        lse = _lse(lse_s, 1, ids.layout, cols)  # lse and delta read as needed, not held through the mask
        p = jnp.exp(x - spread(lse, x.shape, 1))
        pz = dropped(spec, seed, t, s, p)  # p (z dp - delta) = pz dp - p delta
        dk, dv = carry
        dv = acc_add(spec, dv, dv_tmem, pz.astype(do_s.dtype), taken(do_s, cols))
        delta = _delta(delta_s, 1, ids.layout, cols)
        ds, _ = pull(pz * scores(spec, v_s, do_s, cols) - p * spread(delta, x.shape, 1))
        return acc_add(spec, dk, dk_tmem, (ds * spec.scale).astype(q_s.dtype), taken(q_s, cols)), dv

    return over_columns(spec, g.bq, queries, carry)


def _dkdv_kernel(spec, kinds_of, n_tmem, *refs):
    """One key block of kv row ``rk``: ``dk (bk, Dp)`` and ``dv (bk, Ep)`` over the G query rows it serves.

    ``n_tmem``: 2 where dk and dv accumulate in tensor memory (Blackwell, the first scratch), else 0.
    """
    nm, nc, g = spec.n_mask, spec.mod_count, spec.grid
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kinds_ref, tbounds_ref, seeds_ref, *refs = refs
    masks, consts, (dk_ref, dv_ref), refs = (
        refs[:nm],
        refs[nm : nm + nc],
        refs[nm + nc : nm + nc + 2],
        refs[nm + nc + 2 :],
    )
    tmems, refs = (tuple(refs[:2]) if n_tmem else (None, None)), refs[n_tmem:]
    ((q_s, do_s), (dk_s, dv_s)), k_s, v_s, lse_s, delta_s, *bars = refs[:12]
    id_s = refs[12:]
    rk, j = lax.axis_index("r"), lax.axis_index("j")
    cols = pl.ds(j * g.bk, g.bk)
    _copy_in(((k_ref.at[rk, cols], k_s), (v_ref.at[rk, cols], v_s)), bars[4:6])
    ids = Ids.windowed(masks, id_s, bars[6], kinds_of, target(spec).layout)

    queries = (q_s, do_s, lse_s, delta_s)

    def group(gi, carry):  # query row gi of the G the key block serves
        r = rk * spec.G + gi
        kr = r if kinds_ref.shape[0] > 1 else 0
        gm = (kinds_ref, ids, seeds_ref[r], row_values(consts, r))

        def copy(i, slot):
            rows = pl.ds(i * g.bq, g.bq)
            for ref, smem, bar in zip((q_ref, do_ref, lse_ref, delta_ref), queries, bars[:4], strict=True):
                plgpu.copy_gmem_to_smem(ref.at[r, rows], smem.at[slot], bar.at[slot])

        def tile(i, slot, carry):
            return _dkdv_tile(spec, (gm, (k_s, v_s, tmems)), r, j, i, [x.at[slot] for x in queries], carry)

        bounds, kind = (tbounds_ref[kr, j, 0], tbounds_ref[kr, j, 1]), lambda i: kinds_ref[kr, i, j]
        return ahead(bounds, kind, copy, tile, bars[:4], carry, buffers=_buffers(spec), loads=True)

    init = tuple(acc_zero(spec, tmem, s.shape) for tmem, s in zip(tmems, (dk_s, dv_s), strict=True))
    for acc, tmem, smem in zip(lax.fori_loop(0, spec.G, group, init), tmems, (dk_s, dv_s), strict=True):
        for part, x in acc_chunks(acc, tmem):
            smem.at[:, part][...] = x.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_s, dk_ref.at[rk, cols])
    plgpu.copy_smem_to_gmem(dv_s, dv_ref.at[rk, cols])
    plgpu.wait_smem_to_gmem(0)


def _buffers(spec) -> int:
    """Buffers of the loop's tiles (:mod:`jattn._gpu.mosaic_ahead`): two on Hopper, one on Blackwell.

    On Blackwell a second would make dq and dk/dv the largest kernels, past the tangent's, and past 227 KiB at
    ``(Dw, Ew) = (64, 256)``.
    """
    return 1 if target(spec).tensor_memory else 2


def _floats(spec) -> int:
    """How many of the score modification's row values are floating (they get gradients)."""
    return 0 if spec.mod is None else sum(spec.mod.floats)


def _widened(spec, q, k, v, do):
    """q, k padded to the ``wgmma`` depth of D and v, ``do`` to E's (:func:`jattn._gpu.mosaic_support.depth`)."""
    Dw, Ew = depth(spec.Dp), depth(spec.Ep)
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[-1])))  # noqa: E731
    return pad(q, Dw), pad(k, Dw), pad(v, Ew), pad(do, Ew)


def _id_scratch(spec) -> tuple[tuple, list]:
    """The mask arrays' windows (:func:`jattn._gpu.mosaic_tile.windows`) and a shared tile for each windowed one."""
    g = spec.grid
    kinds_of = windows(g.mask, spec.n_mask)
    return kinds_of, [plgpu.SMEM((g.bq if w == "q" else g.bk,), jnp.int32) for w in kinds_of if w]


def dq(spec, q, k, v, do, lse, delta, kinds, bounds, sinks, seeds, masks, consts) -> tuple[Array, tuple]:
    """``(dq (b, Tp, Dp), dvalues)`` as :func:`jattn._gpu.kernels.dq`; each floating row value's gradient ``(b, Tp)``.

    The gradients are per query (summed over keys), where the Triton kernel's are per query block: the caller sums
    axis 1 of either.
    """
    del sinks  # its gradient is outside
    check_mod(spec)
    g, b, nf = spec.grid, q.shape[0], _floats(spec)
    q, k, v, do = _widened(spec, q, k, v, do)
    kinds_of, ids = _id_scratch(spec)
    rows = plgpu.SMEM((g.bq,), jnp.float32)
    Dw, Ew = q.shape[2], v.shape[2]
    n = _buffers(spec)
    keys = (swizzled((n, g.bk, Dw), q.dtype), swizzled((n, g.bk, Ew), q.dtype))  # k and v, a buffer each
    staged = (swizzled((g.bq, Dw), q.dtype), *(rows,) * nf)  # dq and the values' gradients, once the loop is done
    tmem = acc_scratch(spec, (g.bq, Dw))  # Blackwell: dq's accumulator
    out = launch(
        functools.partial(_dq_kernel, spec, kinds_of, len(tmem)),
        name="jattn_mosaic_dq",
        out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype), *(jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32),) * nf],
        scratch_types=[
            *tmem,
            swizzled((g.bq, Dw), q.dtype),
            swizzled((g.bq, Ew), q.dtype),
            plgpu.RefUnion(keys, staged),
            rows,
            rows,
            *(plgpu.Barrier() for _ in range(4)),
            *(plgpu.Barrier(num_barriers=2) for _ in range(2)),  # k's and v's (mosaic_ahead)
            plgpu.Barrier(),
            *ids,
        ],
        grid=(b, g.nq),
        grid_names=("r", "i"),
        interpret=spec.interpret,
    )(q, k, v, do, lse, delta, kinds, bounds, seeds, *masks, *consts)
    return out[0][..., : spec.Dp], tuple(out[1:])


def dkdv(spec, q, k, v, do, lse, delta, kinds, tbounds, sinks, seeds, masks, consts) -> tuple[Array, Array]:
    """``(dk (b/G, Sp, Dp), dv (b/G, Sp, Ep))`` as :func:`jattn._gpu.kernels.dkdv`; ``tbounds`` over query blocks."""
    del sinks
    check_mod(spec)
    g = spec.grid
    q, k, v, do = _widened(spec, q, k, v, do)
    kinds_of, ids = _id_scratch(spec)
    Dw, Ew, n = q.shape[2], v.shape[2], _buffers(spec)
    queries = (swizzled((n, g.bq, Dw), q.dtype), swizzled((n, g.bq, Ew), q.dtype))  # q and do, a buffer each
    staged = (swizzled((g.bk, Dw), q.dtype), swizzled((g.bk, Ew), q.dtype))  # dk and dv, once the loop is done
    keys = (swizzled((g.bk, Dw), q.dtype), swizzled((g.bk, Ew), q.dtype))
    tmem = acc_scratch(spec, (g.bk, Dw), (g.bk, Ew))  # Blackwell: dk's and dv's accumulators
    dk, dv = launch(
        functools.partial(_dkdv_kernel, spec, kinds_of, len(tmem)),
        name="jattn_mosaic_dkdv",
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_types=[
            *tmem,
            plgpu.RefUnion(queries, staged),
            *keys,
            *(plgpu.SMEM((n, g.bq), jnp.float32),) * 2,  # lse and delta, a buffer each
            *(plgpu.Barrier(num_barriers=2) for _ in range(4)),  # q's, do's, lse's, delta's (mosaic_ahead)
            *(plgpu.Barrier() for _ in range(3)),
            *ids,
        ],
        grid=(k.shape[0], g.nk),
        grid_names=("r", "j"),
        interpret=spec.interpret,
    )(q, k, v, do, lse, delta, kinds, tbounds, seeds, *masks, *consts)
    return dk[..., : spec.Dp], dv[..., : spec.Ep]
