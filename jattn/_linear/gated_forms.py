"""The two forms of the gated linear attention recurrence (:mod:`jattn._linear.gated`): chunkwise and step by step.

Dimension key as in :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._linear.feature_pairs import pair_sums
from jattn._linear.gated_inputs import Steps
from jattn._online import vary

__all__ = ["documents", "in_chunks", "lower_triangle", "run_steps", "running_sums", "unit_lower_inverse"]


def run_steps(
    steps: Steps, state: Array, *, mode: str, chunk_size: int, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array]:
    """``out (*lead, T, E)`` (0 at dropped steps) and the final state ``(*lead, D, E)`` of prepared steps."""
    state = vary(state, *(x for x in steps[:8] if x is not None))  # inside shard_map: as the steps vary
    if mode == "recurrent":
        out, state = _recurrent(steps, state, precision)
    else:
        out, state = _chunks(steps, state, chunk_size, precision)
    return jnp.where(steps.keep[..., None], out, 0.0), state


def _einsum(spec: str, *xs: Array, precision) -> Array:
    return jnp.einsum(spec, *xs, precision=precision)


def in_chunks(x: Array | None, lead: int, c: int, fill=0) -> Array | None:
    """``x (*lead, T, ...)`` as ``(*lead, n, c, ...)``, ``n = ceil(T / c)``, the last chunk padded with ``fill``.

    ``lead`` is the number of leading axes; None stays None. The chunkwise forms of the family share it.
    """
    if x is None:
        return None
    T, tail = x.shape[lead], x.shape[lead + 1 :]
    n = -(-T // c)
    x = jnp.pad(x, [(0, 0)] * lead + [(0, n * c - T)] + [(0, 0)] * len(tail), constant_values=fill)
    return x.reshape(*x.shape[:lead], n, c, *tail)


def _recurrent(steps: Steps, state: Array, precision) -> tuple[Array, Array]:
    """The recurrence one step at a time (``lax.scan`` over T)."""

    def step(S, x):
        q, k, v, g, gk, beta, reset = x
        S = jnp.where(reset[..., None, None], 0.0, S)
        if g is not None:
            S = jnp.exp(g)[..., None, None] * S
        if gk is not None:
            S = jnp.exp(gk)[..., :, None] * S
        write = v if beta is None else beta[..., None] * (v - _einsum("...de,...d->...e", S, k, precision=precision))
        S = S + k[..., :, None] * write[..., None, :]
        return S, _einsum("...de,...d->...e", S, q, precision=precision)

    xs = tuple(None if x is None else jnp.moveaxis(x, len(steps.keep.shape) - 1, 0) for x in steps[:7])
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, -2), state


def _chunks(steps: Steps, state: Array, chunk_size: int, precision) -> tuple[Array, Array]:
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
        body, xs = _carry_step(precision), _feature_delta_parts(q, k, v, g, gk, beta, runs, precision)
    elif gk is not None:
        body, xs = _per_feature(precision), (q, k, v, g, gk, runs)
    else:
        body, xs = _carry_step(precision), _scalar_parts(q, k, v, g, beta, runs, precision)
    state, out = jax.lax.scan(jax.checkpoint(body), state, xs)
    out = jnp.moveaxis(out, 0, len(lead)).reshape(*lead, n * c, E)[..., :T, :]
    return out, state


def documents(runs: Array) -> tuple[Array, Array, Array]:
    """The pairs and steps that documents allow, from each step's document in its chunk ``runs (..., C)``.

    ``seen (..., C, C)`` (s <= t in t's document), the steps that see the chunk's incoming state
    (``first``) and those whose writes reach its last (``last``).
    """
    same = runs[..., :, None] == runs[..., None, :]
    return same & lower_triangle(same.shape, 0), runs == 0, runs == runs[..., -1:]


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
    scores = _einsum("...tf,...sf->...ts", q, k, precision=precision) * decay
    u, w = v, None
    if beta is not None:  # the UT transform: (I + A)^-1 diag(β) [V | diag(into) K]
        a = beta[..., :, None] * decay * _einsum("...tf,...sf->...ts", k, k, precision=precision)
        inverse = unit_lower_inverse(jnp.where(lower_triangle(a.shape, -1), a, 0.0))
        rhs = beta[..., None] * jnp.concatenate([v, into[..., None] * k], axis=-1)  # (..., C, E + D)
        solved = _einsum("...ts,...sx->...tx", inverse, rhs, precision=precision)
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
        writes = u if w is None else u - _einsum("...tf,...fe->...te", w, S, precision=precision)
        out = _einsum("...tf,...fe->...te", q, S, precision=precision)
        out = out + _einsum("...ts,...se->...te", scores, writes, precision=precision)
        S = last[..., :, None] * S + _einsum("...sf,...se->...fe", k, writes, precision=precision)
        return S, out

    return step


def _feature_delta_parts(q, k, v, g, gk, beta, runs, precision) -> tuple[Array, ...]:
    """Per chunk, the delta rule with a decay per key feature (KDA): the parts of :func:`_carry_step`, all chunks at once.

    With ``b_t (D,)`` the running sums of the log decays from the chunk's start and ``Γ_ts = exp(b_t - b_s)``
    per feature, the writes solve ``(I + A) Δ = diag(β) (V - (exp(b) ⊙ K) S_0)`` with
    ``A_ts = β_t Σ_f k_tf Γ_tsf k_sf`` (s < t), the outputs are ``(exp(b_t) ⊙ q_t) S_0 + Σ_{s<=t}
    (Σ_f q_tf Γ_tsf k_sf) δ_s`` and the last state ``exp(b_C) ⊙ S_0 + Σ_s (Γ_Cs ⊙ k_s) δ_sᵀ``
    (:func:`jattn._linear.feature_pairs.pair_sums` forms the pair sums).
    """
    seen, first, last = documents(runs)
    hi, lo = running_sums(gk if g is None else gk + g[..., None], axis=-2)  # (..., C, D)
    into = jnp.where(first[..., None], jnp.exp(hi + lo), 0.0)
    reach = jnp.where(last[..., None], jnp.exp((hi[..., -1:, :] - hi) + (lo[..., -1:, :] - lo)), 0.0)
    scores, a = pair_sums(q, k, hi, lo, precision)
    scores = jnp.where(seen, scores, 0.0)
    a = beta[..., :, None] * jnp.where(seen & lower_triangle(seen.shape, -1), a, 0.0)
    inverse = unit_lower_inverse(a)
    rhs = beta[..., None] * jnp.concatenate([v, into * k], axis=-1)  # (..., C, E + D)
    solved = _einsum("...ts,...sx->...tx", inverse, rhs, precision=precision)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    return into * q, reach * k, into[..., -1, :], scores, u, w


def running_sums(g: Array, axis: int) -> tuple[Array, Array]:
    """The running sums ``b`` of the log decays ``g`` along ``axis`` (-1 or -2) as ``hi + lo``, to twice the precision.

    Returned with a trailing axis ``(..., C, X)`` (X = 1 for ``axis=-1``). ``hi`` is the cumulative sum, ``lo``
    what it rounded away: ``hi_t - hi_{t-1}`` is exact where the two lie within a factor 2 of each other
    (Sterbenz; else it rounds at the size of the step itself), so ``g_t`` minus it is that step's rounding
    error, and their running sum ``lo`` stays small (C roundings of ``|b|``). A difference ``b_t - b_s`` taken
    as ``(hi_t - hi_s) + (lo_t - lo_s)`` is then exact to its own rounding: after a step of log decay -1e7 the
    later steps' small decays do not cancel away as in ``hi_t - hi_s`` alone. Each log decay is first clamped
    at twice the log of the dtype's smallest subnormal, where exp is exactly 0 already (as for any sum holding
    it; so are the derivatives): no sum reaches -inf, whose differences would be NaN.
    """
    g = g[..., None] if axis == -1 else g
    g = jnp.maximum(g, 2.0 * float(np.log(np.finfo(g.dtype).smallest_subnormal)))
    hi = jnp.cumsum(g, axis=-2)
    step = hi - jnp.concatenate([jnp.zeros_like(hi[..., :1, :]), hi[..., :-1, :]], axis=-2)
    return hi, jnp.cumsum(g - step, axis=-2)


def lower_triangle(shape: tuple[int, ...], diagonal: int) -> Array:
    """Boolean ``shape (..., C, C)``: True on and below ``diagonal`` (0: the main one, -1: strictly below)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones(shape[-2:], bool), diagonal), shape)


@jax.custom_jvp
def unit_lower_inverse(a: Array) -> Array:
    """``(I + a)^-1`` for a strictly lower triangular ``a (..., C, C)``, by forward substitution (C steps).

    Not ``lax.linalg.triangular_solve``: on CPU its LAPACK call splits a batch over XLA's thread pool and waits
    for the parts, and two such calls running at once on a 2-thread pool wait for each other forever (seen in
    training with jaxlib 0.10). The derivative ``-X da X`` (rule below) serves every order.
    """
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)

    def row(t, x):  # x's rows from t on are still 0
        r = jax.lax.dynamic_index_in_dim(a, t, axis=-2, keepdims=False)
        e = jax.lax.dynamic_index_in_dim(eye, t, axis=-2, keepdims=False)
        new = e - jnp.einsum("...s,...sx->...x", r, x)
        return jax.lax.dynamic_update_index_in_dim(x, new[..., None, :], t, axis=-2)

    return jax.lax.fori_loop(0, a.shape[-1], row, jnp.zeros_like(a))


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
    (a,), (da,) = primals, tangents
    x = unit_lower_inverse(a)
    da = jnp.where(lower_triangle(da.shape, -1), da, 0.0)  # the map reads a's strictly lower part only
    return x, -jnp.einsum("...ts,...sr,...rx->...tx", x, da, x)


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
        scores = _einsum("...tf,...sf,...tsf->...ts", q * up, k * down, jnp.exp(gap), precision=precision)
        into = jnp.where(first[..., None], jnp.exp(hi) * up, 0.0)  # (..., C, D)
        out = _einsum("...tf,...fe->...te", q * into, S, precision=precision)
        out = out + _einsum("...ts,...se->...te", scores, v, precision=precision)
        reach = jnp.where(last[..., None], jnp.exp(hi[..., -1:, :] - hi) * (up[..., -1:, :] * down), 0.0)
        S = into[..., -1, :, None] * S + _einsum("...sf,...se->...fe", k * reach, v, precision=precision)
        return S, out

    return step
