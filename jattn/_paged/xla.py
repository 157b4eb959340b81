"""XLA's tiles for paged attention: query blocks against key tiles gathered page by page, an online softmax.

Shapes follow :mod:`jattn._core` with the paged names of :func:`jattn.paged_attention` (``Q`` query tokens,
``R`` requests, ``P`` pages of ``Z`` tokens, ``M`` pages a request); ``B`` counts query blocks here, ``t``
and ``s`` are a block's rows and a tile's keys.

Each request's query tokens fall into blocks of :data:`BLOCK_Q` rows aligned to absolute positions: block b
of request r holds its queries at positions ``[b·BLOCK_Q, (b+1)·BLOCK_Q)``, so a token's row never depends
on the batch or on how its prompt was chunked. A static bound on the block count (:func:`jattn._paged.blocks.max_blocks`) lets
the table of blocks (their request, each row's token) be built with jnp ops from traced ``cu_q_lens`` and
``kv_lens``. A loop over key tiles of :func:`tile_size` keys (whole pages, starting at multiples of the tile
from key 0) gathers one tile of every block's request a step, ``(B, s, K, D)``, through ``page_table``: the
gathered contiguous cache is never built. The blocks' rows are scattered back to the tokens at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from jattn._masks import UNBOUNDED, key_interval
from jattn._online import finish
from jattn._paged.blocks import query_blocks
from jattn._paged.checks import Paged
from jattn._softmax import exp_below_one

__all__ = ["TILE_MIN", "forward", "tile_size"]

#: Fewest keys of a tile: a tile is the fewest whole pages holding at least this many.
TILE_MIN = 128

ScoreMod = Callable[..., Array]
#: The online-softmax state of the blocks: ``m``, ``l`` ``(B, K, G, t)``, ``acc (B, K, G, t, E)``.
State = tuple[Array, Array, Array]


def tile_size(Z: int) -> int:
    """Keys of one tile for pages of ``Z`` tokens: whole pages, at least :data:`TILE_MIN` keys."""
    return Z * max(1, -(-TILE_MIN // Z))


def forward(p: Paged, score_mod: ScoreMod | None) -> tuple[Array, Array]:
    """``out (Q, N, E)`` and ``lse (Q, N)`` (float32; float64 for float64 inputs).

    Padding tokens (past ``cu_q_lens[R]``) and rows without an allowed key give out 0 and lse ``-inf``.
    """
    Q, N, _ = p.q.shape
    E = p.v_pages.shape[3]
    compute = jnp.float64 if p.q.dtype == jnp.float64 else jnp.float32
    out, lse = jnp.zeros((Q, N, E), compute), jnp.full((Q, N), -jnp.inf, compute)
    if Q == 0 or p.page_table.shape[0] == 0:
        return out, lse
    request, token, q_pos = query_blocks(p)
    m, norm, acc = _attend(p, score_mod, request, token, q_pos, compute)
    o, block_lse, _ = finish((m, norm, acc), compute)  # (B, K, G, t, E), (B, K, G, t)
    B, t = token.shape
    rows = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B * t, N, E)
    row_lse = jnp.transpose(block_lse, (0, 3, 1, 2)).reshape(B * t, N)
    dest = jnp.where(token >= 0, token, Q).reshape(B * t)  # Q: dropped
    return out.at[dest].set(rows, mode="drop"), lse.at[dest].set(row_lse, mode="drop")


def _key_range(p: Paged, token: Array, q_pos: Array, kv_len: Array) -> tuple[Array, Array]:
    """The first tile any block needs and one past the last: int32 scalars.

    Each block's ``kv_len (B,)`` bounds them above; a mask of one key interval a query with a left bound (sliding
    windows) bounds them below. Blocks without a token count for nothing. The tiles of one block outside its own
    range are folded in as no-ops (every key masked): its bits do not depend on the others' ranges.
    """
    s = tile_size(p.k_pages.shape[1])
    left, _ = key_interval(p.mask) or (UNBOUNDED, UNBOUNDED)
    used = jnp.any(token >= 0, axis=1)
    lo = jnp.zeros_like(kv_len)
    if left < UNBOUNDED:
        lo = jnp.maximum(q_pos[:, 0] - min(left, 2**30), 0)
    top = jnp.max(jnp.where(used, kv_len, 0))
    bottom = jnp.min(jnp.where(used & (kv_len > lo), lo, top))
    return bottom // s, (top + s - 1) // s


def _attend(
    p: Paged, score_mod: ScoreMod | None, request: Array, token: Array, q_pos: Array, compute: DTypeLike
) -> tuple[Array, Array, Array]:
    """The online-softmax state of every block after its keys: ``m``, ``l`` ``(B, K, G, t)``, ``acc (B, K, G, t, E)``."""
    B, t = token.shape
    K, E = p.k_pages.shape[2], p.v_pages.shape[3]
    Z, M = p.k_pages.shape[1], p.page_table.shape[1]
    s = tile_size(Z)
    per_tile = s // Z
    M_pad = -(-M // per_tile) * per_tile
    table = jnp.pad(p.page_table, ((0, 0), (0, M_pad - M)))[request]  # (B, M_pad): each block's pages
    kv_len = jnp.clip(p.kv_lens[request], 0, M * Z)
    q = p.q[jnp.clip(token, 0, p.q.shape[0] - 1)].astype(compute)  # (B, t, N, D)
    q = jnp.transpose(q.reshape(B, t, K, p.group, -1), (0, 2, 3, 1, 4))  # (B, K, G, t, D)
    mod = _bound_mod(score_mod, request, q_pos, p.group * K, compute)

    def step(i: Array, state: State) -> State:
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_tile, per_tile, axis=1)  # (B, s / Z)
        kv_pos = i * s + jnp.arange(s, dtype=jnp.int32)
        real = kv_pos[None, :] < kv_len[:, None]  # (B, s): keys of the request
        k = jnp.take(p.k_pages, pages, axis=0, mode="clip").reshape(B, s, K, -1)
        v = jnp.take(p.v_pages, pages, axis=0, mode="clip").reshape(B, s, K, E)
        v = jnp.where(real[:, :, None, None], v, jnp.zeros((), v.dtype))  # stale slots may hold anything
        x = jnp.einsum("bkgtd,bskd->bkgts", q, k.astype(compute), preferred_element_type=compute)
        x = x * jnp.asarray(p.scale, compute)
        if mod is not None:
            x = mod(x, kv_pos)
        keep = real[:, None, :]  # (B, t|1, s)
        if p.mask is not None:
            keep = keep & p.mask.allowed(q_pos[:, :, None], kv_pos[None, None, :])
        return _fold(state, x, keep[:, None, None], v, compute)

    lo, hi = _key_range(p, token, q_pos, kv_len)
    G = p.group
    state = (jnp.full((B, K, G, t), -jnp.inf, compute), jnp.zeros((B, K, G, t), compute))
    state = (*state, jnp.zeros((B, K, G, t, E), compute))
    return jax.lax.fori_loop(lo, hi, step, state)


def _bound_mod(
    score_mod: ScoreMod | None, request: Array, q_pos: Array, N: int, compute: DTypeLike
) -> Callable[[Array, Array], Array] | None:
    """``mod(x (B, K, G, t, s), kv_pos (s,))``: ``score_mod`` on a tile flattened to ``(B·N, t, s)``, or None.

    ``batch`` and ``head`` ``(B·N, 1, 1)`` are each row's request and query head, ``q_pos (B·N, t, 1)`` and
    ``kv_pos (1, 1, s)`` absolute positions, int32.
    """
    if score_mod is None:
        return None
    B, t = q_pos.shape
    batch = jnp.repeat(request, N)[:, None, None]
    head = jnp.tile(jnp.arange(N, dtype=jnp.int32), B)[:, None, None]
    q_pos = jnp.repeat(q_pos, N, axis=0)[:, :, None]

    def mod(x: Array, kv_pos: Array) -> Array:
        flat = x.reshape(B * N, t, -1)
        y = jnp.broadcast_to(jnp.asarray(score_mod(flat, batch, head, q_pos, kv_pos[None, None, :])), flat.shape)
        return y.astype(compute).reshape(x.shape)

    return mod


def _fold(state: State, x: Array, keep: Array, v: Array, compute: DTypeLike) -> State:
    """One key tile folded into the state (:func:`jattn._online.accumulate` for blocks of grouped heads).

    ``x (B, K, G, t, s)`` modified scaled scores, ``keep (B, 1, 1, t, s)``, ``v (B, s, K, E)`` (0 at keys
    past the request's).
    """
    m, norm, acc = state
    x = jnp.where(keep, x, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(x, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
    w = exp_below_one(x - m_safe[..., None])
    alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
    pv = jnp.einsum("bkgts,bske->bkgte", w, v.astype(compute), preferred_element_type=compute)
    return m_new, norm * alpha + jnp.sum(w, -1), acc * alpha[..., None] + pv
