"""The diagonal-plus-low-rank (RWKV-7) recurrence one step at a time.

Dimension key as in :mod:`jattn._core`; the recurrence is in :mod:`jattn._linear.dplr.chunk`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.chunking import einsum
from jattn._linear.dplr.steps import LowRankSteps

__all__ = ["recurrent"]


def recurrent(steps: LowRankSteps, state: Array, precision) -> tuple[Array, Array]:
    """The recurrence one step at a time (``lax.scan`` over T)."""

    def step(S, x):
        q, k, v, gk, a, b, reset = x
        S = jnp.where(reset[..., None, None], 0.0, S)
        read = einsum("...de,...d->...e", S, a, precision=precision)
        S = jnp.exp(gk)[..., :, None] * S + b[..., :, None] * read[..., None, :] + k[..., :, None] * v[..., None, :]
        return S, einsum("...de,...d->...e", S, q, precision=precision)

    axis = len(steps.keep.shape) - 1
    xs = tuple(jnp.moveaxis(x, axis, 0) for x in steps[:7])
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, -2), state
