"""What the chunkwise forms of the linear family share: chunks, documents in a chunk, running sums, a triangular inverse.

Dimension key as in :mod:`jattn._core`; C: the steps of a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = ["documents", "einsum", "in_chunks", "lower_triangle", "running_sums", "unit_lower_inverse"]


def einsum(spec: str, *xs: Array, precision) -> Array:
    """``jnp.einsum`` at ``precision`` (keyword-only, so every form's products name it)."""
    return jnp.einsum(spec, *xs, precision=precision)


def in_chunks(x: Array | None, lead: int, c: int, fill=0) -> Array | None:
    """``x (*lead, T, ...)`` as ``(*lead, n, c, ...)``, ``n = ceil(T / c)``, the last chunk padded with ``fill``.

    ``lead`` is the number of leading axes; None stays None. The chunkwise forms of the family share it.
    """
    if x is None:
        return None
    T, tail = x.shape[lead], x.shape[lead + 1 :]
    n = -(-T // c)
    x = jnp.pad(x, [(0, 0)] * lead + [(0, n * c - T)] + [(0, 0)] * len(tail), constant_values=fill)
    return x.reshape(*x.shape[:lead], n, c, *tail)


def documents(runs: Array) -> tuple[Array, Array, Array]:
    """The pairs and steps that documents allow, from each step's document in its chunk ``runs (..., C)``.

    ``seen (..., C, C)`` (s <= t in t's document), the steps that see the chunk's incoming state
    (``first``) and those whose writes reach its last (``last``).
    """
    same = runs[..., :, None] == runs[..., None, :]
    return same & lower_triangle(same.shape, 0), runs == 0, runs == runs[..., -1:]


def running_sums(g: Array, axis: int) -> tuple[Array, Array]:
    """The running sums ``b`` of the log decays ``g`` along ``axis`` (-1 or -2) as ``hi + lo``, to twice the precision.

    Returned with a trailing axis ``(..., C, X)`` (X = 1 for ``axis=-1``). ``hi`` is the cumulative sum, ``lo``
    what it rounded away: ``hi_t - hi_{t-1}`` is exact where the two lie within a factor 2 of each other
    (Sterbenz; else it rounds at the size of the step itself), so ``g_t`` minus it is that step's rounding
    error, and their running sum ``lo`` stays small (C roundings of ``|b|``). A difference ``b_t - b_s`` taken
    as ``(hi_t - hi_s) + (lo_t - lo_s)`` is then exact to its own rounding: after a step of log decay -1e7 the
    later steps' small decays do not cancel away as in ``hi_t - hi_s`` alone. Each log decay is first clamped
    at twice the log of the dtype's smallest subnormal, where exp is exactly 0 already (as for any sum holding
    it; so are the derivatives): no sum reaches -inf, whose differences would be NaN.
    """
    g = g[..., None] if axis == -1 else g
    g = jnp.maximum(g, 2.0 * float(np.log(np.finfo(g.dtype).smallest_subnormal)))
    hi = jnp.cumsum(g, axis=-2)
    step = hi - jnp.concatenate([jnp.zeros_like(hi[..., :1, :]), hi[..., :-1, :]], axis=-2)
    return hi, jnp.cumsum(g - step, axis=-2)


def lower_triangle(shape: tuple[int, ...], diagonal: int) -> Array:
    """Boolean ``shape (..., C, C)``: True on and below ``diagonal`` (0: the main one, -1: strictly below)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones(shape[-2:], bool), diagonal), shape)


@jax.custom_jvp
def unit_lower_inverse(a: Array) -> Array:
    """``(I + a)^-1`` for a strictly lower triangular ``a (..., C, C)``, by forward substitution (C steps).

    Not ``lax.linalg.triangular_solve``: on CPU its LAPACK call splits a batch over XLA's thread pool and waits
    for the parts, and two such calls running at once on a 2-thread pool wait for each other forever (seen in
    training with jaxlib 0.10). The derivative ``-X da X`` (rule below) serves every order.
    """
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)

    def row(t, x):  # x's rows from t on are still 0
        r = jax.lax.dynamic_index_in_dim(a, t, axis=-2, keepdims=False)
        e = jax.lax.dynamic_index_in_dim(eye, t, axis=-2, keepdims=False)
        new = e - jnp.einsum("...s,...sx->...x", r, x)
        return jax.lax.dynamic_update_index_in_dim(x, new[..., None, :], t, axis=-2)

    return jax.lax.fori_loop(0, a.shape[-1], row, jnp.zeros_like(a))


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
    (a,), (da,) = primals, tangents
    x = unit_lower_inverse(a)
    da = jnp.where(lower_triangle(da.shape, -1), da, 0.0)  # the map reads a's strictly lower part only
    return x, -jnp.einsum("...ts,...sr,...rx->...tx", x, da, x)
