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

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._masks import EMPTY, FULL, PARTIAL, Mask, _KeyBelow

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q: Array, k: Array, v: Array, plan: _Plan, precision) -> tuple[Array, Array]:
    return _forward(q, k, v, plan, precision)


class _Plan:
    """Static facts of one call: sizes, blocks, the mask and its block schedule (hashable)."""

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

    def allowed(self, i: Array, j: Array) -> Array:
        """``(bq, bk)`` mask of query block i against key block j (block indices, traced)."""
        rows = self.q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)[:, None]
        cols = self.kv_offset + j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)[None, :]
        return self.predicate.allowed(rows, cols)

    def scores(self, qb: Array, kb: Array, i: Array, j: Array, masked: bool, precision) -> tuple[Array, Array | None]:
        """Scaled scores ``(B, bq, bk)`` and, for a partial block, its mask ``(1, bq, bk)``."""
        s = _scaled_scores(qb, kb, self.scale, self.compute, precision)
        return s, (self.allowed(i, j)[None] if masked else None)


def _blocks(x: Array, size: int) -> Array:
    """``(B, n*size, X) -> (n, B, size, X)``."""
    b, length, f = x.shape
    return jnp.moveaxis(x.reshape(b, length // size, size, f), 1, 0)


def _scaled_scores(qb: Array, kb: Array, scale: float, compute, precision) -> Array:
    """``scale · q kᵀ`` of one block: ``(B, t, D) x (B, s, D) -> (B, t, s)`` in the compute dtype."""
    s = jnp.einsum("btd,bsd->bts", qb, kb, precision=precision, preferred_element_type=compute)
    return s * jnp.asarray(scale, compute)


def _per_block(kind: Array, update, carry):
    """Runs ``update(carry, masked)`` on a PARTIAL or FULL block; an EMPTY one is skipped."""
    branches = {EMPTY: lambda c: c, PARTIAL: functools.partial(update, masked=True)}
    branches[FULL] = functools.partial(update, masked=False)
    return jax.lax.switch(kind.astype(jnp.int32), [branches[k] for k in range(3)], carry)


def _flat_lead(x: Array, lead: tuple[int, ...]) -> Array:
    """``(..., L, X)`` broadcast to the leading shape ``lead`` and flattened: ``(B, L, X)``."""
    return jnp.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(-1, *x.shape[-2:])


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
    p = jnp.exp(s - m_safe[..., None])  # exactly 0 at masked entries
    alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
    pv = jnp.einsum("bts,bse->bte", p.astype(vb.dtype), vb, precision=precision, preferred_element_type=compute)
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
    p = jnp.exp(s - lse[..., None])
    if keep is not None:
        p = jnp.where(keep, p, jnp.zeros((), p.dtype))
    dp = jnp.einsum("bte,bse->bts", do, vb, precision=precision, preferred_element_type=compute)
    return p, p * (dp - delta[..., None]) * scale


def _forward(q, k, v, plan: _Plan, precision):
    qs, ks, vs = _blocks(q, plan.bq), _blocks(k, plan.bk), _blocks(v, plan.bk)  # (n, B, blk, X)
    index, kind = jnp.asarray(plan.index), jnp.asarray(plan.kind)
    b, e = q.shape[0], v.shape[-1]

    def query_block(args):
        i, qb = args

        def key_block(carry, jk):
            j, kd = jk

            def update(carry, masked):
                s, keep = plan.scores(qb, ks[j], i, j, masked, precision)
                return _accumulate(carry, s, keep, vs[j], precision, plan.compute)

            return _per_block(kd, update, carry), None

        init = _empty_state(b, plan.bq, e, plan.compute)
        state, _ = jax.lax.scan(key_block, init, (index[i], kind[i]))
        return _finish(state, v.dtype)

    out, lse = jax.lax.map(query_block, (jnp.arange(plan.nq, dtype=jnp.int32), qs))  # (nq, B, bq, E), (nq, B, bq)
    out = jnp.moveaxis(out, 0, 1).reshape(b, plan.nq * plan.bq, e)
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, plan.nq * plan.bq)
    return out, lse


def _flash_fwd(q, k, v, plan, precision):
    out, lse = _forward(q, k, v, plan, precision)
    return (out, lse), (q, k, v, out, lse)


def _flash_bwd(plan: _Plan, precision, res, cotangents):
    """The flash-attention backward in two passes, each with small carries only.

    dq per query block over its key blocks, then dk and dv per key block over its query blocks
    (the transposed schedule).
    """
    q, k, v, out, lse = res
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
        s, keep = plan.scores(qs[i], ks[j], i, j, masked, precision)
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

    plan_index, plan_kind = jnp.asarray(plan.index), jnp.asarray(plan.kind)
    plan_index_t, plan_kind_t = jnp.asarray(plan.index_t), jnp.asarray(plan.kind_t)
    dq = jax.lax.map(dq_block, jnp.arange(plan.nq, dtype=jnp.int32))  # (nq, B, bq, D)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(plan.nk, dtype=jnp.int32))  # (nk, B, bk, D|E)

    def unblock(x, like):
        return jnp.moveaxis(x, 0, 1).reshape(like.shape).astype(like.dtype)

    return unblock(dq, q), unblock(dk, k), unblock(dv, v)


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

    Returns ``out (..., T, E)`` and ``lse (..., T)``; see the module docstring.
    """
    lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    T, S = q.shape[-2], k.shape[-2]
    qf, kf, vf = (_flat_lead(x, lead) for x in (q, k, v))
    bq, bk = min(block_q, T), min(block_kv, S)
    compute = jnp.dtype(jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    q_offset = kv_offset + S - T if q_offset is None else q_offset
    plan = _Plan(T, S, bq, bk, mask, int(q_offset), int(kv_offset), float(scale), compute)
    out, lse = _flash(_pad(qf, 1, bq), _pad(kf, 1, bk), _pad(vf, 1, bk), plan, precision)
    return out[:, :T].reshape(*lead, T, -1), lse[:, :T].reshape(*lead, T)
