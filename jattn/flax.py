"""jattn inside Flax's own attention modules: ``attention_fn`` for NNX and Linen.

:func:`attention_fn` plugs into ``nnx.MultiHeadAttention`` and ``linen.MultiHeadDotProductAttention``.

::

    import jax
    from flax import nnx

    import jattn.flax
    from jattn import masks

    x = jax.random.normal(jax.random.key(0), (2, 16, 64))
    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=64, attention_fn=jattn.flax.attention_fn, decode=False, rngs=nnx.Rngs(0)
    )
    y = layer(x, mask=masks.causal())  # a predicate: the blockwise path skips the empty tiles

The function takes Flax's layout (q ``(batch..., T, N, H)``, k/v ``(batch..., S, K, H)``, mask and
bias broadcastable to ``(batch..., N, T, S)``) and every argument the two modules pass, and runs
:func:`jattn.attention` (GQA as q ``(batch..., K, G, T, H)`` against k/v ``(batch..., K, 1, S, H)``).
With dropout or a request to sow the weights it computes the weights with
:func:`jattn.attention_weights` and applies Flax's own dropout rule to them (the same
``bernoulli(dropout_rng, 1 - rate, shape)`` draw, broadcast over batch and heads when
``broadcast_dropout``), so a module gives the same numbers as with Flax's default on the same rng.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array
from jax.typing import ArrayLike

from jattn import masks
from jattn._checks import check_mask
from jattn._core import attention, attention_weights
from jattn._layouts import from_grouped, heads_grid, to_grouped
from jattn._masks import Mask
from jattn._masks import mask_of_array as array_mask

__all__ = ["attention_fn"]


def _sow(module: Any, weights: Array) -> None:
    """Flax's own convention: NNX ``nnx.Intermediate``, Linen the ``intermediates`` collection."""
    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def attention_fn(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | Mask | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: jax.lax.PrecisionLike = None,
    module: Any = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    *,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> Array:
    """Flax's ``dot_product_attention`` contract on jattn's core; pass it as ``attention_fn=``.

    Shapes (``batch...`` any number of leading dims, also none; ``G = N // K``)::

        query   (batch..., T, N, H)
        key     (batch..., S, K, H)        N a multiple of K (nnx's ``num_kv_heads``)
        value   (batch..., S, K, E)
        bias    broadcastable to (batch..., N, T, S), floating
        mask    broadcastable to (batch..., N, T, S), nonzero = attend (Flax's float masks
                from ``make_attention_mask`` work), or a :class:`jattn.masks.Mask` predicate
        out     (batch..., T, N, E) in ``dtype``

    Every argument Flax's modules pass is honoured:

    * ``dtype``: q, k, v are cast to it (default: their common dtype); the output is in it.
      The softmax is always computed in float32 (float64 for float64), so
      ``force_fp32_for_softmax`` (Linen) is accepted and always in effect.
    * ``precision``: passed to every matmul.
    * ``is_causal`` (NNX): Flax's causal mask, aligned top-left (query ``t`` sees keys
      ``s <= t``) as ``jnp.tril`` does. A mask *predicate* keeps jattn's own alignment
      (bottom-right by default), so the two together need ``T == S``.
    * ``dropout_rate``, ``deterministic``, ``dropout_rng``, ``broadcast_dropout``: when
      ``not deterministic and dropout_rate > 0``, the weights are computed with
      :func:`jattn.attention_weights`, cast to ``dtype`` and multiplied by Flax's draw
      ``bernoulli(dropout_rng, 1 - dropout_rate, shape) / (1 - dropout_rate)`` with ``shape``
      ``(1, ..., 1, T, S)`` (``broadcast_dropout``) or ``(batch..., N, T, S)``: the same mask
      Flax draws from the same key. This path is dense (it materialises the weights).
    * ``module``: given when the Flax module is called with ``sow_weights=True``; the weights
      ``(batch..., N, T, S)`` (in ``dtype``, before dropout) are sown as Flax does
      (``nnx.Intermediate`` for NNX, ``'intermediates'`` for Linen), on the dense path.
    * ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum`` (Linen's AQT hooks): jattn
      has its own matmuls, so anything but ``None`` raises a ``ValueError``.

    Otherwise the call runs :func:`jattn.attention`, which picks the dense or the blockwise
    path (a predicate mask keeps its empty tiles skipped); ``implementation`` and
    ``block_size`` are passed through (bind them with ``functools.partial``).

    Differences from Flax's default, by contract: a query row whose keys are all masked gives
    0 (Flax: the mean of v), and its weights are 0.

    Raises:
      ValueError: shapes that do not match or broadcast, dropout without ``dropout_rng``,
        ``is_causal`` with a predicate mask and ``T != S``, AQT einsum hooks.
      TypeError: a non-floating bias or dtype.
    """
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise ValueError(
            "jattn.flax.attention_fn has its own matmuls: qk_attn_weights_einsum and attn_weights_value_einsum "
            f"must be None, got {qk_attn_weights_einsum!r} and {attn_weights_value_einsum!r}"
        )
    check_mask(mask)
    q, k, v, dtype = _cast(query, key, value, dtype)
    lead, (T, N, S, K) = _sizes(q, k, v)
    qj, kj, vj = to_grouped(q, k, v, K)  # Flax (batch..., L, heads, H) -> jattn (batch..., K, G|1, L, H)
    jmask, offsets = _grouped_mask(mask, is_causal, lead, N, K, T, S)
    jbias = None
    if bias is not None:
        jbias = heads_grid("bias", bias, lead, N, K, T, S)
        if not jnp.issubdtype(jbias.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point, got {jbias.dtype} with shape {jnp.shape(bias)}")

    dropout = not deterministic and dropout_rate > 0.0
    if not dropout and module is None:
        out = attention(
            qj,
            kj,
            vj,
            mask=jmask,
            bias=jbias,
            precision=precision,
            implementation=implementation,
            block_size=block_size,
            **offsets,
        )  # (batch..., K, G, T, E)
        return from_grouped(out, N).astype(dtype)

    if dropout and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng key, got None")
    w = attention_weights(qj, kj, mask=jmask, bias=jbias, precision=precision, **offsets)
    w = jnp.broadcast_to(w, (*lead, K, N // K, T, S)).astype(dtype)  # (batch..., K, G, T, S)
    if module is not None:
        _sow(module, w.reshape(*lead, N, T, S))
    if dropout:
        w = _dropout(w, dropout_rng, dropout_rate, broadcast_dropout)
    out = jnp.einsum("...kgts,...ske->...tkge", w, v, precision=precision)  # (batch..., T, K, G, E)
    return out.reshape(*lead, T, N, v.shape[-1])


def _cast(query: ArrayLike, key: ArrayLike, value: ArrayLike, dtype: Any) -> tuple[Array, Array, Array, Any]:
    """q, k, v cast to ``dtype`` (default: their common dtype), which must be floating, and that dtype."""
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if dtype is None:
        dtype = jnp.result_type(q, k, v)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype!r}")
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), dtype


def _sizes(q: Array, k: Array, v: Array) -> tuple[tuple[int, ...], tuple[int, int, int, int]]:
    """``batch...`` and ``(T, N, S, K)`` of Flax's ``q (batch..., T, N, H)``, ``k (batch..., S, K, H)``, ``v (batch..., S, K, E)``."""
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "query, key and value must be (batch..., T|S, N|K, H) with one rank of at least 3, got "
            f"query {q.shape}, key {k.shape}, value {v.shape}"
        )
    *lead, T, N, H = q.shape
    lead = tuple(lead)
    S, K = k.shape[-3], k.shape[-2]
    if k.shape[:-3] != lead or v.shape[:-3] != lead or k.shape[-1] != H or v.shape[-3:-1] != (S, K):
        raise ValueError(
            "expected query (batch..., T, N, H), key (batch..., S, K, H), value (batch..., S, K, E) with one batch..., "
            f"S, K and H, got query {q.shape}, key {k.shape}, value {v.shape}"
        )
    if K == 0 or N % K:
        raise ValueError(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
    return lead, (T, N, S, K)


def _grouped_mask(
    mask: ArrayLike | Mask | None, is_causal: bool, lead: tuple[int, ...], N: int, K: int, T: int, S: int
) -> tuple[Mask | None, dict[str, int]]:
    """Flax's ``mask`` (``(batch..., N, T, S)``-broadcastable, nonzero = attend, or a predicate) and ``is_causal`` as jattn's mask.

    Returns the mask over ``(batch..., K, G, T, S)`` and the offsets that align ``is_causal``
    top-left (as ``jnp.tril``) where the mask is no predicate.
    """
    if isinstance(mask, Mask):
        if is_causal and T != S:
            raise ValueError(
                f"is_causal (top-left, as Flax) and a jattn.masks predicate (bottom-right) align differently for "
                f"T={T} != S={S}; put masks.causal() into the predicate instead"
            )
        return (mask & masks.causal() if is_causal else mask), {}
    grid = None if mask is None else heads_grid("mask", mask, lead, N, K, T, S)
    grid = None if grid is None else array_mask(grid if grid.dtype == jnp.bool_ else grid != 0)
    if not is_causal:
        return grid, {}
    return (masks.causal() if grid is None else masks.causal() & grid), dict(q_offset=0, kv_offset=0)


def _dropout(w: Array, rng: Array, rate: float, broadcast: bool) -> Array:
    """Flax's dropout on the weights ``w (batch..., K, G, T, S)``: the draw Flax makes from ``rng``, in ``w``'s dtype.

    ``bernoulli(rng, 1 - rate, shape) / (1 - rate)`` with ``shape`` ``(1, ..., 1, T, S)``
    (``broadcast``) or ``(batch..., N, T, S)``.
    """
    *lead, K, G, T, S = w.shape
    keep_prob = 1.0 - rate
    shape = (1,) * (len(lead) + 1) + (T, S) if broadcast else (*lead, K * G, T, S)
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    multiplier = keep.astype(w.dtype) / jnp.asarray(keep_prob, dtype=w.dtype)
    heads = (K, G) if multiplier.shape[-3] == K * G else (1, 1)  # (batch..., N, T, S) -> (batch..., K, G, T, S)
    return w * multiplier.reshape(*multiplier.shape[:-3], *heads, T, S)
