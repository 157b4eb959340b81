"""The gated / delta-rule family's chunkwise forms (:func:`jattn.gated_linear_attention`, ``mode='chunk'``).

Dimension key as in :mod:`jattn._core`; the chunkwise form is derived in :mod:`jattn._linear.gated`. Per chunk,
what needs no state is computed for all chunks at once, then a rematerialised ``lax.scan`` over the chunks carries
the state: scalar decays (retention, SSD) with or without the delta rule (DeltaNet, Gated DeltaNet) as the UT
transform, a decay per key feature (GLA) with its ``(C, C, D)`` exponents, and KDA's parts
(:mod:`jattn._linear.kda.chunk`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.chunking import documents, einsum, in_chunks, lower_triangle, running_sums, unit_lower_inverse
from jattn._linear.kda.chunk import feature_delta_parts
from jattn._linear.steps import Steps

__all__ = ["chunked"]


def chunked(steps: Steps, state: Array, chunk_size: int, precision) -> tuple[Array, Array]:
    """The chunkwise form (module docstring).

    What needs no state is computed for all chunks at once, then a rematerialised ``lax.scan`` over the
    chunks carries the state.
    """
    *lead, T, E = steps.v.shape
    c = max(min(chunk_size, T), 1)
    n = -(-T // c)

    def chunked(x: Array | None, fill=0) -> Array | None:  # (*lead, T, ...) -> (n, *lead, c, ...)
        return None if x is None else jnp.moveaxis(in_chunks(x, len(lead), c, fill), len(lead), 0)

    runs = jnp.cumsum(chunked(steps.reset, False).astype(jnp.int32), axis=-1)  # each step's document in its chunk
    q, k, v, g, gk, beta = (chunked(x) for x in steps[:6])
    if gk is not None and beta is not None:
        body, xs = _carry_step(precision), feature_delta_parts(q, k, v, g, gk, beta, runs, precision)
    elif gk is not None:
        body, xs = _per_feature(precision), (q, k, v, g, gk, runs)
    else:
        body, xs = _carry_step(precision), _scalar_parts(q, k, v, g, beta, runs, precision)
    state, out = jax.lax.scan(jax.checkpoint(body), state, xs)
    out = jnp.moveaxis(out, 0, len(lead)).reshape(*lead, n * c, E)[..., :T, :]
    return out, state


def _scalar_parts(q, k, v, g, beta, runs, precision) -> tuple[Array, ...]:
    """Per chunk, with a decay per step (or none): what the state is not needed for, all chunks at once.

    The parts :func:`_carry_step` reads: ``(exp(b_t) q_t, Γ_Cs k_s, exp(b_C), scores Γ ∘ q kᵀ, u, w)``; the
    writes are ``u - w S_0`` (``w`` None without the delta rule, whose ``u`` is v).
    """
    seen, first, last = documents(runs)
    hi, lo = (x[..., 0] for x in running_sums(jnp.zeros(q.shape[:-1], q.dtype) if g is None else g, axis=-1))
    gaps = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])  # b_t - b_s
    decay = jnp.exp(jnp.where(seen, gaps, -jnp.inf))  # Γ (..., C, C)
    into = jnp.where(first, jnp.exp(hi + lo), 0.0)
    reach = jnp.where(last, jnp.exp(gaps[..., -1, :]), 0.0)
    scores = einsum("...tf,...sf->...ts", q, k, precision=precision) * decay
    u, w = v, None
    if beta is not None:  # the UT transform: (I + A)^-1 diag(β) [V | diag(into) K]
        a = beta[..., :, None] * decay * einsum("...tf,...sf->...ts", k, k, precision=precision)
        inverse = unit_lower_inverse(jnp.where(lower_triangle(a.shape, -1), a, 0.0))
        rhs = beta[..., None] * jnp.concatenate([v, into[..., None] * k], axis=-1)  # (..., C, E + D)
        solved = einsum("...ts,...sx->...tx", inverse, rhs, precision=precision)
        u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    return into[..., None] * q, reach[..., None] * k, into[..., -1:], scores, u, w


def _carry_step(precision) -> Callable:
    """The scan body of a chunk's parts: ``(S_0, parts) -> (S_C, out (..., C, E))``.

    The parts: ``q`` and ``k (..., C, D)`` already scaled by the decays into and out of the chunk, ``last``
    (``(..., 1)`` or ``(..., D)``) the decay of ``S_0`` to the chunk's end, ``scores (..., C, C)``, and the
    writes ``u - w S_0`` (``w`` None without the delta rule).
    """

    def step(S, x):
        q, k, last, scores, u, w = x
        writes = u if w is None else u - einsum("...tf,...fe->...te", w, S, precision=precision)
        out = einsum("...tf,...fe->...te", q, S, precision=precision)
        out = out + einsum("...ts,...se->...te", scores, writes, precision=precision)
        S = last[..., :, None] * S + einsum("...sf,...se->...fe", k, writes, precision=precision)
        return S, out

    return step


def _per_feature(precision) -> Callable:
    """The scan body with a decay per key feature (GLA): the exponents kept per feature (..., C, C, D).

    The exponents ``b_t - b_s`` (:func:`running_sums`) are ``(hi_t - hi_s) + (lo_t - lo_s)``; the ``lo`` parts
    go into q and k (``e^lo_t q_t``, ``e^-lo_s k_s``), so the ``(C, C, D)`` exponents are formed from ``hi`` alone.
    """

    def step(S, x):
        q, k, v, g, gk, runs = x
        seen, first, last = documents(runs)
        hi, lo = running_sums(gk if g is None else gk + g[..., None], axis=-2)  # (..., C, D)
        up, down = jnp.exp(lo), jnp.exp(-lo)
        gap = jnp.where(seen[..., None], hi[..., :, None, :] - hi[..., None, :, :], -jnp.inf)
        scores = einsum("...tf,...sf,...tsf->...ts", q * up, k * down, jnp.exp(gap), precision=precision)
        into = jnp.where(first[..., None], jnp.exp(hi) * up, 0.0)  # (..., C, D)
        out = einsum("...tf,...fe->...te", q * into, S, precision=precision)
        out = out + einsum("...ts,...se->...te", scores, v, precision=precision)
        reach = jnp.where(last[..., None], jnp.exp(hi[..., -1:, :] - hi) * (up[..., -1:, :] * down), 0.0)
        S = into[..., -1, :, None] * S + einsum("...sf,...se->...fe", k * reach, v, precision=precision)
        return S, out

    return step
