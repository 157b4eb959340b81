"""The gated / delta-rule recurrence one step at a time (:func:`jattn.gated_linear_attention`, ``mode='recurrent'``).

Dimension key as in :mod:`jattn._core`; the recurrence is in :mod:`jattn._linear.gated`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.chunking import einsum
from jattn._linear.steps import Steps

__all__ = ["recurrent"]


def recurrent(steps: Steps, state: Array, precision) -> tuple[Array, Array]:
    """The recurrence one step at a time (``lax.scan`` over T)."""

    def step(S, x):
        q, k, v, g, gk, beta, reset = x
        S = jnp.where(reset[..., None, None], 0.0, S)
        if g is not None:
            S = jnp.exp(g)[..., None, None] * S
        if gk is not None:
            S = jnp.exp(gk)[..., :, None] * S
        write = v if beta is None else beta[..., None] * (v - einsum("...de,...d->...e", S, k, precision=precision))
        S = S + k[..., :, None] * write[..., None, :]
        return S, einsum("...de,...d->...e", S, q, precision=precision)

    xs = tuple(None if x is None else jnp.moveaxis(x, len(steps.keep.shape) - 1, 0) for x in steps[:7])
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, -2), state
