"""Memory-efficient blockwise attention: an online softmax over key blocks, query blocks in turn.

Shapes follow :mod:`jattn._core` (after broadcasting, leading dimensions are flattened to one
axis ``B``): q ``(B, T, D)``, k ``(B, S, D)``, v ``(B, S, E)``. Queries are tiled into blocks of
``block_q`` rows and keys into blocks of ``block_kv``. A mask predicate classifies every
(query block, key block) pair statically as empty, partial or full
(:meth:`jattn.masks.Mask.block_kinds`): empty blocks are never computed, full blocks skip the
mask, partial blocks apply it. Each query block runs a ``lax.scan`` over the list of its
non-empty key blocks only, so causal attention costs about half of full attention and a sliding
window of width w costs O(T·w).

Per query block the running state is the row max ``m``, the normaliser ``l`` and the unnormalised
output ``acc``; a key block with scores ``x`` updates them as

    m' = max(m, rowmax x),  l' = l·e^(m - m') + rowsum e^(x - m'),  acc' = acc·e^(m - m') + e^(x - m') v

The backward pass (``jax.custom_vjp``) recomputes each block's weights from the saved output and
log-sum-exp (the flash-attention recurrence) and skips the same blocks, so training memory is
O(T) too: no ``(T, S)`` array is ever formed.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._masks import EMPTY, FULL, PARTIAL, Mask, _KeyBelow, fill_arrays, split_arrays, tile_kinds
from jattn._softmax import shifted_exp

__all__ = ["blockwise_attention"]


def _schedule(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query block, its non-empty key blocks ``(nq, width)`` and their kinds (EMPTY = padding)."""
    width = max(1, int((kinds != EMPTY).sum(1).max()))
    index = np.zeros((kinds.shape[0], width), np.int32)
    kind = np.full((kinds.shape[0], width), EMPTY, np.int8)
    for i, row in enumerate(kinds):
        cols = np.flatnonzero(row != EMPTY)
        index[i, : len(cols)] = cols
        kind[i, : len(cols)] = row[cols]
    return index, kind


def _pad(x: Array, axis: int, multiple: int) -> Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q: Array, k: Array, v: Array, run: _Run, plan: _Plan, precision) -> tuple[Array, Array]:
    return _forward(q, k, v, run, plan, precision)


class _Run(NamedTuple):
    """The traced part of a plan: the mask's arrays and the run-time kinds of the scheduled tiles.

    ``kind (nq, width)`` and ``kind_t (nk, width_t)`` refine the static schedule's kinds with what the
    arrays say (EMPTY tiles are skipped on device); ``arrays`` are the mask's array leaves, each
    ``(B|1, T, S)`` (or with unit T, S axes). Both empty without array masks.
    """

    kind: Array
    kind_t: Array
    arrays: tuple[Array, ...]


class _Plan:
    """Static facts of one call: sizes, blocks, the mask's skeleton and its block schedule (hashable).

    Array leaves of the mask are slots here (:func:`jattn._masks.split_arrays`): statically
    every tile they touch is scheduled, and :class:`_Run` carries their arrays and run-time kinds.
    """

    def __init__(self, T, S, bq, bk, mask, q_offset, kv_offset, scale, compute):
        self.T, self.S, self.bq, self.bk = T, S, bq, bk
        self.nq, self.nk = -(-T // bq), -(-S // bk)
        self.mask, self.q_offset, self.kv_offset = mask, q_offset, kv_offset
        self.scale, self.compute = scale, compute
        # Keys past S (block padding) are masked by a "key position < kv_offset + S" predicate.
        limit = _KeyBelow(kv_offset + S)
        full = limit if mask is None else mask & limit
        kinds = full.block_kinds(self.nq * bq, self.nk * bk, bq, bk, q_offset=q_offset, kv_offset=kv_offset)
        self.predicate = full
        self.index, self.kind = _schedule(kinds)  # per query block: its key blocks
        self.index_t, self.kind_t = _schedule(kinds.T)  # per key block: its query blocks
        self._key = (T, S, bq, bk, mask, q_offset, kv_offset, scale, compute)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Plan) and self._key == other._key

    def predicate_with(self, arrays: tuple[Array, ...]) -> Mask:
        """The mask with its arrays put back and placed at this call's offsets."""
        return fill_arrays(self.predicate, arrays)._bind(self.q_offset, self.kv_offset)

    def allowed(self, i: Array, j: Array, arrays: tuple[Array, ...]) -> Array:
        """``(1|B, bq, bk)`` mask of query block i against key block j (block indices, traced)."""
        rows = self.q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)[:, None]
        cols = self.kv_offset + j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)[None, :]
        keep = self.predicate_with(arrays).allowed(rows, cols)
        return keep.reshape((1,) * (3 - keep.ndim) + keep.shape)

    def scores(self, qb: Array, kb: Array, i: Array, j: Array, masked: bool, precision, arrays=()) -> tuple:
        """Scaled scores ``(B, bq, bk)`` and, for a partial block, its mask ``(1|B, bq, bk)``."""
        s = _scaled_scores(qb, kb, self.scale, self.compute, precision)
        return s, (self.allowed(i, j, arrays) if masked else None)

    def run(self, arrays: tuple[Array, ...]) -> _Run:
        """The traced schedule kinds: the static ones, refined on device where the mask has arrays."""
        if not arrays:
            return _Run(jnp.asarray(self.kind), jnp.asarray(self.kind_t), ())
        kinds = tile_kinds(
            self.predicate_with(arrays),
            self.nq * self.bq,
            self.nk * self.bk,
            self.bq,
            self.bk,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
        )  # (nq, nk)

        def refine(static_kind, index, kinds):  # padding entries of the schedule stay EMPTY
            rows = np.arange(index.shape[0])[:, None]
            return jnp.where(jnp.asarray(static_kind) == EMPTY, jnp.int8(EMPTY), kinds[rows, index])

        return _Run(refine(self.kind, self.index, kinds), refine(self.kind_t, self.index_t, kinds.T), arrays)


def _blocks(x: Array, size: int) -> Array:
    """``(B, n*size, X) -> (n, B, size, X)``."""
    b, length, f = x.shape
    return jnp.moveaxis(x.reshape(b, length // size, size, f), 1, 0)


def _scaled_scores(qb: Array, kb: Array, scale: float, compute, precision) -> Array:
    """``scale · q kᵀ`` of one block: ``(B, t, D) x (B, s, D) -> (B, t, s)`` in the compute dtype."""
    qs = qb.astype(compute) * jnp.asarray(scale, compute)  # scale q, not the scores: see jattn._core._logits
    return jnp.einsum("btd,bsd->bts", qs, kb.astype(compute), precision=precision, preferred_element_type=compute)


def _per_block(kind: Array, update, carry):
    """Runs ``update(carry, masked)`` on a PARTIAL or FULL block; an EMPTY one is skipped."""
    branches = {EMPTY: lambda c: c, PARTIAL: functools.partial(update, masked=True)}
    branches[FULL] = functools.partial(update, masked=False)
    return jax.lax.switch(kind.astype(jnp.int32), [branches[k] for k in range(3)], carry)


def _flat_lead(x: Array, lead: tuple[int, ...]) -> Array:
    """``(..., L, X)`` broadcast to the leading shape ``lead`` and flattened: ``(B, L, X)``."""
    return jnp.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(math.prod(lead), *x.shape[-2:])


def _empty_state(b: int, t: int, e: int, compute) -> tuple[Array, Array, Array]:
    """The online-softmax state of ``t`` query rows before any key: ``m``, ``l`` ``(B, t)``, ``acc`` ``(B, t, E)``."""
    return jnp.full((b, t), -jnp.inf, compute), jnp.zeros((b, t), compute), jnp.zeros((b, t, e), compute)


def _accumulate(state, s: Array, keep: Array | None, vb: Array, precision, compute):
    """Folds one key block (scores ``s (B, t, s)``, optional mask ``keep``, values ``vb (B, s, E)``) into the state."""
    m, norm, acc = state
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
    p = shifted_exp(s, m_safe[..., None])  # exactly 0 at masked entries
    alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
    # float32 weights against v upcast: rounding p to v's dtype here would leave the backward's
    # delta = rowsum(dO·O) out of step with the unrounded p it recomputes (see jattn._core).
    pv = jnp.einsum("bts,bse->bte", p, vb.astype(compute), precision=precision, preferred_element_type=compute)
    return m_new, norm * alpha + jnp.sum(p, -1), acc * alpha[..., None] + pv


def _finish(state, dtype) -> tuple[Array, Array]:
    """``out (B, t, E)`` in ``dtype`` and ``lse (B, t)`` (``-inf`` and 0 output for rows that saw no key)."""
    m, norm, acc = state
    safe = jnp.where(norm == 0, jnp.ones_like(norm), norm)
    lse = jnp.where(norm == 0, -jnp.inf, m + jnp.log(safe))
    return (acc / safe[..., None]).astype(dtype), lse


def _score_grads(s, keep, lse, do, vb, delta, scale, precision, compute) -> tuple[Array, Array]:
    """``p`` and ``ds = p (dp - delta) scale`` of one block, each ``(B, t, s)``, from the saved ``lse (B, t)``.

    ``lse`` must be finite (0 for empty rows, whose ``p`` is 0 by the mask); ``delta = rowsum(dO ∘ O)``.
    """
    p = shifted_exp(s, lse[..., None])
    if keep is not None:
        p = jnp.where(keep, p, jnp.zeros((), p.dtype))
    dp = jnp.einsum("bte,bse->bts", do, vb, precision=precision, preferred_element_type=compute)
    return p, p * (dp - delta[..., None]) * scale


def _forward(q, k, v, run: _Run, plan: _Plan, precision):
    qs, ks, vs = _blocks(q, plan.bq), _blocks(k, plan.bk), _blocks(v, plan.bk)  # (n, B, blk, X)
    index, kind = jnp.asarray(plan.index), run.kind
    b, e = q.shape[0], v.shape[-1]

    def query_block(args):
        i, qb = args

        def key_block(carry, jk):
            j, kd = jk

            def update(carry, masked):
                s, keep = plan.scores(qb, ks[j], i, j, masked, precision, run.arrays)
                return _accumulate(carry, s, keep, vs[j], precision, plan.compute)

            return _per_block(kd, update, carry), None

        init = _empty_state(b, plan.bq, e, plan.compute)
        state, _ = jax.lax.scan(key_block, init, (index[i], kind[i]))
        return _finish(state, plan.compute)  # float32 (or 64): the backward's delta needs it unrounded

    out, lse = jax.lax.map(query_block, (jnp.arange(plan.nq, dtype=jnp.int32), qs))  # (nq, B, bq, E), (nq, B, bq)
    out = jnp.moveaxis(out, 0, 1).reshape(b, plan.nq * plan.bq, e)
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, plan.nq * plan.bq)
    return out, lse


def _flash_fwd(q, k, v, run, plan, precision):
    out, lse = _forward(q, k, v, run, plan, precision)
    return (out, lse), (q, k, v, run, out, lse)


def _flash_bwd(plan: _Plan, precision, res, cotangents):
    """The flash-attention backward in two passes, each with small carries only.

    dq per query block over its key blocks, then dk and dv per key block over its query blocks
    (the transposed schedule).
    """
    q, k, v, run, out, lse = res
    d_out, _ = cotangents  # the log-sum-exp is an output for inspection, not differentiated
    b = q.shape[0]
    qs, dos = _blocks(q, plan.bq), _blocks(d_out, plan.bq)
    ks, vs = _blocks(k, plan.bk), _blocks(v, plan.bk)
    lse = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), lse)  # empty rows have p = 0 anyway
    delta = jnp.sum(d_out.astype(plan.compute) * out.astype(plan.compute), -1)  # (B, T) rowsum(dO ∘ O)
    lse_b = jnp.moveaxis(lse.reshape(b, plan.nq, plan.bq), 1, 0)  # (nq, B, bq)
    delta_b = jnp.moveaxis(delta.reshape(b, plan.nq, plan.bq), 1, 0)
    scale = jnp.asarray(plan.scale, plan.compute)

    def grads_of_scores(i, j, masked):
        """``p`` and ``ds = p (dp - delta) scale`` of block (i, j), each ``(B, bq, bk)``."""
        s, keep = plan.scores(qs[i], ks[j], i, j, masked, precision, run.arrays)
        return _score_grads(s, keep, lse_b[i], dos[i], vs[j], delta_b[i], scale, precision, plan.compute)

    def dq_block(i):
        def step(dq, jk):
            j, kd = jk

            def update(dq, masked):
                _, ds = grads_of_scores(i, j, masked)
                return dq + jnp.einsum("bts,bsd->btd", ds, ks[j].astype(plan.compute), precision=precision)

            return _per_block(kd, update, dq), None

        dq, _ = jax.lax.scan(step, jnp.zeros((b, plan.bq, q.shape[-1]), plan.compute), (plan_index[i], plan_kind[i]))
        return dq

    def dkv_block(j):
        def step(carry, ik):
            i, kd = ik

            def update(carry, masked):
                dk, dv = carry
                p, ds = grads_of_scores(i, j, masked)
                dk = dk + jnp.einsum("bts,btd->bsd", ds, qs[i].astype(plan.compute), precision=precision)
                dv = dv + jnp.einsum("bts,bte->bse", p, dos[i].astype(plan.compute), precision=precision)
                return dk, dv

            return _per_block(kd, update, carry), None

        init = (jnp.zeros((b, plan.bk, k.shape[-1]), plan.compute), jnp.zeros((b, plan.bk, v.shape[-1]), plan.compute))
        (dk, dv), _ = jax.lax.scan(step, init, (plan_index_t[j], plan_kind_t[j]))
        return dk, dv

    plan_index, plan_kind = jnp.asarray(plan.index), run.kind
    plan_index_t, plan_kind_t = jnp.asarray(plan.index_t), run.kind_t
    dq = jax.lax.map(dq_block, jnp.arange(plan.nq, dtype=jnp.int32))  # (nq, B, bq, D)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(plan.nk, dtype=jnp.int32))  # (nk, B, bk, D|E)

    def unblock(x, like):
        return jnp.moveaxis(x, 0, 1).reshape(like.shape).astype(like.dtype)

    return unblock(dq, q), unblock(dk, k), unblock(dv, v), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale: float,
    q_offset: int | None,
    kv_offset: int,
    block_q: int,
    block_kv: int,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[Array, Array]:
    """Blockwise attention of validated ``q (..., T, D)``, ``k (..., S, D)``, ``v (..., S, E)``.

    ``mask`` is a position predicate, possibly with array leaves ``(..., T, S)`` that broadcast
    against the leading dimensions. Returns ``out (..., T, E)`` and ``lse (..., T)``; see the
    module docstring.
    """
    T, S = q.shape[-2], k.shape[-2]
    skeleton, arrays = (None, []) if mask is None else split_arrays(mask)
    lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    lead = _mask_lead(arrays, lead, T, S)
    qf, kf, vf = (_flat_lead(x, lead) for x in (q, k, v))
    arrays = tuple(_flat_mask(m, lead) for m in arrays)  # each (B|1, T|1, S|1)
    if T == 0 or S == 0:  # no tiles: every row is empty
        b = qf.shape[0]
        out, lse = jnp.zeros((b, T, v.shape[-1]), v.dtype), jnp.full((b, T), -jnp.inf, _compute(q.dtype))
        return out.reshape(*lead, T, v.shape[-1]), lse.reshape(*lead, T)
    bq, bk = min(block_q, T), min(block_kv, S)
    q_offset = kv_offset + S - T if q_offset is None else q_offset
    plan = _Plan(T, S, bq, bk, skeleton, int(q_offset), int(kv_offset), float(scale), _compute(q.dtype))
    run = plan.run(arrays)
    out, lse = _flash(_pad(qf, 1, bq), _pad(kf, 1, bk), _pad(vf, 1, bk), run, plan, precision)
    return out[:, :T].reshape(*lead, T, v.shape[-1]).astype(v.dtype), lse[:, :T].reshape(*lead, T)


def _compute(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def _mask_lead(arrays: list[Array], lead: tuple[int, ...], T: int, S: int) -> tuple[int, ...]:
    """The leading shape of q, k, v and the mask arrays together, or an error naming the shapes."""
    for m in arrays:
        if m.shape[-2] not in (1, T) or m.shape[-1] not in (1, S):
            raise ValueError(f"mask of shape {m.shape} does not broadcast to (..., T, S) = (..., {T}, {S})")
        try:
            lead = tuple(np.broadcast_shapes(lead, m.shape[:-2]))
        except ValueError:
            raise ValueError(
                f"mask of shape {m.shape} does not broadcast against q, k, v of leading shape {lead}"
            ) from None
    return lead


def _flat_mask(m: Array, lead: tuple[int, ...]) -> Array:
    """A mask array ``(..., T|1, S|1)`` as ``(1, ...)`` when it has no leading extent, else ``(B, ...)``."""
    if all(n == 1 for n in m.shape[:-2]):
        return m.reshape(1, *m.shape[-2:])
    return _flat_lead(m, lead)
