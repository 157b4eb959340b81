"""Rotary position embeddings (RoPE, Su et al. 2021) as one pure function.

The rotate-half convention (GPT-NeoX, LLaMA): feature ``i < D/2`` is paired with feature
``i + D/2`` and the pair is rotated by the angle ``position * base**(-2i/D)``. Applied to
queries and keys at their absolute positions, the scores depend on positions only through
their difference. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from jattn._arrays import compute_dtype
from jattn._scalars import check_real, int_array

__all__ = ["rope"]


def rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
    """Rotates the features of ``x (..., L, D)`` by their ``positions``.

    Args:
      x: floating array ``(..., L, D)``, ``D`` even (one row per token, e.g. one head's
        queries or keys).
      positions: integer array broadcastable to ``x.shape[:-1]``, the absolute position of
        each row: ``(L,)`` for a shared sequence, ``(B, L, 1)`` for per-example positions of
        ``x (B, L, N, D)``.
      base: the wavelength base, a finite number > 0 (10000 in the paper).

    Returns:
      ``x`` rotated, same shape and dtype: for ``i < D/2`` and angle
      ``a = positions * base**(-2i/D)``, ``out[i] = x[i] cos a - x[i + D/2] sin a`` and
      ``out[i + D/2] = x[i + D/2] cos a + x[i] sin a``. Angles are computed in float32
      (float64 for float64 ``x``).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rope x must be floating point, got {x.dtype} with shape {x.shape}")
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"rope x must have an even feature axis (..., L, D), got shape {x.shape}")
    positions = jnp.asarray(positions)
    positions = int_array("rope positions", positions, ndim=positions.ndim, shape="broadcastable to x.shape[:-1]")
    try:
        positions = jnp.broadcast_to(positions, x.shape[:-1])
    except ValueError:
        raise ValueError(
            f"rope positions of shape {positions.shape} do not broadcast to x.shape[:-1] = {x.shape[:-1]}"
        ) from None
    base = check_real("rope base", base, low=0.0, open_low=True)
    ct = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    freq = jnp.asarray(base, ct) ** (-jnp.arange(half, dtype=ct) * (2.0 / x.shape[-1]))  # (D/2,)
    angle = positions.astype(ct)[..., None] * freq.reshape((1,) * positions.ndim + (half,))  # (..., D/2)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(ct), x[..., half:].astype(ct)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
