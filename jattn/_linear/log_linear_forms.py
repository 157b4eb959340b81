r"""The two forms of log-linear attention (:mod:`jattn._linear.log_linear`): chunkwise and step by step.

Dimension key as in :mod:`jattn._core`; L: the levels of the Fenwick partition. The level of key step ``s``
for query step ``t >= s`` is :func:`level` ``(t, s) = bit_length(t XOR s)`` (0 for ``s = t``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._linear.gated_forms import documents, in_chunks, lower_triangle, running_sums, unit_lower_inverse
from jattn._linear.gated_inputs import Steps

__all__ = ["chunked", "level", "levels_needed", "recurrent"]


def level(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The Fenwick level of key position ``s`` for query position ``t >= s`` (integers): ``bit_length(t ^ s)``."""
    x = np.bitwise_xor(np.asarray(t, np.int64), np.asarray(s, np.int64))
    return np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64) + 1, 0)


def levels_needed(length: int) -> int:
    """The levels positions ``0 .. length-1`` use: ``bit_length(length - 1) + 1`` (1 for one step)."""
    return max(int(length) - 1, 0).bit_length() + 1


def _bit_length(x: Array) -> Array:
    """``bit_length`` of non-negative int32 ``x`` (elementwise)."""
    return 32 - jax.lax.clz(x.astype(jnp.int32))


def _einsum(spec: str, *xs: Array, precision) -> Array:
    return jnp.einsum(spec, *xs, precision=precision)


def recurrent(
    steps: Steps, lam: Array, state: Array, start: Array, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array, Array]:
    """Step by step: ``out (*lead, T, E)``, the level states ``(*lead, L, D, E)`` and ``overflow (*lead,)``.

    The states are those after the last kept step; ``overflow``: a kept step at a position that needs more
    than L levels.

    ``state``: the level states before the first step, relative to position ``start - 1``; ``start (*lead,)`` int32.
    At a kept step at position ``p``, after the last kept one at ``p0``, levels ``0 .. h-1`` merge into level
    ``h = bit_length(p0 ^ p)`` (the Fenwick merge: relative to ``p`` their keys all lie at level h, which was
    empty), every level takes the step's transition, and level 0 becomes the step's write. A dropped step changes
    nothing but a reset (which zeroes every level).
    """
    L = state.shape[-3]
    levels = jnp.arange(L, dtype=jnp.int32).reshape((1,) * (state.ndim - 3) + (L,))  # (1.., L)

    def step(carry, x):
        S, last = carry  # (*lead, L, D, E), (*lead,)
        q, k, v, g, beta, reset, keep, lam_t, t = x
        S = jnp.where(reset[..., None, None, None], 0.0, S)
        p = start + t
        h = jnp.where(last >= 0, _bit_length(jnp.bitwise_xor(jnp.maximum(last, 0), p)), 0)[..., None]  # (*lead, 1)
        merged = jnp.sum(jnp.where((levels <= h)[..., None, None], S, 0.0), axis=-3, keepdims=True)  # (*lead, 1, D, E)
        new = jnp.where((levels < h)[..., None, None], 0.0, jnp.where((levels == h)[..., None, None], merged, S))
        if beta is not None:  # a (I - β k kᵀ) on every level
            kS = _einsum("...d,...lde->...le", k, new, precision=precision)
            new = new - beta[..., None, None, None] * k[..., None, :, None] * kS[..., :, None, :]
        if g is not None:
            new = jnp.exp(g)[..., None, None, None] * new
        write = k[..., :, None] * (v if beta is None else beta[..., None] * v)[..., None, :]
        new = jnp.where((levels == 0)[..., None, None], write[..., None, :, :], new)
        S = jnp.where(keep[..., None, None, None], new, S)
        out = _einsum("...l,...d,...lde->...e", lam_t, q, S, precision=precision)
        return (S, jnp.where(keep, p, last)), out

    lead_axes = len(steps.keep.shape) - 1
    parts = (steps.q, steps.k, steps.v, steps.g, steps.beta, steps.reset, steps.keep, lam)
    xs = tuple(None if x is None else jnp.moveaxis(x, lead_axes, 0) for x in parts)
    T = steps.keep.shape[-1]
    (state, _), out = jax.lax.scan(step, (state, start - 1), (*xs, jnp.arange(T, dtype=jnp.int32)))
    positions = start[..., None] + jnp.arange(T, dtype=jnp.int32).reshape((1,) * start.ndim + (T,))
    overflow = jnp.any(steps.keep & (_bit_length(positions) >= L), axis=-1)
    return jnp.moveaxis(out, 0, -2), state, overflow


def chunked(steps: Steps, lam: Array, chunk_size: int, precision: jax.lax.PrecisionLike) -> Array:
    """The chunkwise form (:mod:`jattn._linear.log_linear`): ``out (*lead, T, E)`` from position 0.

    ``lam (*lead, T, L)`` with at least :func:`levels_needed` ``(T)`` levels; ``chunk_size`` a power of 2.
    """
    *lead, T, E = steps.v.shape
    c = min(chunk_size, 1 << max(T - 1, 0).bit_length())  # a power of 2, no longer than T needs
    n = -(-T // c)
    need = levels_needed(T)
    lam = lam[..., :need]

    def split(x: Array | None, fill=0) -> Array | None:  # (*lead, T, ...) -> (*lead, n, c, ...)
        return in_chunks(x, len(lead), c, fill)

    runs = jnp.cumsum(split(steps.reset, False).astype(jnp.int32), axis=-1)
    q, k, v, g, beta, lam = (split(x) for x in (steps.q, steps.k, steps.v, steps.g, steps.beta, lam))
    parts = _chunk_parts(q, k, v, g, beta, runs, precision)
    inner = jnp.asarray(level(np.arange(c)[:, None], np.arange(c)[None, :]))  # (c, c): levels inside a chunk
    weights = jnp.take_along_axis(lam, jnp.broadcast_to(inner, (*lam.shape[:-2], c, c)), axis=-1)  # λ_t at ℓ(t, s)
    out = _einsum("...ts,...se->...te", parts["mix"] * weights, v, precision=precision)
    outer = need - c.bit_length()  # the levels above a chunk: c·2^(j-1) apart, j = 1 .. outer
    if outer > 0:
        out = out + _across_chunks(parts, lam[..., c.bit_length() :], outer, precision)
    return out.reshape(*lead, n * c, E)[..., :T, :]


def _chunk_parts(q, k, v, g, beta, runs, precision) -> dict[str, Array | None]:
    """Per chunk ``(*lead, n, c, ·)``, what needs no state.

    ``mix (c, c)``: the weight of value ``s`` in query ``t``'s output from this chunk's keys
    (``Γ ∘ q kᵀ`` times the UT transform ``(I + A)^-1 diag(β)`` of the delta rule); ``reads (c, D)``: what the
    query reads of the state the chunk starts from (``S ↦ reads S``); ``own (D, E)``: the chunk's keys' state at
    its end; ``keep_in ()`` and, with the delta rule, ``kr (c, D)``, ``w (c, D)``: the chunk's transition of a
    state, ``S ↦ keep_in S - krᵀ (w S)``.
    """
    seen, first, last = documents(runs)
    hi, lo = (x[..., 0] for x in running_sums(jnp.zeros(q.shape[:-1], q.dtype) if g is None else g, axis=-1))
    gaps = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    decay = jnp.exp(jnp.where(seen, gaps, -jnp.inf))
    into = jnp.where(first, jnp.exp(hi + lo), 0.0)
    reach = jnp.where(last, jnp.exp(gaps[..., -1, :]), 0.0)
    scores = _einsum("...tf,...sf->...ts", q, k, precision=precision) * decay
    reads, mix, u, w = into[..., None] * q, scores, v, None
    if beta is not None:
        a = beta[..., :, None] * decay * _einsum("...tf,...sf->...ts", k, k, precision=precision)
        transform = unit_lower_inverse(jnp.where(lower_triangle(a.shape, -1), a, 0.0)) * beta[..., None, :]
        mix = _einsum("...tr,...rs->...ts", scores, transform, precision=precision)
        u = _einsum("...ts,...se->...te", transform, v, precision=precision)
        w = _einsum("...ts,...sf->...tf", transform, into[..., None] * k, precision=precision)
        reads = reads - _einsum("...ts,...sf->...tf", scores, w, precision=precision)
    kr = reach[..., None] * k
    own = _einsum("...sf,...se->...fe", kr, u, precision=precision)
    return dict(mix=mix, reads=reads, own=own, keep_in=into[..., -1], kr=None if w is None else kr, w=w)


def _across_chunks(parts: dict, lam: Array, outer: int, precision) -> Array:
    """The levels above a chunk, ``lam (*lead, n, c, outer)``: a scan over the chunks carrying one state a level.

    Before chunk ``m`` the carry's level ``j`` holds the keys of the chunks ``m'`` with ``bit_length(m ^ m') = j``
    (as a state at chunk m's start); after it, levels ``1 .. j*`` merge into ``j* = bit_length(m ^ (m + 1))``
    with chunk m's own state (the Fenwick merge over chunks).
    """
    *lead, n, c, D = parts["reads"].shape
    E = parts["own"].shape[-1]
    tops = jnp.asarray(level(np.arange(n), np.arange(n) + 1), jnp.int32)  # j* of each chunk
    levels = jnp.arange(1, outer + 1, dtype=jnp.int32).reshape((1,) * len(lead) + (outer, 1, 1))
    names = ("reads", "own", "keep_in", "kr", "w")
    xs = {x: None if parts[x] is None else jnp.moveaxis(parts[x], len(lead), 0) for x in names}
    xs["lam"], xs["top"] = jnp.moveaxis(lam, len(lead), 0), tops

    def step(Z, x):  # Z (*lead, outer, D, E)
        queries = (x["lam"][..., :, :, None] * x["reads"][..., :, None, :]).reshape(*lead, c, outer * D)
        out = _einsum("...tx,...xe->...te", queries, Z.reshape(*lead, outer * D, E), precision=precision)
        moved = x["keep_in"][..., None, None, None] * Z
        if x["w"] is not None:
            wZ = _einsum("...sf,...jfe->...jse", x["w"], Z, precision=precision)
            moved = moved - _einsum("...sf,...jse->...jfe", x["kr"], wZ, precision=precision)
        below = levels <= x["top"]
        merged = x["own"] + jnp.sum(jnp.where(below, moved, 0.0), axis=-3)
        Z = jnp.where(levels == x["top"], merged[..., None, :, :], jnp.where(below, 0.0, moved))
        return Z, out

    Z = jnp.zeros((*lead, outer, D, E), parts["own"].dtype)
    _, out = jax.lax.scan(jax.checkpoint(step), Z, xs)
    return jnp.moveaxis(out, 0, len(lead))
