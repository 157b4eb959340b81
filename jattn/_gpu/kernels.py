"""The GPU kernel's ``pallas_call`` bodies: the forward, its tangent (alone or with it), dq, and dk/dv (flash attention 2).

Operands (dimension key in :mod:`jattn._core`; ``b`` rows of q, ``b / G`` rows of k and v):
q ``(b, Tp, Dp)``, k ``(b/G, Sp, Dp)``, v ``(b/G, Sp, Ep)``, padded with zeros to the blocks and to
head dims that are powers of two of at least 16 (zero columns change no score). Query row ``r``
reads kv row ``r // G``: grouped heads are never repeated. Tile kinds, the loop bounds, the rows'
(batch, head), the sinks and the mask's arrays are whole operands read by index
(:mod:`jattn._gpu.tiles`); the arrays a score modification closes over follow them.

* forward, grid ``(b, nq)``: each query block runs an online softmax over its non-empty key
  blocks (EMPTY skipped, FULL unmasked, PARTIAL masked by the predicate), saving ``lse (b, Tp)``
  float32 (``-inf`` for a row that sees no key; the sink joins it);
* tangent (forward mode), grid ``(b, nq)``: recomputes each tile's weights ``p`` from ``lse`` and the
  scores' tangent ``dx``, and accumulates ``d lse = sum p dx`` and ``d o = sum p (dx v + dv) - d lse o``;
  the forward and its tangent also run as one kernel (one sweep, the same online softmax carrying
  the two tangent sums);
* dq, grid ``(b, nq)``: recomputes each tile's weights from ``lse`` and accumulates ``dq`` (and
  the gradients of a score modification's arrays, per row and query block);
* dk/dv, grid ``(b/G, nk)``: each key block loops over the G query rows it serves and their
  non-empty query blocks, accumulating ``dk`` and ``dv``.

Dropout (``Spec.dropout``) multiplies each tile's weights by 0 or ``1 / keep_prob`` from the row's
seed and the positions (:mod:`jattn._dropout`'s bits, the blockwise path's) wherever they meet v
or dO v; the denominator and ``d lse`` sum the undropped weights.

Dots take the inputs' dtype and accumulate in float32; float32 inputs take the algorithm of the tuning table
(:mod:`jattn._gpu.tuning`), exact float32 in interpret mode. Launches (warps, stages) are the table's too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn._dropout import keep_mask
from jattn._gpu.score_mod import TileMod
from jattn._gpu.tiles import Grid, tile_mask
from jattn._gpu.tuning import Choice

__all__ = ["Spec", "dkdv", "dq", "forward", "forward_tangent", "tangent"]

_NEG = -float("inf")

#: The float32 dots' algorithm of :attr:`jattn._gpu.tuning.Choice.precision` (interpret mode: ``"ieee"``).
_F32_DOTS = {
    "ieee": lax.Precision.HIGHEST,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32": lax.Precision.DEFAULT,
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static facts of one kernel call (hashable): the tiles, head dims, grouping, scale and what it reads."""

    grid: Grid
    Dp: int
    Ep: int
    G: int
    scale: float
    mod: TileMod | None
    sinks: bool
    interpret: bool
    n_mask: int  # how many mask arrays the kernels read (each with R rows or 1: read by row, or row 0)
    choice: Choice  # the launches and the float32 dots (:mod:`jattn._gpu.tuning`)
    dropout: float = 0.0  # the rate: a weight is dropped where :mod:`jattn._dropout`'s bit of its row seed says
    backend: str = (
        "triton"  # "triton" (this module); "mosaic_gpu", "mosaic_gpu_tcgen05" (:mod:`jattn._gpu.mosaic_kernels`)
    )

    @property
    def mod_count(self) -> int:
        """How many arrays the score modification closes over."""
        return 0 if self.mod is None else self.mod.count

    def params(self, kernel: str) -> plgpu.CompilerParams:
        """The Triton lowering's (not Mosaic GPU's) launch of ``kernel`` (:data:`jattn._gpu.tuning.KERNELS`)."""
        warps, stages = self.choice.launch(kernel)
        return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _dot(spec: Spec, a: Array, b: Array, ca: int, cb: int) -> Array:
    """``a`` contracted with ``b`` over ``a``'s axis ``ca`` and ``b``'s ``cb``, float32 (float32 inputs: the choice's dots)."""
    how = None
    if a.dtype == jnp.float32:
        how = _F32_DOTS["ieee" if spec.interpret else spec.choice.precision]
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=how, preferred_element_type=jnp.float32)


def _iota(n: int) -> Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _at(ref, r):
    """Row ``r`` of a whole operand, or its row 0 where it has one row (broadcast)."""
    return r if ref.shape[0] > 1 else 0


def _dropped(spec: Spec, seeds_ref, tile: _Tile, x: Array) -> Array:
    """``x (bq, bk)`` times dropout's factor on the tile: ``1 / keep_prob`` where the row's bit keeps, else 0.

    The bit of (row ``r``, query ``t``, key ``s``) is the blockwise and dense paths' (:mod:`jattn._dropout`).
    """
    if not spec.dropout:
        return x
    keep = keep_mask(seeds_ref[tile.r], tile.t[:, None], tile.s[None, :], spec.dropout)
    return jnp.where(keep, x * (1.0 / (1.0 - spec.dropout)), 0.0)


class _Tile:
    """What the kernels compute on tile (query block ``i``, key block ``j``) of kernel row ``r``."""

    def __init__(self, spec: Spec, r, mask_refs, values, i, j):
        self.spec, self.r, self.i, self.j = spec, r, i, j
        self.mask_refs, self.values = mask_refs, values
        g = spec.grid
        self.t, self.s = i * g.bq + _iota(g.bq), j * g.bk + _iota(g.bk)

    def _read(self, n: int, window):
        ref, g = self.mask_refs[n], self.spec.grid
        row = _at(ref, self.r)
        if window is None:
            return ref[row]
        return ref[row, pl.ds(self.i * g.bq, g.bq)] if window == "q" else ref[row, pl.ds(self.j * g.bk, g.bk)]

    def keep(self) -> Array:
        """``(bq, bk)`` bool: the mask on this tile."""
        return tile_mask(self.spec.grid, self._read, self.t, self.s)

    def _where(self):
        g = self.spec.grid
        return g.q_offset + self.t, g.kv_offset + self.s

    def logits(self, qb: Array, kb: Array, masked: bool) -> Array:
        """Scaled, modified and masked scores ``(bq, bk)`` float32 (masked: ``-inf``)."""
        x = _dot(self.spec, qb, kb, 1, 1) * self.spec.scale
        if self.spec.mod is not None:
            x = self.spec.mod.apply(x, *self._where(), self.values)
        return jnp.where(self.keep(), x, _NEG) if masked else x

    def logits_vjp(self, qb: Array, kb: Array, masked: bool):
        """``(x, pull)``: :meth:`logits` and ``pull(dx) -> (ds, dconsts)``, ``ds`` the scaled scores' gradient."""
        s = _dot(self.spec, qb, kb, 1, 1) * self.spec.scale
        if self.spec.mod is None:
            x, pull = s, lambda dx: (dx, ())
        else:
            x, pull = self.spec.mod.pullback(s, *self._where(), self.values)
        return (jnp.where(self.keep(), x, _NEG) if masked else x), pull

    def logits_jvp(self, qb: Array, kb: Array, dqb: Array, dkb: Array, dvalues: tuple, masked: bool):
        """``(x, dx)``: :meth:`logits` and its tangent (``dx`` 0 where masked) for q, k and floating values' tangents."""
        s = _dot(self.spec, qb, kb, 1, 1) * self.spec.scale
        ds = (_dot(self.spec, dqb, kb, 1, 1) + _dot(self.spec, qb, dkb, 1, 1)) * self.spec.scale
        x, dx = (s, ds) if self.spec.mod is None else self.spec.mod.tangent(s, ds, *self._where(), self.values, dvalues)
        if not masked:
            return x, dx
        keep = self.keep()
        return jnp.where(keep, x, _NEG), jnp.where(keep, dx, 0.0)


def _kinds_loop(kinds_ref, bounds_ref, kr, fixed, tile, init, by_rows: bool):
    """Loops over the non-empty blocks of one query block (``by_rows``) or key block; ``tile(n, carry, masked)``."""

    def body(n, carry):
        kind = kinds_ref[kr, fixed, n] if by_rows else kinds_ref[kr, n, fixed]
        branches = (lambda c: c, functools.partial(tile, n, masked=True), functools.partial(tile, n, masked=False))
        return lax.switch(kind, branches, carry)

    return lax.fori_loop(bounds_ref[kr, fixed, 0], bounds_ref[kr, fixed, 1], body, init)


def _forward_kernel(spec: Spec, q_ref, k_ref, v_ref, kinds_ref, bounds_ref, sinks_ref, seeds_ref, *refs):
    """One query block: online softmax over its key blocks; writes ``o (bq, Ep)``, ``lse (bq,)`` and the max logit ``(bq,)``."""
    masks, consts = refs[: spec.n_mask], refs[spec.n_mask : spec.n_mask + spec.mod_count]
    o_ref, lse_ref, top_ref = refs[-3:]
    g, r, i = spec.grid, pl.program_id(0), pl.program_id(1)
    q, kr = q_ref[...], _at(kinds_ref, r)
    values = tuple(c[r] for c in consts)  # the score modification's values of this row

    def tile(j, carry, masked):
        m, den, acc = carry
        kb, vb = k_ref[pl.ds(j * g.bk, g.bk), :], v_ref[pl.ds(j * g.bk, g.bk), :]
        at = _Tile(spec, r, masks, values, i, j)
        x = at.logits(q, kb, masked)
        top = jnp.maximum(m, jnp.max(x, axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)  # a row masked so far: its weights are 0, not NaN
        p, alpha = jnp.exp(x - safe[:, None]), jnp.exp(m - safe)
        pv = _dot(
            spec, _dropped(spec, seeds_ref, at, p).astype(vb.dtype), vb, 1, 0
        )  # the sum of undropped p normalises
        return top, alpha * den + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    init = (
        jnp.full((g.bq,), _NEG, jnp.float32),
        jnp.zeros((g.bq,), jnp.float32),
        jnp.zeros((g.bq, spec.Ep), jnp.float32),
    )
    m, den, acc = _kinds_loop(kinds_ref, bounds_ref, kr, i, tile, init, by_rows=True)
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), _NEG)
    if spec.sinks:  # the sink joins every row's denominator: lse = log(e^lse + e^sink)
        sink = jnp.full((g.bq,), sinks_ref[r], jnp.float32)
        top = jnp.maximum(lse, sink)
        lse = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sink - top))
    weight = jnp.where(seen, jnp.exp(m - jnp.where(seen, lse, 0.0)), 0.0)
    o_ref[...] = (acc * weight[:, None]).astype(o_ref.dtype)
    lse_ref[...] = lse
    top_ref[...] = m  # each row's largest kept logit (-inf where it sees none)


def _whole(x: Array) -> pl.BlockSpec:
    """The whole operand in every program (read by index)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _common(kinds, bounds, sinks, seeds, masks, consts) -> tuple[list, list]:
    """Operands after q, k, v (and their specs), as every kernel reads them whole."""
    ops = [kinds, bounds, sinks, seeds, *masks, *consts]
    return ops, [_whole(x) for x in ops]


def forward(spec: Spec, q, k, v, kinds, bounds, sinks, seeds, masks, consts) -> tuple[Array, Array, Array]:
    """``(o (b, Tp, Ep), lse (b, Tp), max logit (b, Tp))``, float32 rows; ``bounds`` from :func:`jattn._gpu.tiles.bounds`."""
    g, G = spec.grid, spec.G
    b = q.shape[0]
    ops, specs = _common(kinds, bounds, sinks, seeds, masks, consts)
    return pl.pallas_call(
        functools.partial(_forward_kernel, spec),
        grid=(b, g.nq),
        in_specs=[
            pl.BlockSpec((None, g.bq, spec.Dp), lambda r, i: (r, i, 0)),
            pl.BlockSpec((None, g.s_pad, spec.Dp), lambda r, i: (r // G, 0, 0)),
            pl.BlockSpec((None, g.s_pad, spec.Ep), lambda r, i: (r // G, 0, 0)),
            *specs,
        ],
        out_specs=[
            pl.BlockSpec((None, g.bq, spec.Ep), lambda r, i: (r, i, 0)),
            pl.BlockSpec((None, g.bq), lambda r, i: (r, i)),
            pl.BlockSpec((None, g.bq), lambda r, i: (r, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, g.t_pad, spec.Ep), v.dtype),
            jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32),
        ],
        interpret=spec.interpret,
        compiler_params=spec.params("forward"),
        name="jattn_gpu_forward",
    )(q, k, v, *ops)


def _tangent_kernel(spec: Spec, q_ref, k_ref, v_ref, o_ref, lse_ref, dq_ref, dk_ref, dv_ref, *refs):
    """One query block's tangent: ``d o (bq, Ep)`` and ``d lse (bq,)`` from the weights ``exp(x - lse)``."""
    kinds_ref, bounds_ref, sinks_ref, seeds_ref, *refs = refs
    nm, nc = spec.n_mask, spec.mod_count
    masks, consts, (dsinks_ref, *dconsts) = refs[:nm], refs[nm : nm + nc], refs[nm + nc : -2]
    do_ref, dlse_ref = refs[-2:]
    g, r, i = spec.grid, pl.program_id(0), pl.program_id(1)
    q, dq_, kr = q_ref[...], dq_ref[...], _at(kinds_ref, r)
    lse = lse_ref[...]
    lse = jnp.where(lse == _NEG, jnp.inf, lse)  # a row that sees no key: weights 0
    values, dvalues = tuple(c[r] for c in consts), tuple(c[r] for c in dconsts)

    def tile(j, carry, masked):
        acc, dlse = carry
        at = pl.ds(j * g.bk, g.bk)
        kb, vb, dkb, dvb = k_ref[at, :], v_ref[at, :], dk_ref[at, :], dv_ref[at, :]
        at = _Tile(spec, r, masks, values, i, j)
        x, dx = at.logits_jvp(q, kb, dq_, dkb, dvalues, masked)
        p = jnp.exp(x - lse[:, None])
        pdx, pz = p * dx, _dropped(spec, seeds_ref, at, p)  # d lse sums the undropped weights' tangents
        acc = acc + _dot(spec, (pz * dx).astype(vb.dtype), vb, 1, 0) + _dot(spec, pz.astype(dvb.dtype), dvb, 1, 0)
        return acc, dlse + jnp.sum(pdx, axis=1)

    init = (jnp.zeros((g.bq, spec.Ep), jnp.float32), jnp.zeros((g.bq,), jnp.float32))
    acc, dlse = _kinds_loop(kinds_ref, bounds_ref, kr, i, tile, init, by_rows=True)
    if spec.sinks:  # the sink's weight exp(sink - lse) times its tangent joins d lse (lse is finite with a sink)
        dlse = dlse + jnp.exp(sinks_ref[r] - lse) * dsinks_ref[r]
    do_ref[...] = (acc - dlse[:, None] * o_ref[...].astype(jnp.float32)).astype(do_ref.dtype)
    dlse_ref[...] = dlse


def tangent(spec: Spec, q, k, v, o, lse, dq, dk, dv, kinds, bounds, sinks, seeds, dsinks, masks, consts, dconsts):
    """``(d o (b, Tp, Ep), d lse (b, Tp) float32)``: the forward's tangent for q, k, v, sinks and the floating values'.

    ``o`` and ``lse`` are the forward's; ``dsinks (b,)``; ``dconsts`` the tangents of the score modification's
    floating values, in order. ``bounds`` as for :func:`forward`.
    """
    g, G = spec.grid, spec.G
    b = q.shape[0]
    ops, specs = _common(kinds, bounds, sinks, seeds, masks, consts)
    extra = [dsinks, *dconsts]
    q_block = pl.BlockSpec((None, g.bq, spec.Dp), lambda r, i: (r, i, 0))
    kv = [pl.BlockSpec((None, g.s_pad, n), lambda r, i: (r // G, 0, 0)) for n in (spec.Dp, spec.Ep)]
    row_e, row = (
        pl.BlockSpec((None, g.bq, spec.Ep), lambda r, i: (r, i, 0)),
        pl.BlockSpec((None, g.bq), lambda r, i: (r, i)),
    )
    return pl.pallas_call(
        functools.partial(_tangent_kernel, spec),
        grid=(b, g.nq),
        in_specs=[q_block, *kv, row_e, row, q_block, *kv, *specs, *(_whole(x) for x in extra)],
        out_specs=[row_e, row],
        out_shape=[
            jax.ShapeDtypeStruct((b, g.t_pad, spec.Ep), o.dtype),
            jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32),
        ],
        interpret=spec.interpret,
        compiler_params=spec.params("tangent"),
        name="jattn_gpu_tangent",
    )(q, k, v, o, lse, dq, dk, dv, *ops, *extra)


def _forward_tangent_kernel(spec: Spec, q_ref, k_ref, v_ref, dq_ref, dk_ref, dv_ref, *refs):
    """One query block's forward and tangent in one sweep: ``o``, ``lse``, the max logit, ``d o``, ``d lse``."""
    kinds_ref, bounds_ref, sinks_ref, seeds_ref, *refs = refs
    nm, nc = spec.n_mask, spec.mod_count
    masks, consts, (dsinks_ref, *dconsts) = refs[:nm], refs[nm : nm + nc], refs[nm + nc : -5]
    o_ref, lse_ref, top_ref, do_ref, dlse_ref = refs[-5:]
    g, r, i = spec.grid, pl.program_id(0), pl.program_id(1)
    q, dq_, kr = q_ref[...], dq_ref[...], _at(kinds_ref, r)
    values, dvalues = tuple(c[r] for c in consts), tuple(c[r] for c in dconsts)

    def tile(j, carry, masked):
        m, den, acc, tacc, dlse = carry
        at = pl.ds(j * g.bk, g.bk)
        kb, vb, dkb, dvb = k_ref[at, :], v_ref[at, :], dk_ref[at, :], dv_ref[at, :]
        at = _Tile(spec, r, masks, values, i, j)
        x, dx = at.logits_jvp(q, kb, dq_, dkb, dvalues, masked)
        top = jnp.maximum(m, jnp.max(x, axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)  # a row masked so far: its weights are 0, not NaN
        p, alpha = jnp.exp(x - safe[:, None]), jnp.exp(m - safe)
        pdx, pz = p * dx, _dropped(spec, seeds_ref, at, p)
        tile_t = _dot(spec, (pz * dx).astype(vb.dtype), vb, 1, 0) + _dot(spec, pz.astype(dvb.dtype), dvb, 1, 0)
        return (
            top,
            alpha * den + jnp.sum(p, axis=1),
            alpha[:, None] * acc + _dot(spec, pz.astype(vb.dtype), vb, 1, 0),
            alpha[:, None] * tacc + tile_t,
            alpha * dlse + jnp.sum(pdx, axis=1),
        )

    rows, cols = jnp.zeros((g.bq,), jnp.float32), jnp.zeros((g.bq, spec.Ep), jnp.float32)
    init = (jnp.full((g.bq,), _NEG, jnp.float32), rows, cols, cols, rows)
    m, den, acc, tacc, dlse = _kinds_loop(kinds_ref, bounds_ref, kr, i, tile, init, by_rows=True)
    seen = den > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), _NEG)
    if spec.sinks:
        sink = jnp.full((g.bq,), sinks_ref[r], jnp.float32)
        top = jnp.maximum(lse, sink)
        lse = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sink - top))
    weight = jnp.where(seen, jnp.exp(m - jnp.where(seen, lse, 0.0)), 0.0)  # 1 / the row's whole denominator
    o, dlse = acc * weight[:, None], dlse * weight
    if spec.sinks:
        dlse = dlse + jnp.exp(sinks_ref[r] - lse) * dsinks_ref[r]
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse
    top_ref[...] = m
    do_ref[...] = (tacc * weight[:, None] - dlse[:, None] * o).astype(do_ref.dtype)
    dlse_ref[...] = dlse


def forward_tangent(
    spec: Spec, q, k, v, dq, dk, dv, kinds, bounds, sinks, seeds, dsinks, masks, consts, dconsts
) -> list:
    """``[o, lse, max logit, d o, d lse]`` in one sweep: :func:`forward` and :func:`tangent` (their operands and types)."""
    g, G = spec.grid, spec.G
    b = q.shape[0]
    ops, specs = _common(kinds, bounds, sinks, seeds, masks, consts)
    extra = [dsinks, *dconsts]
    q_block = pl.BlockSpec((None, g.bq, spec.Dp), lambda r, i: (r, i, 0))
    kv = [pl.BlockSpec((None, g.s_pad, n), lambda r, i: (r // G, 0, 0)) for n in (spec.Dp, spec.Ep)]
    row_e, row = (
        pl.BlockSpec((None, g.bq, spec.Ep), lambda r, i: (r, i, 0)),
        pl.BlockSpec((None, g.bq), lambda r, i: (r, i)),
    )
    o = jax.ShapeDtypeStruct((b, g.t_pad, spec.Ep), v.dtype)
    lse = jax.ShapeDtypeStruct((b, g.t_pad), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_tangent_kernel, spec),
        grid=(b, g.nq),
        in_specs=[q_block, *kv, q_block, *kv, *specs, *(_whole(x) for x in extra)],
        out_specs=[row_e, row, row, row_e, row],
        out_shape=[o, lse, lse, o, lse],
        interpret=spec.interpret,
        compiler_params=spec.params("forward_tangent"),
        name="jattn_gpu_forward_tangent",
    )(q, k, v, dq, dk, dv, *ops, *extra)


def _dq_kernel(
    spec: Spec, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kinds_ref, bounds_ref, sinks_ref, seeds_ref, *refs
):
    """One query block: ``dq (bq, Dp)`` and its share of the score modification's arrays' gradients."""
    del sinks_ref
    masks, consts = refs[: spec.n_mask], refs[spec.n_mask : spec.n_mask + spec.mod_count]
    dq_ref, dc_refs = refs[spec.n_mask + spec.mod_count], refs[spec.n_mask + spec.mod_count + 1 :]
    g, r, i = spec.grid, pl.program_id(0), pl.program_id(1)
    q, do, kr = q_ref[...], do_ref[...], _at(kinds_ref, r)
    lse, delta = lse_ref[...], delta_ref[...]
    lse = jnp.where(lse == _NEG, jnp.inf, lse)  # a row that sees no key: weights 0
    values = tuple(c[r] for c in consts)

    def tile(j, carry, masked):
        dq, dcs = carry
        kb, vb = k_ref[pl.ds(j * g.bk, g.bk), :], v_ref[pl.ds(j * g.bk, g.bk), :]
        at = _Tile(spec, r, masks, values, i, j)
        x, pull = at.logits_vjp(q, kb, masked)
        p = jnp.exp(x - lse[:, None])
        dx = p * (_dropped(spec, seeds_ref, at, _dot(spec, do, vb, 1, 1)) - delta[:, None])
        ds, dc = pull(dx)
        dcs = tuple(a + b.astype(a.dtype) for a, b in zip(dcs, dc, strict=True))
        return dq + _dot(spec, (ds * spec.scale).astype(kb.dtype), kb, 1, 0), dcs

    floats = () if spec.mod is None else tuple(c for c, f in zip(values, spec.mod.floats, strict=True) if f)
    init = (jnp.zeros((g.bq, spec.Dp), jnp.float32), tuple(jnp.zeros(c.shape, jnp.float32) for c in floats))
    dq, dcs = _kinds_loop(kinds_ref, bounds_ref, kr, i, tile, init, by_rows=True)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    for ref, d in zip(dc_refs, dcs, strict=True):
        ref[...] = d


def dq(
    spec: Spec, q, k, v, do, lse, delta, kinds, bounds, sinks, seeds, masks, consts
) -> tuple[Array, tuple[Array, ...]]:
    """``(dq (b, Tp, Dp), dvalues)``: each floating row value ``(b, ...)`` of the score modification's gradient ``(b, nq, ...)`` float32."""
    g, G = spec.grid, spec.G
    b = q.shape[0]
    ops, specs = _common(kinds, bounds, sinks, seeds, masks, consts)
    row = lambda r, i: (r, i)  # noqa: E731
    floats = () if spec.mod is None else tuple(c for c, f in zip(consts, spec.mod.floats, strict=True) if f)
    out = pl.pallas_call(
        functools.partial(_dq_kernel, spec),
        grid=(b, g.nq),
        in_specs=[
            pl.BlockSpec((None, g.bq, spec.Dp), lambda r, i: (r, i, 0)),
            pl.BlockSpec((None, g.s_pad, spec.Dp), lambda r, i: (r // G, 0, 0)),
            pl.BlockSpec((None, g.s_pad, spec.Ep), lambda r, i: (r // G, 0, 0)),
            pl.BlockSpec((None, g.bq, spec.Ep), lambda r, i: (r, i, 0)),
            pl.BlockSpec((None, g.bq), row),
            pl.BlockSpec((None, g.bq), row),
            *specs,
        ],
        out_specs=[
            pl.BlockSpec((None, g.bq, spec.Dp), lambda r, i: (r, i, 0)),
            *(pl.BlockSpec((None, None, *c.shape[1:]), lambda r, i, n=c.ndim - 1: (r, i, *(0,) * n)) for c in floats),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            *(jax.ShapeDtypeStruct((b, g.nq, *c.shape[1:]), jnp.float32) for c in floats),
        ],
        interpret=spec.interpret,
        compiler_params=spec.params("dq"),
        name="jattn_gpu_dq",
    )(q, k, v, do, lse, delta, *ops)
    return out[0], tuple(out[1:])


def _dkdv_kernel(
    spec: Spec, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kinds_ref, tbounds_ref, sinks_ref, seeds_ref, *refs
):
    """One key block: ``dk (bk, Dp)`` and ``dv (bk, Ep)`` over the G query rows it serves."""
    del sinks_ref
    masks, consts = refs[: spec.n_mask], refs[spec.n_mask : spec.n_mask + spec.mod_count]
    dk_ref, dv_ref = refs[-2:]
    g, rk, j = spec.grid, pl.program_id(0), pl.program_id(1)
    kb, vb = k_ref[...], v_ref[...]

    def group(gi, carry):
        r = rk * spec.G + gi  # the query row
        kr = r if kinds_ref.shape[0] > 1 else 0
        values = tuple(c[r] for c in consts)

        def tile(i, carry, masked):
            dk, dv = carry
            qb, dob = q_ref[gi, pl.ds(i * g.bq, g.bq), :], do_ref[gi, pl.ds(i * g.bq, g.bq), :]
            lse, delta = lse_ref[gi, pl.ds(i * g.bq, g.bq)], delta_ref[gi, pl.ds(i * g.bq, g.bq)]
            lse = jnp.where(lse == _NEG, jnp.inf, lse)
            at = _Tile(spec, r, masks, values, i, j)
            x, pull = at.logits_vjp(qb, kb, masked)
            p = jnp.exp(x - lse[:, None])
            pz = _dropped(spec, seeds_ref, at, p)  # the bits hashed once a tile: p (z dp - delta) = pz dp - p delta
            dv = dv + _dot(spec, pz.astype(dob.dtype), dob, 0, 0)
            ds, _ = pull(pz * _dot(spec, dob, vb, 1, 1) - p * delta[:, None])
            return dk + _dot(spec, (ds * spec.scale).astype(qb.dtype), qb, 0, 0), dv

        return _kinds_loop(kinds_ref, tbounds_ref, kr, j, tile, carry, by_rows=False)

    init = (jnp.zeros((g.bk, spec.Dp), jnp.float32), jnp.zeros((g.bk, spec.Ep), jnp.float32))
    dk, dv = lax.fori_loop(0, spec.G, group, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dkdv(spec: Spec, q, k, v, do, lse, delta, kinds, tbounds, sinks, seeds, masks, consts) -> tuple[Array, Array]:
    """``(dk (b/G, Sp, Dp), dv (b/G, Sp, Ep))``; ``tbounds`` from :func:`jattn._gpu.tiles.bounds` over query blocks."""
    g, G = spec.grid, spec.G
    bkv = k.shape[0]
    grouped = (q.reshape(bkv, G, g.t_pad, spec.Dp), do.reshape(bkv, G, g.t_pad, spec.Ep))
    rows_of = (lse.reshape(bkv, G, g.t_pad), delta.reshape(bkv, G, g.t_pad))
    ops, specs = _common(kinds, tbounds, sinks, seeds, masks, consts)
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, spec),
        grid=(bkv, g.nk),
        in_specs=[
            pl.BlockSpec((None, G, g.t_pad, spec.Dp), lambda r, j: (r, 0, 0, 0)),
            pl.BlockSpec((None, G, g.t_pad, spec.Ep), lambda r, j: (r, 0, 0, 0)),
            pl.BlockSpec((None, G, g.t_pad), lambda r, j: (r, 0, 0)),
            pl.BlockSpec((None, G, g.t_pad), lambda r, j: (r, 0, 0)),
            pl.BlockSpec((None, g.bk, spec.Dp), lambda r, j: (r, j, 0)),
            pl.BlockSpec((None, g.bk, spec.Ep), lambda r, j: (r, j, 0)),
            *specs,
        ],
        out_specs=[
            pl.BlockSpec((None, g.bk, spec.Dp), lambda r, j: (r, j, 0)),
            pl.BlockSpec((None, g.bk, spec.Ep), lambda r, j: (r, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=spec.interpret,
        compiler_params=spec.params("dkdv"),
        name="jattn_gpu_dkdv",
    )(*grouped, *rows_of, k, v, *ops)
