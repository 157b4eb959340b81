"""Head bookkeeping shared by the NNX and Linen modules (pure functions, no parameters).

Projected activations are laid out for the core as ``(B, K, G, T, D)`` queries against
``(B, K, 1, S, D)`` keys and values, so grouped-query attention is plain broadcasting and
nothing is repeated in memory. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._core import attention, attention_weights


def check_heads(d_model: int, num_heads: int, num_kv_heads: int | None, qkv_features: int | None) -> tuple[int, int]:
    """Validates the head configuration; returns ``(num_kv_heads, head_depth)``."""
    for name, value in (("d_model", d_model), ("num_heads", num_heads)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    features = d_model if qkv_features is None else qkv_features
    if not isinstance(kv, int) or kv <= 0 or num_heads % kv:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of num_heads={num_heads}")
    if not isinstance(features, int) or features <= 0 or features % num_heads:
        raise ValueError(f"qkv_features={features!r} must be a positive multiple of num_heads={num_heads}")
    return kv, features // num_heads


def check_input(name: str, x: Array, features: int) -> None:
    """Raises unless ``x`` is ``(B, T, features)``."""
    if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != features:
        raise ValueError(f"{name} must have shape (batch, length, {features}), got {jnp.shape(x)}")


def _split(x: Array, heads: int, groups: int) -> Array:
    """``(B, L, heads*groups*D) -> (B, heads, groups, L, D)``."""
    b, length, f = x.shape
    return x.reshape(b, length, heads, groups, f // (heads * groups)).transpose(0, 2, 3, 1, 4)


def _split_mask(mask: Array | None, num_heads: int, num_kv_heads: int) -> Array | None:
    """A mask broadcastable to ``(B, N, T, S)`` -> broadcastable to ``(B, K, G, T, S)``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.ndim > 4 or (mask.ndim == 4 and mask.shape[1] not in (1, num_heads)):
        raise ValueError(f"mask must broadcast to (batch, {num_heads} heads, T, S), got shape {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    heads = (num_kv_heads, num_heads // num_kv_heads) if mask.shape[1] == num_heads else (1, 1)
    return mask.reshape(mask.shape[0], *heads, *mask.shape[2:])


def multihead(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    mask: Array | None,
    dropout_rate: float,
    dropout_rng: Array | None,
    precision: jax.lax.PrecisionLike,
    return_weights: bool,
) -> tuple[Array, Array | None]:
    """Attention over heads of projected ``q (B, T, N*D)``, ``k, v (B, S, K*D)``.

    Returns ``out (B, T, N*E)`` and, if asked, the weights ``(B, N, T, S)`` (before dropout).
    """
    groups = num_heads // num_kv_heads
    qh = _split(q, num_kv_heads, groups)  # (B, K, G, T, D)
    kh = _split(k, num_kv_heads, 1)  # (B, K, 1, S, D)
    vh = _split(v, num_kv_heads, 1)  # (B, K, 1, S, E)
    mask = _split_mask(mask, num_heads, num_kv_heads)  # (B, K|1, G|1, T, S)
    out = attention(qh, kh, vh, mask=mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng, precision=precision)
    b, _, _, t, e = out.shape
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads * e)  # (B, T, N*E)
    if not return_weights:
        return out, None
    w = attention_weights(qh, kh, mask=mask, precision=precision)  # (B, K, G, T, S)
    return out, w.reshape(b, num_heads, t, k.shape[1])
