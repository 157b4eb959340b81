"""Ready-made score modifications for :func:`jattn.attention`'s ``score_mod``.

``softcap``, ``alibi`` (with ``alibi_slopes``), ``relative_position_bias`` (T5 buckets,
:func:`t5_buckets`) and ``compose``.

A score modification is a callable ``(score, batch, head, q_pos, kv_pos) -> score`` of arrays
that broadcast against each other (dimension key in :mod:`jattn._core`): ``score`` holds scaled
logits (a whole ``(..., T, S)`` on the dense path, ``(B, t, s)`` tiles on the blockwise and ring
paths), ``batch`` and ``head`` are int32 indices of the leading axes (``head`` = n for
``(B, N, T, D)``, k·G + g for ``(B, K, G, T, D)``), ``q_pos`` and ``kv_pos`` int32 absolute
positions. Everything here acts element by element, so any path can call it on any tile, and
the arrays a modification closes over (slopes, tables) receive gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn._scalars import check_bool, check_int, check_real

__all__ = ["alibi", "alibi_slopes", "compose", "relative_position_bias", "softcap", "t5_buckets"]

ScoreMod = Callable[[Array, Array, Array, Array, Array], Array]


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): ``cap · tanh(score / cap)``, keeping every logit in ``(-cap, cap)``.

    The returned function's ``.softcap`` is ``cap``: ``implementation='pallas'`` on TPU passes it to
    splash attention's own soft-cap.
    """
    cap = check_real("cap", cap, low=0.0, open_low=True)

    def mod(score, batch, head, q_pos, kv_pos):
        c = jnp.asarray(cap, score.dtype)
        return c * jnp.tanh(score / c)

    mod.softcap = cap  # the cap, for kernels with a soft-cap of their own (splash's attn_logits_soft_cap)
    return mod


def alibi_slopes(num_heads: int) -> Array:
    """The ALiBi paper's slopes ``(N,)`` float32: ``2^(-8 (n+1) / N)``, interleaved as the paper does when N is not a power of 2."""
    num_heads = check_int("num_heads", num_heads, min=1)

    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(p) + powers(2 * p)[0::2][: num_heads - p]
    return jnp.asarray(slopes, jnp.float32)


def alibi(slopes: ArrayLike) -> ScoreMod:
    """ALiBi: ``score - slopes[head] · |q_pos - kv_pos|``, ``slopes (N,)`` floating (learnable: it gets gradients).

    Under a causal mask this is the paper's ``slope · (kv_pos - q_pos)``; without one it is the
    symmetric form (as in flash-attention's ``alibi_slopes``).
    """
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"slopes must be a floating (N,) array, got {slopes.dtype} with shape {slopes.shape}")

    def mod(score, batch, head, q_pos, kv_pos):
        distance = jnp.abs(q_pos - kv_pos).astype(score.dtype)
        return score - slopes[head].astype(score.dtype) * distance

    return mod


def t5_buckets(relative_position: Array, num_buckets: int, max_distance: int, bidirectional: bool) -> Array:
    """T5's relative-position buckets (int32, same shape) of ``relative_position = kv_pos - q_pos``.

    Exactly T5's ``_relative_position_bucket`` (Mesh TensorFlow, Hugging Face): with
    ``bidirectional`` half the buckets are for keys after the query; distances below
    ``num_buckets // 2`` (of what is left) get a bucket each, longer ones logarithmically spaced
    buckets up to ``max_distance``, beyond which they share the last. The logarithm is taken in
    float32 as T5 does, so bucket edges agree.
    """
    relative_position = jnp.asarray(relative_position, jnp.int32)
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(relative_position)
    else:
        n = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    large = jnp.log(n.astype(jnp.float32) / max_exact) / jnp.float32(math.log(max_distance / max_exact))
    large = max_exact + (large * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(n < max_exact, n, large)


def relative_position_bias(
    table: ArrayLike, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> ScoreMod:
    """T5's learned relative-position bias: ``score + table[t5_buckets(kv_pos - q_pos), head]``.

    ``table`` is ``(num_buckets, N)`` floating (T5's ``relative_attention_bias`` embedding); it
    gets gradients. Bucketing is :func:`t5_buckets`.
    """
    table = jnp.asarray(table)
    num_buckets = check_int("num_buckets", num_buckets, min=2 if not bidirectional else 4)
    max_distance = check_int("max_distance", max_distance, min=1)
    bidirectional = check_bool("bidirectional", bidirectional)
    if table.ndim != 2 or table.shape[0] != num_buckets or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(
            f"table must be a floating (num_buckets, N) = ({num_buckets}, N) array, got {table.dtype} "
            f"with shape {table.shape}"
        )

    def mod(score, batch, head, q_pos, kv_pos):
        bucket = t5_buckets(kv_pos - q_pos, num_buckets, max_distance, bidirectional)
        return score + table[bucket, head].astype(score.dtype)

    return mod


def compose(*mods: ScoreMod) -> ScoreMod:
    """``mods[0]`` first, then ``mods[1]`` on its result, and so on (e.g. ``compose(alibi(s), softcap(30.0))``)."""
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(f"compose takes score modifications (callables), got {m!r} at position {i}")

    def mod(score, batch, head, q_pos, kv_pos):
        for m in mods:
            score = m(score, batch, head, q_pos, kv_pos)
        return score

    return mod
