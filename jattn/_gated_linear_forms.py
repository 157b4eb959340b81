"""The two forms of the gated linear attention recurrence (:mod:`jattn._gated_linear`): chunkwise and step by step.

Dimension key as in :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._gated_linear_steps import Steps
from jattn._online import vary

__all__ = ["run_steps"]


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
    """The chunkwise form (module docstring): a rematerialised ``lax.scan`` over chunks of ``chunk_size`` steps."""
    *lead, T, E = steps.v.shape
    c = max(min(chunk_size, T), 1)
    n = -(-T // c)

    def chunked(x: Array | None, fill=0) -> Array | None:  # (*lead, T, ...) -> (n, *lead, c, ...)
        if x is None:
            return None
        tail = x.shape[len(lead) + 1 :]
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, n * c - T)] + [(0, 0)] * len(tail), constant_values=fill)
        return jnp.moveaxis(x.reshape(*lead, n, c, *tail), len(lead), 0)

    runs = jnp.cumsum(chunked(steps.reset, False).astype(jnp.int32), axis=-1)  # each step's document in its chunk
    xs = (*(chunked(x) for x in steps[:6]), runs)
    body = jax.checkpoint(_chunk_step(precision, steps.beta is not None))
    state, out = jax.lax.scan(body, state, xs)
    out = jnp.moveaxis(out, 0, len(lead)).reshape(*lead, n * c, E)[..., :T, :]
    return out, state


def _chunk_step(precision, delta: bool) -> Callable:
    """The body of the chunk scan: ``(S_0, chunk) -> (S_C, out (..., C, E))``."""

    def step(S, x):
        q, k, v, g, gk, beta, run = x
        same = run[..., :, None] == run[..., None, :]
        seen = same & _lower(same.shape, 0)  # (..., C, C): s <= t in t's document
        first = run == 0  # (..., C): the steps that see S_0
        last = run == run[..., -1:]  # the steps whose writes reach S_C
        if gk is not None:
            return _per_feature(S, q, k, v, g, gk, seen, first, last, precision)
        b = jnp.zeros(q.shape[:-1], q.dtype) if g is None else jnp.cumsum(g, axis=-1)
        decay = jnp.exp(jnp.where(seen, b[..., :, None] - b[..., None, :], -jnp.inf))  # Γ (..., C, C)
        into = jnp.where(first, jnp.exp(b), 0.0)  # exp(b_t) for the steps that see S_0
        writes = v
        if delta:
            writes = _delta_writes(S, k, v, beta, decay, into, precision)
        scores = _einsum("...tf,...sf->...ts", q, k, precision=precision) * decay
        out = into[..., None] * _einsum("...tf,...fe->...te", q, S, precision=precision)
        out = out + _einsum("...ts,...se->...te", scores, writes, precision=precision)
        reach = jnp.where(last, jnp.exp(b[..., -1:] - b), 0.0)  # Γ_Cs
        S = into[..., -1, None, None] * S + _einsum("...sf,...s,...se->...fe", k, reach, writes, precision=precision)
        return S, out

    return step


def _lower(shape: tuple[int, ...], diagonal: int) -> Array:
    """Boolean ``shape (..., C, C)``: True on and below ``diagonal`` (0: the main one, -1: strictly below)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones(shape[-2:], bool), diagonal), shape)


def _delta_writes(S, k, v, beta, decay, into, precision) -> Array:
    """The delta rule's writes Δ (..., C, E) of a chunk: ``(I + A) Δ = diag(β)(V - diag(into) K S_0)`` (UT transform)."""
    a = beta[..., :, None] * decay * _einsum("...tf,...sf->...ts", k, k, precision=precision)
    system = jnp.where(_lower(a.shape, -1), a, 0.0) + jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    rhs = beta[..., None] * jnp.concatenate([v, into[..., None] * k], axis=-1)  # (..., C, E + D)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    return u - _einsum("...tf,...fe->...te", w, S, precision=precision)


def _per_feature(S, q, k, v, g, gk, seen, first, last, precision) -> tuple[Array, Array]:
    """A chunk with a decay per key feature (GLA): the exponents ``B_tf - B_sf`` kept per feature (..., C, C, D)."""
    logs = gk if g is None else gk + g[..., None]
    b = jnp.cumsum(logs, axis=-2)  # (..., C, D)
    gap = jnp.where(seen[..., None], b[..., :, None, :] - b[..., None, :, :], -jnp.inf)
    scores = _einsum("...tf,...sf,...tsf->...ts", q, k, jnp.exp(gap), precision=precision)
    into = jnp.where(first[..., None], jnp.exp(b), 0.0)  # (..., C, D)
    out = _einsum("...tf,...fe->...te", q * into, S, precision=precision)
    out = out + _einsum("...ts,...se->...te", scores, v, precision=precision)
    reach = jnp.where(last[..., None], jnp.exp(b[..., -1:, :] - b), 0.0)  # (..., C, D)
    S = into[..., -1, :, None] * S + _einsum("...sf,...se->...fe", k * reach, v, precision=precision)
    return S, out
