"""Head bookkeeping shared by the NNX and Linen modules (pure functions, no parameters).

Projected activations are laid out for the core as ``(B, K, G, T, D)`` queries against
``(B, K, 1, S, D)`` keys and values, so grouped-query attention is plain broadcasting and
nothing is repeated in memory. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._core import attention, attention_weights
from jattn._linear import LinearState, feature_fn, linear_attention
from jattn._masks import Causal, Mask
from jattn._ring import sequence_parallel_attention


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


def check_context(x: Array, d_model: int, context: Array, features: int, context_mask: Array | None) -> None:
    """Raises unless ``x (B, T, d_model)``, ``context (B, S, features)``, ``context_mask (B, S)``."""
    check_input("x", x, d_model)
    check_input("context", context, features)
    if context.shape[0] != x.shape[0]:
        raise ValueError(f"x and context must share the batch size, got {x.shape} and {context.shape}")
    if context_mask is not None and jnp.shape(context_mask) != context.shape[:2]:
        raise ValueError(f"context_mask must have shape (B, S) = {context.shape[:2]}, got {jnp.shape(context_mask)}")


def _split(x: Array, heads: int, groups: int) -> Array:
    """``(B, L, heads*groups*D) -> (B, heads, groups, L, D)``."""
    b, length, f = x.shape
    return x.reshape(b, length, heads, groups, f // (heads * groups)).transpose(0, 2, 3, 1, 4)


def _split_mask(mask: Array | None, num_heads: int, num_kv_heads: int) -> Array | None:
    """A mask broadcastable to ``(B, N, T, S)`` -> broadcastable to ``(B, K, G, T, S)``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype} with shape {mask.shape}")
    if mask.ndim > 4 or (mask.ndim == 4 and mask.shape[1] not in (1, num_heads)):
        raise ValueError(f"mask must broadcast to (batch, {num_heads} heads, T, S), got shape {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    heads = (num_kv_heads, num_heads // num_kv_heads) if mask.shape[1] == num_heads else (1, 1)
    return mask.reshape(mask.shape[0], *heads, *mask.shape[2:])


KINDS = ("softmax", "linear")


def check_kind(kind: str, feature_map: object) -> None:
    """Validates the attention kind."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "linear":
        feature_fn(feature_map)


def _ring_size(axis: str | None) -> int:
    """Devices along mesh axis ``axis`` of the current mesh (1 without one)."""
    if axis is None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def multihead(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    mask: Array | Mask | None,
    kv_mask: Array | None = None,
    kind: str = "softmax",
    feature_map: str | Callable[[Array], Array] = "elu",
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_weights: bool = False,
    linear_state: LinearState | None = None,
    sequence_axis: str | None = None,
) -> tuple[Array, Array | None, LinearState | None]:
    """Attention over heads of projected ``q (B, T, N*D)``, ``k, v (B, S, K*D)``.

    ``mask`` is an array broadcastable to ``(B, N, T, S)`` or a :class:`~jattn.masks.Mask`;
    ``kv_mask (B, S)`` marks valid keys (context padding). For ``kind='linear'`` the mask must
    be None or ``causal()`` and ``linear_state`` continues a causal sequence.

    Returns ``out (B, T, N*E)``, the weights ``(B, N, T, S)`` (before dropout) if asked, and
    the linear state after the last key (linear kind only).

    With ``sequence_axis`` naming an axis of more than one device in the current mesh
    (``jax.set_mesh``), softmax attention runs as ring attention over it
    (:func:`jattn.sequence_parallel_attention`); elsewhere it is the plain core.
    """
    groups = num_heads // num_kv_heads
    qh = _split(q, num_kv_heads, groups)  # (B, K, G, T, D)
    kh = _split(k, num_kv_heads, 1)  # (B, K, 1, S, D)
    vh = _split(v, num_kv_heads, 1)  # (B, K, 1, S, E)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    valid = None if kv_mask is None else jnp.asarray(kv_mask).reshape(b, 1, 1, s)  # (B, 1, 1, S)
    state = None
    if kind == "linear":
        if return_weights:
            raise ValueError("return_weights needs kind='softmax'; linear attention forms no weights")
        if mask is not None and not isinstance(mask, Causal):
            raise ValueError(f"kind='linear' takes mask=None or masks.causal(), got {mask!r}")
        out, state = linear_attention(
            qh,
            kh,
            vh,
            feature_map=feature_map,
            causal=mask is not None,
            kv_mask=valid,
            initial_state=linear_state,
            return_state=True,
            precision=precision,
        )
        weights = None
    elif _ring_size(sequence_axis) > 1:
        if kv_mask is not None:
            raise ValueError(f"sequence_axis={sequence_axis!r} does not take a context mask (kv_mask)")
        if dropout_rate:
            raise ValueError(f"sequence_axis={sequence_axis!r} does not take dropout_rate={dropout_rate}")
        out = sequence_parallel_attention(qh, kh, vh, axis_name=sequence_axis, mask=mask, precision=precision)
        weights = attention_weights(qh, kh, mask=mask, precision=precision) if return_weights else None
        weights = None if weights is None else weights.reshape(b, num_heads, t, s)
    else:
        if isinstance(mask, Mask):
            mask = mask.dense(t, s)  # (T, S) or (B, 1, T, S)
        mask = _split_mask(mask, num_heads, num_kv_heads)  # (B, K|1, G|1, T, S)
        if valid is not None:
            valid = valid.reshape(b, 1, 1, 1, s)
            mask = valid if mask is None else mask & valid
        out = attention(qh, kh, vh, mask=mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng, precision=precision)
        weights = None
        if return_weights:
            weights = attention_weights(qh, kh, mask=mask, precision=precision).reshape(b, num_heads, t, s)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, -1)  # (B, K, G, T, E) -> (B, T, N*E)
    return out, weights, state
