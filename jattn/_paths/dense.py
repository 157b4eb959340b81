"""The dense path: the whole ``(..., T, S)`` score grid materialised, the reference of every other path.

:func:`dense_mask` evaluates a mask on the grid, :func:`_logits` builds the scaled, biased,
modified, masked scores as softmax parts, :func:`dense_attention` is the forward
``(out, lse, max_logit)`` of ``implementation='dense'``, :func:`dense_weights` the weights of
:func:`jattn.attention_weights` and :func:`dense_lse` the log-sum-exp the jax.nn hand-over
differentiates. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn._arrays import compute_dtype, lead_index
from jattn._checks import Operands, Options, Result, check_sinks
from jattn._dropout import keep_mask, keep_scale, row_seeds
from jattn._masks import Mask, as_rows, query_offset
from jattn._softmax import SoftmaxParts, softmax_parts

__all__ = ["dense_attention", "dense_lse", "dense_mask", "dense_path", "dense_weights"]


def dense_mask(
    mask: Mask | None,
    q: Array,
    k: Array,
    q_offset: ArrayLike | None,
    kv_offset: ArrayLike,
    lead: tuple[int, ...],
    axis: int,
) -> Array | None:
    """The boolean ``(..., T, S)`` of a mask in a call of leading shape ``lead`` (:class:`jattn._checks.Operands`).

    A per-example mask puts its batch on ``lead[axis]``, the first axis of q.
    """
    if mask is None:
        return None
    T, S = q.shape[-2], k.shape[-2]
    if mask.per_row:
        return _dense_rows(mask, T, S, q_offset, kv_offset, lead, axis)
    dense = mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset)
    if mask.per_example and dense.ndim == 4:  # (B, 1, T, S): batch first (q has a batch axis: check_operands)
        dense = dense.reshape(dense.shape[0], *(1,) * (q.ndim - 3), T, S)
    return dense


def _dense_rows(
    mask: Mask, T: int, S: int, q_offset: ArrayLike | None, kv_offset: ArrayLike, lead: tuple[int, ...], axis: int
) -> Array:
    """A mask that reads the batch and head (:func:`jattn.masks.predicate`), evaluated per row of the call: ``(..., T, S)``.

    As the blockwise path reads it: every leaf as rows of the leading shape flattened
    (:func:`jattn._masks.rows.as_rows`), at static offsets.
    """
    if not all(isinstance(o, numbers.Integral) for o in (0 if q_offset is None else q_offset, kv_offset)):
        raise ValueError(
            f"a masks.predicate takes static int offsets, got q_offset={q_offset!r}, kv_offset={kv_offset!r}"
        )
    q0 = query_offset(q_offset, kv_offset, T, S)
    rows = as_rows(mask, lead, axis)._bind(q0, kv_offset)
    m = rows.allowed(q0 + jnp.arange(T, dtype=jnp.int32)[:, None], kv_offset + jnp.arange(S, dtype=jnp.int32)[None])
    return jnp.broadcast_to(m, (math.prod(lead), T, S)).reshape(*lead, T, S)


def _pad_rank(x: Array | None, ndim: int) -> Array | None:
    """Left-pads ``x`` with unit axes to ``ndim`` dimensions (strict rank promotion is kept)."""
    return None if x is None else x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _operands(ops: Operands) -> tuple[tuple[int, ...], Array, Array, Array | None, Array | None, Array | None]:
    """The leading shape ``...`` of the call and q, k, v, the dense mask ``(..., T, S)`` and bias, all at its rank."""
    q, k, v, bias, lead = ops.q, ops.k, ops.v, ops.bias, ops.lead
    mask = dense_mask(ops.mask, q, k, ops.q_offset, ops.kv_offset, lead, ops.axis)
    ndim = len(lead) + 2
    q, k, v, mask, bias = (_pad_rank(x, ndim) for x in (q, k, v, mask, bias))
    return lead, q, k, v, mask, bias


def _place(offset: ArrayLike, n: int, axis: int, ndim: int) -> Array:
    """Positions ``offset + arange(n)`` along axis -2 (``axis`` 0) or -1 (``axis`` 1) at rank ``ndim``."""
    offset = jnp.asarray(offset, jnp.int32)
    if offset.ndim:  # (B,): batch first
        offset = offset.reshape(-1, *(1,) * (ndim - 1))
    pos = jnp.arange(n, dtype=jnp.int32).reshape((n, 1) if axis == 0 else (1, n))
    pos = pos.reshape((1,) * (ndim - 2) + pos.shape)
    return offset + pos if offset.ndim else pos + offset


def _positions(q_offset: ArrayLike | None, kv_offset: ArrayLike, T: int, S: int, ndim: int) -> tuple[Array, Array]:
    """Absolute positions for ``score_mod``: ``q_pos (..., T, 1)`` and ``kv_pos (..., 1, S)`` int32 at rank ``ndim``.

    Per-example offsets ``(B,)`` put the batch on the first axis, as for masks.
    """
    q_offset = query_offset(q_offset, jnp.asarray(kv_offset, jnp.int32), T, S)
    return _place(q_offset, T, 0, ndim), _place(kv_offset, S, 1, ndim)


def _logits(
    q: Array,
    k: Array,
    mask: Array | None,
    bias: Array | None,
    scale: float | ArrayLike,
    precision: jax.lax.PrecisionLike,
    score_mod: Callable[..., Array] | None = None,
    mod_index: tuple = (),
    sinks: Array | None = None,
) -> tuple[SoftmaxParts, jnp.dtype, Array]:
    """Scaled, biased, modified, masked scores ``(..., T, S)`` split into softmax parts (all at one rank).

    ``mod_index`` is ``(batch, head, q_pos, kv_pos)`` for ``score_mod``; ``sinks`` ``(..., 1, 1)``
    joins each row as one more always-kept column without a value (the parts then span S + 1
    columns). Also returns the row max logit ``(..., T)`` over the kept scores (``-inf`` for a row
    with none), sinks left out.
    """
    compute = compute_dtype(q.dtype)
    # The scale goes into q, not onto the scores: a product of scores and scale can be fused into
    # one multiply-add with the max subtraction (XLA on CPU does), leaving the row maximum's own
    # exponent at minus half an ulp of the logit instead of 0 (exp(-1e25) for logits near 1e32).
    qs = q.astype(compute) * jnp.asarray(scale, compute)
    s = jnp.einsum("...td,...sd->...ts", qs, k.astype(compute), precision=precision, preferred_element_type=compute)
    if bias is not None:
        s = s + bias.astype(compute)
    if score_mod is not None:
        x = jnp.asarray(score_mod(s, *mod_index)).astype(compute)
        s = jnp.broadcast_to(x, jnp.broadcast_shapes(s.shape, x.shape))
    if mask is not None:
        s = jnp.broadcast_to(s, jnp.broadcast_shapes(s.shape, mask.shape))
    keep = jnp.ones((1,) * s.ndim, bool) if mask is None else mask
    # A monitor, as on every path: the blockwise and ring backwards have no max-logit term.
    top = jax.lax.stop_gradient(jnp.max(s, axis=-1, where=keep, initial=-jnp.inf))
    if sinks is not None:
        shape = jnp.broadcast_shapes(s.shape, (*sinks.shape[:-1], 1))
        s = jnp.concatenate([jnp.broadcast_to(s, shape), jnp.broadcast_to(sinks.astype(compute), (*shape[:-1], 1))], -1)
        keep = jnp.concatenate([jnp.broadcast_to(keep, shape), jnp.ones((*shape[:-1], 1), bool)], -1)
        return softmax_parts(s, keep), compute, top
    return softmax_parts(s, mask), compute, top


def _dropout(p: Array, rate: float, rng: Array | None, lead: tuple[int, ...]) -> Array:
    """Weights ``p (..., T, S)`` broadcast to ``(*lead, T, S)`` with dropout's rule (:mod:`jattn._dropout`) applied.

    The rows' seeds are ``row_seeds(rng, flat leading index)``.
    """
    if rate == 0.0:
        return p
    T, S = p.shape[-2:]
    seeds = row_seeds(rng, jnp.arange(math.prod(lead), dtype=jnp.int32).reshape(lead))
    one = (1,) * len(lead)
    t, s = jnp.arange(T, dtype=jnp.int32).reshape(*one, T, 1), jnp.arange(S, dtype=jnp.int32).reshape(*one, 1, S)
    keep = keep_mask(seeds[..., None, None], t, s, rate)  # (*lead, T, S): the blockwise path's bits exactly
    return jnp.broadcast_to(p, keep.shape) * keep_scale(keep, rate, p.dtype)


def dense_attention(
    ops: Operands,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    score_mod: Callable[..., Array] | None = None,
    sinks: Array | None = None,
) -> tuple[Array, Array, Array]:
    """``implementation='dense'`` on checked operands: ``out (..., T, E)``, ``lse (..., T)``, ``max_logit (..., T)``."""
    T, S = ops.q.shape[-2], ops.k.shape[-2]
    lead, q, k, v, mask, bias = _operands(ops)
    ndim = len(lead) + 2
    mod_index = (*lead_index(lead), *_positions(ops.q_offset, ops.kv_offset, T, S, ndim)) if score_mod else ()
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
        sinks = jnp.broadcast_to(sinks, lead)[..., None, None]
    parts, compute, top = _logits(q, k, mask, bias, ops.scale, precision, score_mod, mod_index, sinks)
    weights = parts.weights()
    p = _dropout(weights if sinks is None else weights[..., :-1], dropout_rate, dropout_rng, lead)
    # The weighted sum takes the normalised float32 weights (v upcast for bf16/f16), so the
    # gradient is the softmax's own p (dp - rowsum(p dp)) with dp = dO·vᵀ in float32: its two terms
    # cancel exactly where they should (a one-hot row gives 0). Rounding the weights to 16 bits, or
    # normalising after the sum, rounds or splits dp and breaks that cancellation (and dp overflows
    # float16 for large v).
    out = jnp.einsum("...ts,...se->...te", p, v.astype(compute), precision=precision, preferred_element_type=compute)
    out = out.astype(v.dtype)
    rows = out.shape[:-1]
    return out, jnp.broadcast_to(parts.logsumexp(), rows), jnp.broadcast_to(top, rows)


def dense_path(ops: Operands, opts: Options) -> Result:
    """``implementation='dense'`` as :func:`jattn.attention` runs it (:func:`dense_attention`; no tiles)."""
    return Result(
        *dense_attention(
            ops,
            dropout_rate=opts.dropout_rate,
            dropout_rng=opts.dropout_rng,
            precision=opts.precision,
            score_mod=opts.score_mod,
            sinks=opts.sinks,
        )
    )


def dense_weights(
    ops: Operands,
    precision: jax.lax.PrecisionLike,
    score_mod: Callable[..., Array] | None = None,
    sinks: Array | None = None,
) -> Array:
    """The softmax weights ``(..., T, S)`` of q ``(..., T, D)`` against k ``(..., S, D)`` on checked operands.

    As :func:`dense_attention` forms them: ``score_mod`` at the same indices, ``sinks`` in each
    row's denominator (their column left out, so such a row sums to less than 1).
    """
    T, S = ops.q.shape[-2], ops.k.shape[-2]
    lead, q, k, _, mask, bias = _operands(ops)
    mod_index = (*lead_index(lead), *_positions(ops.q_offset, ops.kv_offset, T, S, len(lead) + 2)) if score_mod else ()
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
        sinks = jnp.broadcast_to(sinks, lead)[..., None, None]
    parts, _, _ = _logits(q, k, mask, bias, ops.scale, precision, score_mod, mod_index, sinks)
    weights = parts.weights()
    return weights if sinks is None else weights[..., :-1]


def dense_lse(ops: Operands) -> Array:
    """The log-sum-exp ``(..., T)`` of the dense logits (default precision, no score_mod or sinks)."""
    lead, q, k, _, mask, bias = _operands(ops)
    parts = _logits(q, k, mask, bias, ops.scale, None, None, (), None)[0]
    return jnp.broadcast_to(parts.logsumexp(), (*lead, q.shape[-2]))
