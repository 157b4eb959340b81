"""Log-linear attention in chunks: dense levels inside a chunk, a scan of the level states over chunks.

Dimension key as in :mod:`jattn._core`; L: the levels (:mod:`jattn._linear.log_linear.levels`), C: the steps of a
chunk; the form is derived in :mod:`jattn._linear.log_linear.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._arrays import vary
from jattn._linear.chunking import documents, einsum, in_chunks, lower_triangle, running_sums, unit_lower_inverse
from jattn._linear.log_linear.levels import (
    bit_length,
    chunk_length,
    gap_level,
    last_kept,
    level,
    merge_levels,
    positions,
)
from jattn._linear.steps import Steps

__all__ = ["chunked"]


def chunked(
    steps: Steps, lam: Array, state: Array, start: Array, chunk_size: int, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array, Array]:
    """The chunkwise form (:mod:`jattn._linear.log_linear.attention`): what :func:`recurrent` returns, chunk by chunk.

    ``state (*lead, L, D, E)`` relative to ``start - 1``; ``start (*lead,)`` int32, a multiple of the chunk
    (:func:`chunk_length`: chunks stay aligned to the Fenwick tree); ``lam (*lead, T, >= L)``, L at least
    :func:`levels_needed` of the last position plus 1; ``chunk_size`` a power of 2. The states come out relative
    to the last kept step: its chunk's keys split by their level from it, the earlier ones from the scan's carry.
    """
    *lead, T, E = steps.v.shape
    state, start = vary((state, start), *(x for x in steps[:8] if x is not None))  # inside shard_map
    L = state.shape[-3]
    c = chunk_length(chunk_size, T)
    above = c.bit_length()  # the levels inside a chunk: 0 .. log2(c)
    lam = lam[..., :L]

    def split(x: Array | None, fill=0) -> Array | None:  # (*lead, T, ...) -> (*lead, n, c, ...)
        return in_chunks(x, len(lead), c, fill)

    runs = jnp.cumsum(split(steps.reset, False).astype(jnp.int32), axis=-1)
    q, k, v, g, beta, lam = (split(x) for x in (steps.q, steps.k, steps.v, steps.g, steps.beta, lam))
    parts = _chunk_parts(q, k, v, g, beta, runs, precision)
    inner = jnp.asarray(level(np.arange(c)[:, None], np.arange(c)[None, :]))  # (c, c): levels inside a chunk
    weights = jnp.take_along_axis(lam, jnp.broadcast_to(inner, (*lam.shape[:-2], c, c)), axis=-1)  # λ_t at ℓ(t, s)
    out = einsum("...ts,...se->...te", parts["mix"] * weights, v, precision=precision)
    last = last_kept(steps.keep, start)
    m_last = jnp.maximum(last - start, 0) // c  # the chunk of the last kept step
    incoming = merge_levels(state, jnp.where(start > 0, gap_level(start - 1, start), 0))  # relative to start
    top = incoming[..., above:, :, :]  # the levels above a chunk (those below are empty at a chunk's start)
    if above < L:
        across, top = _across_chunks(parts, lam[..., above:], top, start // c, m_last, precision)
        out = out + across
    pick = _chunk_of(m_last, len(lead))
    mine = _own_levels(pick(k), pick(v), pick(g), pick(beta), pick(runs), last - start - m_last * c, precision)
    final = jnp.concatenate([mine[..., : min(L, above), :, :], top], axis=-3)
    final = jnp.where((last >= start)[..., None, None, None], final, state)  # none kept: the states as they came
    cut = jnp.any(steps.reset & (positions(start, T) > last[..., None]), axis=-1)  # a document starts after it
    return out.reshape(*lead, -1, E)[..., :T, :], jnp.where(cut[..., None, None, None], 0.0, final), last


def _chunk_of(m: Array, lead: int):
    """``x (*lead, n, c, ...) -> (*lead, c, ...)``: each sequence's chunk ``m (*lead,)`` (None stays None)."""

    def pick(x: Array | None) -> Array | None:
        if x is None:
            return None
        index = m.reshape(m.shape + (1,) * (x.ndim - lead))
        return jnp.take_along_axis(x, index, axis=lead)[(slice(None),) * lead + (0,)]

    return pick


def _own_levels(k, v, g, beta, runs, at: Array, precision) -> Array:
    """One chunk's keys' states ``(*lead, log2(c) + 1, D, E)`` at its end, split by their level from step ``at``.

    ``k (*lead, c, D)``, ``v (*lead, c, E)``, gates and ``runs`` of the chunk; ``at (*lead,)``: the place of the
    last kept step in it (later steps are dropped: they write nothing, and move nothing but a reset). The
    split is the values': the state is linear in them, and a level's keys keep theirs.
    """
    *lead, c, E = v.shape
    levels = c.bit_length()
    places = jnp.arange(c, dtype=jnp.int32).reshape((1,) * len(lead) + (c,))
    of = gap_level(places, at[..., None])  # (*lead, c): bit_length(at ^ s)
    ones = jnp.arange(levels, dtype=jnp.int32).reshape((1,) * (len(lead) + 1) + (levels,))
    split = jnp.where((of[..., None] == ones)[..., None], v[..., None, :], 0.0)  # (*lead, c, levels, E)
    own = _chunk_parts(k, k, split.reshape(*lead, c, levels * E), g, beta, runs, precision)["own"]
    return jnp.moveaxis(own.reshape(*lead, k.shape[-1], levels, E), -2, -3)


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
    scores = einsum("...tf,...sf->...ts", q, k, precision=precision) * decay
    reads, mix, u, w = into[..., None] * q, scores, v, None
    if beta is not None:
        a = beta[..., :, None] * decay * einsum("...tf,...sf->...ts", k, k, precision=precision)
        transform = unit_lower_inverse(jnp.where(lower_triangle(a.shape, -1), a, 0.0)) * beta[..., None, :]
        mix = einsum("...tr,...rs->...ts", scores, transform, precision=precision)
        u = einsum("...ts,...se->...te", transform, v, precision=precision)
        w = einsum("...ts,...sf->...tf", transform, into[..., None] * k, precision=precision)
        reads = reads - einsum("...ts,...sf->...tf", scores, w, precision=precision)
    kr = reach[..., None] * k
    own = einsum("...sf,...se->...fe", kr, u, precision=precision)
    return dict(mix=mix, reads=reads, own=own, keep_in=into[..., -1], kr=None if w is None else kr, w=w)


def _across_chunks(parts: dict, lam: Array, Z: Array, first: Array, m_last: Array, precision) -> tuple[Array, Array]:
    """The levels above a chunk, ``lam (*lead, n, c, outer)``: a scan over the chunks carrying one state a level.

    ``Z (*lead, outer, D, E)``: the carry before the first chunk, whose index in the sequence is ``first (*lead,)``.
    Before chunk ``m`` the carry's level ``j`` holds the keys of the chunks ``m'`` with ``bit_length(m ^ m') = j``
    (as a state at chunk m's start); after it, levels ``1 .. j*`` merge into ``j* = bit_length(m ^ (m + 1))``
    with chunk m's own state (the Fenwick merge over chunks). Returns the queries' reads of it, ``(*lead, n, c, E)``,
    and the carry taken through chunk ``m_last (*lead,)`` before that merge (its keys relative to that chunk's).
    """
    *lead, n, c, D = parts["reads"].shape
    E, outer = parts["own"].shape[-1], lam.shape[-1]
    levels = jnp.arange(1, outer + 1, dtype=jnp.int32).reshape((1,) * len(lead) + (outer, 1, 1))
    names = ("reads", "own", "keep_in", "kr", "w")
    xs = {x: None if parts[x] is None else jnp.moveaxis(parts[x], len(lead), 0) for x in names}
    xs["lam"], xs["m"] = jnp.moveaxis(lam, len(lead), 0), jnp.arange(n, dtype=jnp.int32)

    def step(carry, x):  # Z, F (*lead, outer, D, E)
        Z, F = carry
        queries = (x["lam"][..., :, :, None] * x["reads"][..., :, None, :]).reshape(*lead, c, outer * D)
        out = einsum("...tx,...xe->...te", queries, Z.reshape(*lead, outer * D, E), precision=precision)
        moved = x["keep_in"][..., None, None, None] * Z
        if x["w"] is not None:
            wZ = einsum("...sf,...jfe->...jse", x["w"], Z, precision=precision)
            moved = moved - einsum("...sf,...jse->...jfe", x["kr"], wZ, precision=precision)
        chunk = first + x["m"]
        top = bit_length(jnp.bitwise_xor(chunk, chunk + 1))[..., None, None, None]
        below = levels <= top
        merged = x["own"] + jnp.sum(jnp.where(below, moved, 0.0), axis=-3)
        F = jnp.where((m_last == x["m"])[..., None, None, None], moved, F)
        Z = jnp.where(levels == top, merged[..., None, :, :], jnp.where(below, 0.0, moved))
        return (Z, F), out

    (_, F), out = jax.lax.scan(jax.checkpoint(step), (Z, vary(jnp.zeros_like(Z), Z)), xs)
    return jnp.moveaxis(out, 0, len(lead)), F
