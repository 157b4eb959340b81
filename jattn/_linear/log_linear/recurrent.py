"""Log-linear attention one step at a time: the Fenwick merge of the level states, then each level's transition.

Dimension key as in :mod:`jattn._core`; L: the levels (:mod:`jattn._linear.log_linear.levels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._arrays import vary
from jattn._linear.chunking import einsum
from jattn._linear.log_linear.levels import gap_level, merge_levels
from jattn._linear.steps import Steps

__all__ = ["recurrent"]


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
            kS = einsum("...d,...lde->...le", k, new, precision=precision)
            new = new - beta[..., None, None, None] * k[..., None, :, None] * kS[..., :, None, :]
        if g is not None:
            new = jnp.exp(g)[..., None, None, None] * new
        write = k[..., :, None] * (v if beta is None else beta[..., None] * v)[..., None, :]
        new = jnp.where((levels == 0)[..., None, None], write[..., None, :, :], new)
        S = jnp.where(keep[..., None, None, None], new, S)
        out = einsum("...l,...d,...lde->...e", lam_t, q, S, precision=precision)
        return (S, jnp.where(keep, p, last)), out

    lead_axes = len(steps.keep.shape) - 1
    parts = (steps.q, steps.k, steps.v, steps.g, steps.beta, steps.reset, steps.keep, lam)
    xs = tuple(None if x is None else jnp.moveaxis(x, lead_axes, 0) for x in parts)
    T = steps.keep.shape[-1]
    (state, last), out = jax.lax.scan(step, (state, start - 1), (*xs, jnp.arange(T, dtype=jnp.int32)))
    return jnp.moveaxis(out, 0, -2), state, last
