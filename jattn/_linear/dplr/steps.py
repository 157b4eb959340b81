"""The checked inputs of the diagonal-plus-low-rank (DPLR, RWKV-7) form of :func:`jattn.gated_linear_attention`.

Dimension key as in :mod:`jattn._core`; the recurrence is in :mod:`jattn._linear.dplr.chunk`. Everything but the
low-rank vectors ``a`` and ``b`` is checked as without them (:func:`jattn._linear.steps.prepare`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn._linear.steps import Steps, prepare

__all__ = ["LowRankSteps", "prepare_low_rank"]


class LowRankSteps(NamedTuple):
    """The per-step inputs of the DPLR recurrence, broadcast to ``(*lead, T, ...)`` and in the compute dtype.

    ``q, k (*lead, T, D)`` (q scaled), ``v (*lead, T, E)``, ``gk (*lead, T, D)`` (the log decays per key feature,
    ``g`` added; 0 where absent or dropped), ``a, b (*lead, T, D)`` (0 at dropped steps), ``reset`` and ``keep``
    ``(*lead, T)`` as in :class:`jattn._linear.steps.Steps`.
    """

    q: Array
    k: Array
    v: Array
    gk: Array
    a: Array
    b: Array
    reset: Array
    keep: Array


def prepare_low_rank(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    a: ArrayLike | None,
    b: ArrayLike | None,
    g: ArrayLike | None,
    gk: ArrayLike | None,
    beta: ArrayLike | None,
    first: Callable[[Array, tuple[int, ...]], Array] | None,
    **rest,
) -> tuple[Steps, LowRankSteps, Array]:
    """The checked :class:`Steps` (for :func:`jattn._linear.steps.poison`), the DPLR steps and the state.

    ``rest``: ``scale``, ``segment_ids``, ``kv_mask``, ``initial_state`` as :func:`jattn._linear.steps.prepare`.
    """
    if beta is not None:
        raise ValueError(
            "beta (the delta rule) and a, b (a low-rank transition) are two ways to write one step; the delta rule "
            "is a = k, b = -beta * k with v * beta (and gk = g): got beta with a and b"
        )
    if a is None or b is None:
        raise ValueError(f"a and b (the low-rank transition b aᵀ) come together: got only {'a' if b is None else 'b'}")
    q, a, b = jnp.asarray(q), jnp.asarray(a), jnp.asarray(b)
    if q.ndim < 2:
        raise ValueError(f"q must have shape (..., T, D), got {q.shape}")
    T, D = q.shape[-2:]
    for name, x in (("a", a), ("b", b)):
        if x.ndim < 2 or x.shape[-2] not in (1, T) or x.shape[-1] not in (1, D):
            raise ValueError(f"{name} must broadcast to (..., T={T}, D={D}), got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating, got {x.dtype} with shape {x.shape}")
    try:
        lead = jnp.broadcast_shapes(q.shape[:-2], a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading dimensions (batch, heads) do not broadcast: q {q.shape}, a {a.shape}, b {b.shape}"
        ) from None
    q = jnp.broadcast_to(q, (*lead, T, D))  # a and b's leading axes are the call's too
    steps, state = prepare(q, k, v, g=g, gk=gk, beta=None, first=first, **rest)
    shape, compute = steps.k.shape, steps.k.dtype
    dropped = ~steps.keep[..., None]

    def kept(x: Array) -> Array:
        return jnp.where(dropped, 0.0, jnp.broadcast_to(x.astype(compute), shape)).astype(compute)

    decay = jnp.zeros(shape, compute) if steps.gk is None else steps.gk
    decay = decay if steps.g is None else decay + steps.g[..., None]
    low = LowRankSteps(steps.q, steps.k, steps.v, decay, kept(a), kept(b), steps.reset, steps.keep)
    return steps, low, state
