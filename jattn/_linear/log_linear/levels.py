r"""The Fenwick levels of log-linear attention: which level a key is at for a query, and the merge of level states.

Dimension key as in :mod:`jattn._core`; L: the levels. The level of key step ``s`` for query step ``t >= s`` is
:func:`level` ``(t, s) = bit_length(t XOR s)`` (0 for ``s = t``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = [
    "bit_length",
    "chunk_length",
    "gap_level",
    "last_kept",
    "level",
    "levels_needed",
    "merge_levels",
    "overflows",
    "positions",
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
