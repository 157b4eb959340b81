"""The pure attention core.

Dimension key, used in every einsum and shape comment of jattn:

  B  batch                      T  query length
  N  query heads                S  key/value length
  K  key/value heads            D  query/key depth
  G  query heads per kv head    E  value depth
  ...  any leading dimensions (batch, heads, groups), broadcast like NumPy

The computation is the article's: ``scores = q kᵀ · scale``, a softmax over the keys of each
query row (built from the stable parts in :mod:`jattn._softmax`), then the weighted sum of the
values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._blockwise import blockwise_attention
from jattn._masks import EMPTY, Causal, Mask, SlidingWindow
from jattn._softmax import SoftmaxParts, softmax_parts

__all__ = ["attention", "attention_weights"]

_FLOATS = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)))


def _check_qkv(q: Array, k: Array, v: Array | None) -> None:
    """Validates q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``: ranks, dtypes, depths."""
    named = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, x in named.items():
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., len, depth), got shape {x.shape}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if len({x.dtype for x in named.values()}) > 1:
        got = ", ".join(f"{n}={x.dtype}" for n, x in named.items())
        raise TypeError(f"q, k and v must share one dtype, got {got}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same depth D (last axis), got q {q.shape} and k {k.shape}")
    if v is not None and k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length S (axis -2), got k {k.shape} and v {v.shape}")


def _check_mask_bias(
    mask: ArrayLike | Mask | None,
    bias: ArrayLike | None,
    q: Array,
    k: Array,
    q_offset: ArrayLike | None,
    kv_offset: ArrayLike,
) -> tuple[Array | None, Array | None]:
    """Validates mask and bias; materialises a :class:`Mask`.

    A per-example mask puts the batch on the first axis of q.
    """
    if isinstance(mask, Mask):
        T, S = q.shape[-2], k.shape[-2]
        mask = mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset)
        if mask.ndim == 4:  # (B, 1, T, S): batch first
            if q.ndim < 3:
                raise ValueError(f"a per-example mask needs a batch axis in q, got q of shape {q.shape}")
            mask = mask.reshape(mask.shape[0], *(1,) * (q.ndim - 3), T, S)
    elif q_offset is not None or not (isinstance(kv_offset, int) and kv_offset == 0):
        raise ValueError("q_offset and kv_offset apply only to a jattn.masks.Mask, not to an array mask")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype} with shape {mask.shape}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point, got {bias.dtype} with shape {bias.shape}")
    return mask, bias


def _broadcast_all(**arrays: Array | None) -> tuple[int, ...]:
    """The broadcast leading shape ``...`` of the named arrays, or an error naming their shapes."""
    named = {n: x for n, x in arrays.items() if x is not None}
    t, s = named["q"].shape[-2], named["k"].shape[-2]
    for name in ("mask", "bias"):
        x = named.get(name)
        if x is not None and (x.ndim < 2 or x.shape[-2] not in (1, t) or x.shape[-1] not in (1, s)):
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to (..., T, S) = (..., {t}, {s})")
    try:
        return tuple(jnp.broadcast_shapes(*(x.shape[:-2] for x in named.values())))
    except ValueError:
        shapes = ", ".join(f"{n} {x.shape}" for n, x in named.items())
        raise ValueError(f"leading dimensions do not broadcast: {shapes}") from None


def _pad_rank(x: Array | None, ndim: int) -> Array | None:
    """Left-pads ``x`` with unit axes to ``ndim`` dimensions (strict rank promotion is kept)."""
    return None if x is None else x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _logits(
    q: Array,
    k: Array,
    mask: Array | None,
    bias: Array | None,
    scale: float | ArrayLike | None,
    precision: jax.lax.PrecisionLike,
) -> tuple[SoftmaxParts, jnp.dtype]:
    """Scaled, biased, masked scores ``(..., T, S)`` split into softmax parts (all at one rank)."""
    compute = jnp.dtype(jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("...td,...sd->...ts", q, k, precision=precision, preferred_element_type=compute)
    s = s * jnp.asarray(scale, compute)
    if bias is not None:
        s = s + bias.astype(compute)
    if mask is not None:
        s = jnp.broadcast_to(s, jnp.broadcast_shapes(s.shape, mask.shape))
    return softmax_parts(s, mask), compute


def _dropout(p: Array, rate: float, rng: Array | None) -> Array:
    if rate == 0.0:
        return p
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rng is None:
        raise ValueError("dropout_rate > 0 needs a dropout_rng key")
    keep = jax.random.bernoulli(rng, 1.0 - rate, p.shape)
    return jnp.where(keep, p / (1.0 - rate), jnp.zeros_like(p))


BLOCKS = (512, 256, 128)  # square tiles the blockwise path chooses from (bench/README)
BLOCK_OVERHEAD = 112 * 112  # fixed cost of one tile in score entries (fitted on the 2-core CPU: ~1 ms a tile)
AUTO_BLOCKWISE_MIN = 1024 * 1024  # T·S from which 'auto' prefers blockwise on CPU (bench/README)
IMPLEMENTATIONS = ("dense", "blockwise", "xla", "cudnn")


def _choose(implementation, q, k, mask, bias, q_offset, kv_offset, dropout_rate) -> str:
    """The path for this call; an explicit choice that cannot run raises a ``ValueError``."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    blockwise_ok = None
    if bias is not None:
        blockwise_ok = "bias"
    elif dropout_rate:
        blockwise_ok = "dropout_rate"
    elif mask is not None and not isinstance(mask, Mask):
        blockwise_ok = "an array mask (pass a jattn.masks predicate)"
    elif isinstance(mask, Mask) and mask.per_example:
        blockwise_ok = "a per-example mask"
    elif not all(isinstance(o, int) for o in (q_offset if q_offset is not None else 0, kv_offset)):
        blockwise_ok = "array offsets"
    if implementation == "blockwise" and blockwise_ok:
        raise ValueError(f"implementation='blockwise' does not take {blockwise_ok}; use 'dense'")
    if implementation is None:
        big = q.shape[-2] * k.shape[-2] >= AUTO_BLOCKWISE_MIN
        return "blockwise" if big and not blockwise_ok else "dense"
    return implementation


def _auto_block(mask: Mask | None, T: int, S: int, q_offset: int | None, kv_offset: int) -> tuple[int, int]:
    """The square tile of :data:`BLOCKS` with the least work on the mask's non-empty tiles.

    Work is ``tiles x (tile area + BLOCK_OVERHEAD)``: full and causal attention keep 512 x 512;
    a narrow sliding window takes smaller tiles, which waste fewer masked entries.
    """
    if mask is None or max(T, S) <= BLOCKS[-1]:
        return BLOCKS[0], BLOCKS[0]

    def work(b):
        tiles = np.count_nonzero(mask.block_kinds(T, S, b, b, q_offset=q_offset, kv_offset=kv_offset) != EMPTY)
        return tiles * (min(b, T) * min(b, S) + BLOCK_OVERHEAD)

    best = min(BLOCKS, key=work)
    return best, best


def _jax_nn(q, k, v, mask, bias, scale, implementation, return_lse):
    """Hands the call to ``jax.nn.dot_product_attention`` where its arguments express it."""
    T, S = q.shape[-2], k.shape[-2]
    if return_lse:
        raise ValueError(f"implementation={implementation!r} cannot return the log-sum-exp; use 'dense' or 'blockwise'")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"implementation={implementation!r} needs E == D, got q {q.shape} and v {v.shape}")
    kwargs: dict = {}
    if isinstance(mask, Mask):
        if mask == Causal() and T == S:
            kwargs["is_causal"] = True
        elif isinstance(mask, SlidingWindow) and T == S:
            kwargs["local_window_size"] = (mask.left, mask.right)
        else:
            raise ValueError(
                f"implementation={implementation!r} expresses only causal() or sliding_window() with T == S, got {mask!r}"
            )
        mask = None
    lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])

    def flat(x):  # (..., L, D) -> (B, L, 1, D)
        x = jnp.broadcast_to(x, (*lead, *x.shape[-2:]))
        return x.reshape(-1, x.shape[-2], 1, x.shape[-1])

    def flat_ts(x):  # (..., T, S) -> (B, 1, T, S)
        x = jnp.broadcast_to(jnp.asarray(x), (*lead, T, S))
        return x.reshape(-1, 1, T, S)

    mask, bias = _check_mask_bias(mask, bias, q, k, None, 0)
    out = jax.nn.dot_product_attention(
        flat(q),
        flat(k),
        flat(v),
        bias=None if bias is None else flat_ts(bias).astype(q.dtype),
        mask=None if mask is None else flat_ts(mask),
        scale=scale,
        implementation=implementation,
        **kwargs,
    )
    out = out.reshape(*lead, T, v.shape[-1])
    if mask is not None:  # jax.nn averages v over a fully masked row; the contract is 0
        seen = jnp.any(jnp.broadcast_to(mask, (*lead, T, S)), axis=-1, keepdims=True)
        out = jnp.where(seen, out, jnp.zeros((), out.dtype))
    return out


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_lse: bool = False,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> Array | tuple[Array, Array]:
    r"""Scaled dot-product attention: ``softmax(q kᵀ · scale + bias, masked) v``.

    Shapes (dimension key in :mod:`jattn._core`)::

        q     (..., T, D)      queries
        k     (..., S, D)      keys
        v     (..., S, E)      values
        mask  (..., T, S)      boolean, True = attend; broadcastable
        bias  (..., T, S)      additive, floating; broadcastable
        out   (..., T, E)      in the dtype of q, k, v
        lse   (..., T)         log-sum-exp of each row's logits (float32, or float64)

    The leading dimensions ``...`` of q, k, v, mask and bias broadcast like NumPy, so a head axis
    of size 1 in k and v gives multi-query attention, and grouped-query attention is q of shape
    ``(B, K, G, T, D)`` against k, v of shape ``(B, K, 1, S, D)``. ``vmap`` over any leading
    axis is free.

    .. math::
        \mathrm{out}_t = \sum_s \frac{e^{x_{ts} - m_t}}{\sum_{s'} e^{x_{ts'} - m_t}} v_s, \quad
        x_{ts} = \mathrm{scale}\, q_t \cdot k_s + \mathrm{bias}_{ts}, \quad m_t = \max_s x_{ts}

    with the sums and the max over attended keys only.

    Contract:
      * A query row whose keys are all masked out returns exactly 0 and contributes zero
        gradient to q, k, v and bias (its log-sum-exp is ``-inf``); never NaN, never the
        mean of v. A row whose every logit is ``-inf`` through ``bias`` is treated the same.
      * NaN in an unmasked entry of q, k, v or bias propagates to the rows it touches.
      * bfloat16/float16 inputs: logits and softmax are computed and accumulated in float32
        (no overflow for logits up to the float32 range); the output is in the input dtype.
        float64 inputs (with ``jax_enable_x64``) compute in float64.
      * Pure: no side effects and no host syncs; works under ``jit``, ``vmap``, ``grad`` and
        ``remat``.

    Args:
      q, k, v: queries, keys, values; one floating dtype.
      mask: boolean, True = attend, broadcastable to ``(..., T, S)``; or a
        :class:`jattn.masks.Mask` predicate such as ``masks.causal()`` (per-example masks index
        the first axis of q as the batch).
      bias: additive logits bias, broadcastable to ``(..., T, S)``.
      scale: logit scale; default ``1 / sqrt(D)``.
      q_offset, kv_offset: absolute positions of the first query and key, scalars or per
        example ``(B,)``, for a :class:`~jattn.masks.Mask` only. Default ``kv_offset = 0`` and
        ``q_offset = S - T``: queries aligned bottom-right, at the end of the keys, as for a KV
        cache (so ``causal()`` with ``T < S`` lets the last query see every key).
      dropout_rate: probability of dropping an attention weight (training only).
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      precision: matmul precision passed to the einsums (matters on TPU).
      return_lse: also return the ``(..., T)`` log-sum-exp of the logits.
      implementation: ``'dense'`` materialises the ``(..., T, S)`` scores (the reference);
        ``'blockwise'`` runs an online softmax over blocks (:mod:`jattn._blockwise`): O(T)
        memory, empty blocks of a mask predicate skipped, same contract; ``'xla'`` /
        ``'cudnn'`` hand the call to :func:`jax.nn.dot_product_attention` and raise a
        ``ValueError`` for arguments it cannot express; ``None`` chooses: blockwise where it
        applies and the scores would have at least ``AUTO_BLOCKWISE_MIN`` entries per head,
        dense otherwise.
      block_size: ``(block_q, block_kv)`` (or one int for both) of the blockwise path;
        ``None`` chooses square tiles of 512, 256 or 128 from the mask (``_auto_block``).

    Returns:
      ``out`` of shape ``(..., T, E)``, or ``(out, lse)`` when ``return_lse``.

    Raises:
      TypeError: non-floating or mismatched dtypes of q, k, v; non-bool mask; non-float bias.
      ValueError: ranks below 2, mismatched D or S, leading dimensions or a mask/bias shape
        that does not broadcast.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check_qkv(q, k, v)
    path = _choose(implementation, q, k, mask, bias, q_offset, kv_offset, dropout_rate)
    if path == "blockwise":
        if block_size is None:
            bq, bk = _auto_block(mask, q.shape[-2], k.shape[-2], q_offset, kv_offset)
        else:
            bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        _broadcast_all(q=q, k=k, v=v)
        out, lse = blockwise_attention(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            block_q=bq,
            block_kv=bk,
            precision=precision,
        )
        return (out, lse) if return_lse else out
    if path in ("xla", "cudnn"):
        return _jax_nn(q, k, v, mask, bias, scale, path, return_lse)
    mask, bias = _check_mask_bias(mask, bias, q, k, q_offset, kv_offset)
    ndim = len(_broadcast_all(q=q, k=k, v=v, mask=mask, bias=bias)) + 2
    q, k, v, mask, bias = (_pad_rank(x, ndim) for x in (q, k, v, mask, bias))
    parts, compute = _logits(q, k, mask, bias, scale, precision)
    p = _dropout(parts.exp, dropout_rate, dropout_rng)
    # Normalise after the weighted sum (one division per output row, as flash attention does);
    # low-precision weights are rounded to v's dtype and accumulated in float32.
    out = jnp.einsum("...ts,...se->...te", p.astype(v.dtype), v, precision=precision, preferred_element_type=compute)
    out = (out / parts.safe_sum()).astype(v.dtype)
    if return_lse:
        return out, jnp.broadcast_to(parts.logsumexp(), out.shape[:-1])
    return out


def attention_weights(
    q: ArrayLike,
    k: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    precision: jax.lax.PrecisionLike = None,
) -> Array:
    """The attention weights ``(..., T, S)`` that :func:`attention` applies to v.

    q ``(..., T, D)`` and k ``(..., S, D)`` and the keyword arguments are as for
    :func:`attention`. Each row sums to 1 over its attended keys; a fully masked row is all
    zeros. The weights are in float32 for bfloat16/float16/float32 inputs and float64 for
    float64 inputs.
    """
    q, k = jnp.asarray(q), jnp.asarray(k)
    _check_qkv(q, k, None)
    mask, bias = _check_mask_bias(mask, bias, q, k, q_offset, kv_offset)
    ndim = len(_broadcast_all(q=q, k=k, mask=mask, bias=bias)) + 2
    q, k, mask, bias = (_pad_rank(x, ndim) for x in (q, k, mask, bias))
    parts, _ = _logits(q, k, mask, bias, scale, precision)
    return parts.weights()
