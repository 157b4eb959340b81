"""The online-softmax maths shared by the blockwise path and ring attention.

Shapes follow :mod:`jattn._core`, with leading dimensions flattened to one axis ``B``: a query
tile ``(B, t, D)`` meets a key tile ``(B, s, D)`` and a value tile ``(B, s, E)``. The running
state of ``t`` query rows is the row max ``m (B, t)``, the normaliser ``l (B, t)`` and the
unnormalised output ``acc (B, t, E)``; a key tile with scores ``x`` updates them as

    m' = max(m, rowmax x),  l' = l·e^(m - m') + rowsum e^(x - m'),  acc' = acc·e^(m - m') + e^(x - m') v

The backward pass recomputes a tile's weights ``p = e^(x - lse)`` from the saved log-sum-exp and
accumulates ``dq += ds k``, ``dk += dsᵀ q``, ``dv += pᵀ dO`` with ``ds = p (dO vᵀ - delta) scale``
and ``delta = rowsum(dO ∘ O)`` (:func:`tile_grads`). Everything accumulates in
:func:`compute_dtype`: float32 for bf16/f16/f32, float64 for float64.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import Array

from jattn._masks import EMPTY, FULL, PARTIAL
from jattn._softmax import shifted_exp

__all__ = [
    "accumulate",
    "backward_rows",
    "compute_dtype",
    "empty_state",
    "finish",
    "flat_lead",
    "per_block",
    "scaled_scores",
    "score_grads",
    "tile_grads",
]


def compute_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, float32 for everything else (the softmax is never done in 16 bits)."""
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def flat_lead(x: Array, lead: tuple[int, ...]) -> Array:
    """``(..., L, X)`` broadcast to the leading shape ``lead`` and flattened: ``(B, L, X)``."""
    return jnp.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(math.prod(lead), *x.shape[-2:])


def scaled_scores(qb: Array, kb: Array, scale: float, compute, precision) -> Array:
    """``scale · q kᵀ`` of one tile: ``(B, t, D) x (B, s, D) -> (B, t, s)`` in the compute dtype.

    ``scale == 1.0`` (a q that carries the scale already) skips the multiplication.
    """
    s = jnp.einsum(
        "btd,bsd->bts", qb.astype(compute), kb.astype(compute), precision=precision, preferred_element_type=compute
    )
    return s if isinstance(scale, float) and scale == 1.0 else s * jnp.asarray(scale, compute)


def per_block(kind: Array, update, carry, uniform: int | None = None):
    """Runs ``update(carry, masked)`` on a PARTIAL or FULL tile; an EMPTY one is skipped.

    ``uniform`` (PARTIAL or FULL) says statically that every tile has that kind: no branch.
    """
    if uniform is not None:
        return update(carry, masked=uniform == PARTIAL)
    branches = {EMPTY: lambda c: c, PARTIAL: functools.partial(update, masked=True)}
    branches[FULL] = functools.partial(update, masked=False)
    return jax.lax.switch(kind.astype(jnp.int32), [branches[k] for k in range(3)], carry)


def empty_state(b: int, t: int, e: int, compute) -> tuple[Array, Array, Array]:
    """The state of ``t`` query rows before any key: ``m``, ``l`` ``(B, t)``, ``acc`` ``(B, t, E)``."""
    return jnp.full((b, t), -jnp.inf, compute), jnp.zeros((b, t), compute), jnp.zeros((b, t, e), compute)


def accumulate(state, s: Array, keep: Array | None, vb: Array, precision, compute):
    """Folds one key tile (scores ``s (B, t, s)``, optional mask ``keep``, values ``vb (B, s, E)``) into the state."""
    m, norm, acc = state
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
    # exp(min(x - m, 0)): the clamp of shifted_exp in one pass (this update is never differentiated:
    # the gradients are tile_grads'); exactly 0 at masked entries.
    p = jnp.exp(jnp.minimum(s - m_safe[..., None], jnp.zeros((), s.dtype)))
    alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
    # float32 weights against v upcast: rounding p to v's dtype here would leave the backward's
    # delta = rowsum(dO·O) out of step with the unrounded p it recomputes (see jattn._core).
    pv = jnp.einsum("bts,bse->bte", p, vb.astype(compute), precision=precision, preferred_element_type=compute)
    return m_new, norm * alpha + jnp.sum(p, -1), acc * alpha[..., None] + pv


def finish(state, dtype) -> tuple[Array, Array]:
    """``out (B, t, E)`` in ``dtype`` and ``lse (B, t)`` (``-inf`` and 0 output for rows that saw no key)."""
    m, norm, acc = state
    safe = jnp.where(norm == 0, jnp.ones_like(norm), norm)
    lse = jnp.where(norm == 0, -jnp.inf, m + jnp.log(safe))
    return (acc / safe[..., None]).astype(dtype), lse


def backward_rows(out: Array, d_out: Array, lse: Array, compute) -> tuple[Array, Array]:
    """Per query row for the backward: a finite ``lse (B, T)`` (0 on empty rows) and ``delta = rowsum(dO ∘ O)``."""
    lse = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), lse)  # empty rows have p = 0 by the mask anyway
    return lse, jnp.sum(d_out.astype(compute) * out.astype(compute), -1)


def score_grads(s, keep, lse, do, vb, delta, scale, precision, compute) -> tuple[Array, Array]:
    """``p`` and ``ds = p (dp - delta) scale`` of one tile, each ``(B, t, s)``, from the saved ``lse (B, t)``.

    ``lse`` must be finite (0 for empty rows, whose ``p`` is 0 by the mask); ``delta = rowsum(dO ∘ O)``.
    """
    p = shifted_exp(s, lse[..., None])
    if keep is not None:
        p = jnp.where(keep, p, jnp.zeros((), p.dtype))
    dp = jnp.einsum("bte,bse->bts", do, vb, precision=precision, preferred_element_type=compute)
    return p, p * (dp - delta[..., None]) * scale


def tile_grads(p: Array, ds: Array, qb: Array, kb: Array, do: Array, precision, compute) -> tuple[Array, Array, Array]:
    """One tile's shares of the gradients: ``dq (B, t, D)``, ``dk (B, s, D)``, ``dv (B, s, E)``.

    From ``p, ds (B, t, s)`` (:func:`score_grads`), ``qb (B, t, D)``, ``kb (B, s, D)`` and
    ``do (B, t, E)``, accumulated in ``compute``.
    """

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b.astype(compute), precision=precision, preferred_element_type=compute)

    return dot("bts,bsd->btd", ds, kb), dot("bts,btd->bsd", ds, qb), dot("bts,bte->bse", p, do)
