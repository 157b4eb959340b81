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
from jattn._online import vary

__all__ = [
    "bit_length",
    "chunk_length",
    "chunked",
    "gap_level",
    "last_kept",
    "level",
    "levels_needed",
    "merge_levels",
    "overflows",
    "positions",
    "recurrent",
]


def level(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The Fenwick level of key position ``s`` for query position ``t >= s`` (integers): ``bit_length(t ^ s)``."""
    x = np.bitwise_xor(np.asarray(t, np.int64), np.asarray(s, np.int64))
    return np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64) + 1, 0)


def levels_needed(length: int) -> int:
    """The levels positions ``0 .. length-1`` use: ``bit_length(length - 1) + 1`` (1 for one step)."""
    return max(int(length) - 1, 0).bit_length() + 1


def bit_length(x: Array) -> Array:
    """``bit_length`` of non-negative int32 ``x`` (elementwise)."""
    return 32 - jax.lax.clz(x.astype(jnp.int32))


def merge_levels(state: Array, h: Array) -> Array:
    """The Fenwick merge of level states ``(*lead, L, D, E)``: levels ``0 .. h`` summed into level ``h (*lead,)``.

    Relative to a position ``p`` after the one the states are relative to, ``p0``, with ``h = bit_length(p0 ^ p)``,
    the keys of levels below h all lie at level h (which was empty); levels above keep theirs. Merges compose:
    ``p0 -> p1 -> p`` gives what ``p0 -> p`` gives.
    """
    levels = jnp.arange(state.shape[-3], dtype=jnp.int32).reshape((1,) * h.ndim + (-1,))  # (1.., L)
    h = h[..., None]  # (*lead, 1)
    merged = jnp.sum(jnp.where((levels <= h)[..., None, None], state, 0.0), axis=-3, keepdims=True)
    return jnp.where((levels < h)[..., None, None], 0.0, jnp.where((levels == h)[..., None, None], merged, state))


def gap_level(p0: Array, p: Array) -> Array:
    """``bit_length(p0 ^ p)`` for positions ``p0 <= p``; 0 where ``p0 < 0`` (nothing before the first step)."""
    return jnp.where(p0 >= 0, bit_length(jnp.bitwise_xor(jnp.maximum(p0, 0), p)), 0)


def positions(start: Array, T: int) -> Array:
    """``(*lead, T)`` int32: the positions of a call's steps from ``start (*lead,)``."""
    return start[..., None] + jnp.arange(T, dtype=jnp.int32).reshape((1,) * start.ndim + (T,))


def last_kept(keep: Array, start: Array) -> Array:
    """``(*lead,)``: the position of the last kept step of ``keep (*lead, T)``, ``start - 1`` where none is."""
    return jnp.max(jnp.where(keep, positions(start, keep.shape[-1]), start[..., None] - 1), axis=-1)


def overflows(keep: Array, start: Array, L: int) -> Array:
    """``(*lead,)``: a kept step at a position that needs more than L levels."""
    return jnp.any(keep & (bit_length(positions(start, keep.shape[-1])) >= L), axis=-1)


def chunk_length(chunk_size: int, T: int) -> int:
    """The chunk the chunkwise form uses: ``chunk_size``, or the power of 2 that covers T where that is shorter."""
    return min(chunk_size, 1 << max(T - 1, 0).bit_length())


def _einsum(spec: str, *xs: Array, precision) -> Array:
    return jnp.einsum(spec, *xs, precision=precision)


def recurrent(
    steps: Steps, lam: Array, state: Array, start: Array, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array, Array]:
    """Step by step: ``out (*lead, T, E)``, the level states ``(*lead, L, D, E)`` and their position ``(*lead,)``.

    ``state``: the level states before the first step, relative to position ``start - 1``; ``start (*lead,)`` int32.
    The states returned are relative to the last kept step, whose position comes with them (``start - 1`` where
    none is kept: then the states are ``state``, zeroed where a document starts). At a kept step at position
    ``p``, after the last kept one at ``p0``, levels ``0 .. h`` merge into level ``h = bit_length(p0 ^ p)``
    (:func:`merge_levels`), every level takes the step's transition, and level 0 becomes the step's write. A
    dropped step changes nothing but a reset (which zeroes every level).
    """
    state, start = vary((state, start), *(x for x in steps[:8] if x is not None))  # inside shard_map
    L = state.shape[-3]
    levels = jnp.arange(L, dtype=jnp.int32).reshape((1,) * (state.ndim - 3) + (L,))  # (1.., L)

    def step(carry, x):
        S, last = carry  # (*lead, L, D, E), (*lead,)
        q, k, v, g, beta, reset, keep, lam_t, t = x
        S = jnp.where(reset[..., None, None, None], 0.0, S)
        p = start + t
        new = merge_levels(S, gap_level(last, p))
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
    (state, last), out = jax.lax.scan(step, (state, start - 1), (*xs, jnp.arange(T, dtype=jnp.int32)))
    return jnp.moveaxis(out, 0, -2), state, last


def chunked(
    steps: Steps, lam: Array, state: Array, start: Array, chunk_size: int, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array, Array]:
    """The chunkwise form (:mod:`jattn._linear.log_linear`): what :func:`recurrent` returns, chunk by chunk.

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
    out = _einsum("...ts,...se->...te", parts["mix"] * weights, v, precision=precision)
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
        out = _einsum("...tx,...xe->...te", queries, Z.reshape(*lead, outer * D, E), precision=precision)
        moved = x["keep_in"][..., None, None, None] * Z
        if x["w"] is not None:
            wZ = _einsum("...sf,...jfe->...jse", x["w"], Z, precision=precision)
            moved = moved - _einsum("...sf,...jse->...jfe", x["kr"], wZ, precision=precision)
        chunk = first + x["m"]
        top = bit_length(jnp.bitwise_xor(chunk, chunk + 1))[..., None, None, None]
        below = levels <= top
        merged = x["own"] + jnp.sum(jnp.where(below, moved, 0.0), axis=-3)
        F = jnp.where((m_last == x["m"])[..., None, None, None], moved, F)
        Z = jnp.where(levels == top, merged[..., None, :, :], jnp.where(below, 0.0, moved))
        return (Z, F), out

    (_, F), out = jax.lax.scan(jax.checkpoint(step), (Z, vary(jnp.zeros_like(Z), Z)), xs)
    return jnp.moveaxis(out, 0, len(lead)), F
