"""The query blocks of a ragged batch: each request's query tokens in blocks of :data:`BLOCK_Q` positions.

Block b of request r holds its queries at positions ``[b·BLOCK_Q, (b+1)·BLOCK_Q)``: aligned to absolute positions,
so a token's row in its block depends on neither the batch nor how its prompt was chunked. XLA's tiles
(:mod:`jattn._paged.xla`) and the Pallas kernel (:mod:`jattn._paged.pallas`) both walk them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from jattn._paged.checks import Paged

__all__ = ["BLOCK_Q", "block_queries", "max_blocks", "no_rows", "query_blocks"]

#: Query positions of one block.
BLOCK_Q = 16


def max_blocks(Q: int, R: int) -> int:
    """A static bound on the query blocks of ``Q`` tokens in ``R`` requests (``R`` blocks for a decode step).

    ``L >= 1`` consecutive positions touch at most ``1 + min(L - 1, ceil((L - 1) / BLOCK_Q))`` aligned blocks;
    summed over ``r`` requests holding ``Q`` tokens, at most ``r + min(Q - r, floor((Q - r + r (BLOCK_Q - 1)) /
    BLOCK_Q))``, the largest over ``r <= min(R, Q)``.
    """
    return max(r + min(Q - r, (Q - r + r * (BLOCK_Q - 1)) // BLOCK_Q) for r in range(min(R, Q) + 1))


def query_blocks(p: Paged) -> tuple[Array, Array, Array]:
    """The query blocks: ``request (B,)``, ``token (B, t)`` (each row's q index, or -1) and ``q_pos (B, t)``.

    Blocks past the last request's are unused (all rows -1); under ``jit`` broken tables may name more blocks
    than :func:`max_blocks`, whose rows are then left out (those requests' rows are NaN anyway).
    """
    Q, R = p.q.shape[0], p.page_table.shape[0]
    cu, kv = p.cu_q_lens, p.kv_lens
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    start = kv - q_lens  # each request's first query position
    first = jnp.floor_divide(start, BLOCK_Q)
    count = jnp.where(q_lens > 0, jnp.floor_divide(kv - 1, BLOCK_Q) - first + 1, 0)
    ends = jnp.cumsum(count)
    i = jnp.arange(max_blocks(Q, R), dtype=jnp.int32)
    request = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # R past the last block
    r = jnp.minimum(request, R - 1)
    block = first[r] + i - (ends[r] - count[r])  # its absolute block index
    q_pos = block[:, None] * BLOCK_Q + jnp.arange(BLOCK_Q, dtype=jnp.int32)[None, :]
    row = q_pos - start[r][:, None]
    used = (request < R)[:, None] & (row >= 0) & (row < q_lens[r][:, None])
    return r, jnp.where(used, cu[r][:, None] + row, -1), q_pos


def no_rows(p: Paged, dtype=jnp.float32) -> tuple[Array, Array]:
    """``out (Q, N, E)`` zeros and ``lse (Q, N)`` ``-inf`` in ``dtype``: every row before a path writes its own."""
    (Q, N, _), E = p.q.shape, p.v_pages.shape[3]
    return jnp.zeros((Q, N, E), dtype), jnp.full((Q, N), -jnp.inf, dtype)


def block_queries(p: Paged) -> tuple[Array, Array, Array, Array]:
    """:func:`query_blocks` and the blocks' queries ``(B, K, G, t, D)`` (a row of no token holds some query)."""
    request, token, q_pos = query_blocks(p)
    (B, t), K, G = token.shape, p.k_pages.shape[2], p.group
    q = p.q[jnp.clip(token, 0, p.q.shape[0] - 1)].reshape(B, t, K, G, -1)
    return request, token, q_pos, jnp.transpose(q, (0, 2, 3, 1, 4))
