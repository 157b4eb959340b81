"""The pure attention core.

Dimension key, used in every einsum and shape comment of jattn:

  B  batch                      T  query length
  N  query heads                S  key/value length
  K  key/value heads            D  query/key depth
  G  query heads per kv head    E  value depth
  F  feature depth of linear attention's feature map (F = D for the elementwise maps)
  ...  any leading dimensions (batch, heads, groups), broadcast like NumPy

Paged attention (:func:`jattn.paged_attention`) adds the names of a ragged batch and a page pool:

  Q  query tokens of a ragged batch   P  pages of the pool
  R  requests of a ragged batch       Z  tokens a page (page_size)
  M  pages a request's table names (max_pages)

The computation is the article's: ``scores = q kᵀ · scale``, a softmax over the keys of each
query row (built from the stable parts in :mod:`jattn._softmax`), then the weighted sum of the
values.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike

from jattn._arrays import CHECKPOINT_NAMES
from jattn._checks import (
    KernelRefusalError,
    Operands,
    Options,
    check_block_size,
    check_dropout,
    check_operands,
    check_score_mod,
)
from jattn._masks import Mask
from jattn._paths import PATHS, candidate_paths, dense_weights, features_used, refusals

# The table and constants live in jattn._paths.choice; named here too for the modules that import them from the core.
__all__ = ["CHECKPOINT_NAMES", "attention", "attention_weights", "choose_implementation"]


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
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> Array | tuple[Array, ...]:
    r"""Scaled dot-product attention: ``softmax(score_mod(q kᵀ · scale + bias), masked) v``.

    Shapes (dimension key in :mod:`jattn._core`)::

        q     (..., T, D)      queries
        k     (..., S, D)      keys
        v     (..., S, E)      values
        mask  (..., T, S)      boolean, True = attend; broadcastable
        bias  (..., T, S)      additive, floating; broadcastable
        out   (..., T, E)      in the dtype of q, k, v
        lse   (..., T)         log-sum-exp of each row's logits (float32, or float64)
        sinks (...)            one logit per row of the leading dims, e.g. (N,) against (B, N)
        max_logit (..., T)     each row's largest (modified, kept) logit; -inf for an empty row

    The leading dimensions ``...`` of q, k, v, mask and bias broadcast like NumPy, so a head axis
    of size 1 in k and v gives multi-query attention, and grouped-query attention is q of shape
    ``(B, K, G, T, D)`` against k, v of shape ``(B, K, 1, S, D)``. ``vmap`` over any leading
    axis is free.

    Layout: the heads are leading dimensions, as in torch's ``(B, N, T, D)``. No check on shapes
    can tell this from jax.nn's and Flax's ``(B, T, N, H)``: ``(2, 32, 1, 128)`` is one token of
    32 heads here (decoding) and 32 tokens of one head there, ``(2, 8, 4, 64)`` a prompt of 4
    tokens with 8 heads or of 8 tokens with 4, and any leading dims (windows, axial rows, sets)
    are valid. So ``(B, T, N, H)`` arrays with ``T == S`` attend over the heads of each token
    (N query heads against K key heads) without an error; pass them to
    :func:`jattn.dot_product_attention` (jax.nn's signature and layout, grouped heads included)
    or swap them to ``(B, N, T, H)`` with ``x.swapaxes(-3, -2)``. With ``T != S`` their leading
    dims do not broadcast, and a mask ``(T, S)`` does not fit the ``(N, K)`` read from them: both
    errors name the layouts. One query token ``(B, 1, N, H)`` against ``(B, S, K, H)`` does
    broadcast, to an output ``(B, S, N, H)`` unlike q's shape. Grouped heads in torch's layout,
    q ``(B, N, T, D)`` against k, v ``(B, K, S, D)``, take the form above:
    ``q.reshape(B, K, N // K, T, D)`` with ``k[:, :, None]`` and ``v[:, :, None]``. A torch
    key-padding mask ``(B, S)`` is ``masks.padding(kv_lengths=...)`` or ``mask[:, None, None, :]``
    here (True = attend); passed as it is, it is read as ``(T, S)``: an error that says so, unless
    ``B`` is 1 (the same mask) or ``T`` (then one row per query, without an error).

    .. math::
        \mathrm{out}_t = \sum_s \frac{e^{x_{ts} - m_t}}{\sum_{s'} e^{x_{ts'} - m_t}} v_s, \quad
        x_{ts} = \mathrm{scale}\, q_t \cdot k_s + \mathrm{bias}_{ts}, \quad m_t = \max_s x_{ts}

    with the sums and the max over attended keys only.

    Score modifications and sinks (see :mod:`jattn.score_mods`): ``score_mod(score, batch, head,
    q_pos, kv_pos)`` replaces each logit ``x_ts`` before the mask. Its arguments are arrays that
    broadcast against ``score``: int32 ``batch`` indexes the first leading axis (after
    broadcasting q, k, v, mask, bias), ``head`` the remaining leading axes flattened row-major
    (for ``(B, N, T, D)``: head = n; for the grouped layout ``(B, K, G, T, D)``: head =
    k·G + g; both 0 where there is no such axis); ``q_pos``, ``kv_pos`` are the absolute
    positions of the mask predicates (``q_offset + t``, ``kv_offset + s``). It must act element
    by element with NumPy broadcasting (the blockwise path calls it on tiles). Arrays it closes
    over receive gradients on every path. ``sinks`` adds ``e^sink`` to each row's denominator
    without a value: ``out_t = Σ_s e^{x_ts} v_s / (Σ_s e^{x_ts} + e^{sink})``; the log-sum-exp
    includes it, the max logit does not.

    Contract:
      * A query row whose keys are all masked out returns exactly 0 and contributes zero
        gradient to q, k, v, bias, sinks and the arrays of ``score_mod`` (its log-sum-exp is
        ``-inf``, or its sink with ``sinks``: a sink alone keeps the row's output at 0); never
        NaN, never the mean of v. A row whose every logit is ``-inf`` through ``bias`` or
        ``score_mod`` is treated the same.
      * NaN in an unmasked entry of q, k, v or bias propagates to the rows it touches.
      * bfloat16/float16 inputs: logits and softmax are computed and accumulated in float32
        (no overflow for logits up to the float32 range); the output is in the input dtype.
        float64 inputs (with ``jax_enable_x64``) compute in float64.
      * Pure: no side effects and no host syncs; works under ``jit``, ``vmap``, ``grad``,
        ``remat``, forward mode (``jvp``, ``jacfwd``, ``linearize``) and second order, on every
        path that can (:data:`jattn.TRANSFORMS`); the output and lse carry the checkpoint names
        :data:`jattn.CHECKPOINT_NAMES`.

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
      dropout_rate: probability of dropping an attention weight (training only); kept weights
        are scaled by ``1 / (1 - dropout_rate)``. Entry ``(t, s)`` of leading row ``b`` (the
        broadcast leading dimensions flattened row-major) is kept by a stateless hash of the
        key, ``b``, ``t`` and ``s`` (:mod:`jattn._dropout`), so 'dense', 'blockwise' (any
        ``block_size``) and 'pallas' on GPU drop exactly the same entries.
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      precision: matmul precision passed to the einsums (matters on TPU).
      return_lse: also return the ``(..., T)`` log-sum-exp of the logits.
      implementation: ``'dense'`` materialises the ``(..., T, S)`` scores (the reference);
        ``'blockwise'`` runs an online softmax over blocks (:mod:`jattn._blockwise.attention`): O(T)
        memory, empty blocks of a mask predicate skipped, same contract; ``'xla'`` /
        ``'cudnn'`` hand the call to :func:`jax.nn.dot_product_attention` and raise a
        ``ValueError`` for arguments it cannot express; ``'pallas'`` runs a fused Pallas
        kernel of the platform (:mod:`jattn._paths.pallas`): on GPU jattn's own (:mod:`jattn._gpu`:
        any static predicate, padding() and segment_ids() as per-tile kinds, score_mod, sinks,
        return_lse, grouped heads unrepeated), on CPU that same kernel in Pallas interpret mode
        (exact but slow, meant for tests), splash attention on TPU (any static predicate,
        padding(), segment_ids()); lengths and head dims are padded by jattn; ``None``
        chooses (:func:`jattn.choose_implementation` says which): the platform's fused paths of
        :data:`jattn.AUTO_ORDER` in order (GPU: 'pallas', then 'cudnn'; TPU: 'pallas'), each
        taking the call or refusing it by itself (a ``KernelRefusalError``, caught: the next path
        runs), then blockwise where it applies and the scores would have at least
        ``AUTO_BLOCKWISE_MIN`` entries per head, dense otherwise. A path named here that cannot
        take the call raises a ``ValueError`` naming the argument and the paths that take it.
      block_size: ``(block_q, block_kv)`` (or one int for both) of the blockwise path;
        ``None`` chooses the tile from the mask, the platform and the CPU threads (:func:`jattn._blockwise.tiles.auto_block`;
        on several CPU threads a causal or windowed backward's at 512, :data:`BACKWARD_SIDE`),
        so results may differ in the last bits between machines; pass it to fix them. On
        'pallas' the kernel's blocks (GPU default 64 x 64, 64 x 32 beyond D 128, cut to the lengths).
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score``, see above.
      sinks: floating sink logits, broadcastable to the leading dimensions ``...``.
      return_max_logit: also return the ``(..., T)`` row max logit (QK-clip monitoring),
        without a gradient on every path (the log-sum-exp has one).

    Returns:
      ``out`` of shape ``(..., T, E)``, followed by ``lse`` when ``return_lse`` and then
      ``max_logit`` when ``return_max_logit`` (a tuple when either is asked for).

    Raises:
      TypeError: non-floating or mismatched dtypes of q, k, v; non-bool mask; a function as
        mask (``masks.causal`` uncalled); non-float bias; offsets that are not ints or integer
        arrays.
      ValueError: ranks below 2, mismatched D or S, leading dimensions or a mask/bias shape
        that does not broadcast (the message names the layouts above).
    """
    ops = check_operands(q, k, v, mask=mask, bias=bias, scale=scale, q_offset=q_offset, kv_offset=kv_offset)
    dropout_rate = check_dropout(dropout_rate, dropout_rng)
    blocks = check_block_size(block_size)
    check_score_mod(score_mod)
    sinks = None if sinks is None else jnp.asarray(sinks)
    used = features_used(ops, dropout_rate, precision, return_lse, block_size, score_mod, sinks, return_max_logit)
    opts = Options(blocks, precision, score_mod, sinks, dropout_rate, dropout_rng, return_lse, return_max_logit)
    return _first_taker(candidate_paths(implementation, ops.q, ops.k, used), ops, opts)[1]


def _first_taker(candidates: tuple[str, ...], ops: Operands, opts: Options) -> tuple[str, Array | tuple[Array, ...]]:
    """The first of ``candidates`` that takes the call, and its result (as :func:`attention` returns it).

    A candidate that cannot take this call raises :class:`jattn._checks.KernelRefusalError` and the next one
    runs. An explicit ``implementation`` (one candidate) raises its own refusal; where the automatic choice's
    every candidate refuses, one ``ValueError`` names each with its reason (one message, not an
    ``ExceptionGroup``: callers catch ``ValueError``, as for every refusal of jattn).
    """
    refused = []
    for path in candidates:
        try:
            return path, _run(path, ops, opts)
        except KernelRefusalError as e:
            if len(candidates) == 1:
                raise
            refused.append(f"{path!r}: {e}")
    raise ValueError("implementation=None: every candidate path refused this call; " + "; ".join(refused))


def _run(path: str, ops: Operands, opts: Options) -> Array | tuple[Array, ...]:
    """``path`` on checked operands: ``out (..., T, E)``, then ``lse (..., T)`` and ``max_logit (..., T)`` where asked for.

    The output and log-sum-exp carry :data:`CHECKPOINT_NAMES` (the backward's residuals too, asked for or not).
    """
    with refusals(path):
        out, lse, top = PATHS[path](ops, opts)
    out = checkpoint_name(out, CHECKPOINT_NAMES[0])
    lse = None if lse is None else checkpoint_name(lse, CHECKPOINT_NAMES[1])
    extra = ((lse,) if opts.return_lse else ()) + ((top,) if opts.return_max_logit else ())
    return (out, *extra) if extra else out


def choose_implementation(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    dropout_rate: float = 0.0,
    precision: jax.lax.PrecisionLike = None,
    return_lse: bool = False,
    block_size: int | tuple[int, int] | None = None,
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> str:
    """The path :func:`attention` with ``implementation=None`` takes for these arguments.

    One of :data:`jattn.IMPLEMENTATIONS`: the platform's fused paths of :data:`jattn.AUTO_ORDER`
    (GPU: 'pallas', then 'cudnn'; TPU: 'pallas') whose :data:`jattn.SUPPORT` cells for the
    arguments used are not "no", each taking the call or refusing it by itself (a "partly" cell:
    e.g. the GPU kernel takes ``causal()`` and ``padding()``, not a window); then blockwise where it
    honours every argument and the scores would have at least ``AUTO_BLOCKWISE_MIN`` entries per
    head (or ``block_size`` is given), dense otherwise. Shapes as for :func:`attention`. Where a
    fused path is a candidate, the call is traced abstractly (:func:`jax.eval_shape`) through the
    same candidates :func:`attention` tries, so the answer is the path it runs; nothing is computed.
    """
    ops = check_operands(
        q, k, v, mask=mask, bias=bias, scale=None, q_offset=q_offset, kv_offset=kv_offset, offsets=False
    )
    used = features_used(ops, dropout_rate, precision, return_lse, block_size, score_mod, sinks, return_max_logit)
    candidates = candidate_paths(None, ops.q, ops.k, used)
    if len(candidates) == 1:
        return candidates[0]
    sinks = None if sinks is None else jnp.asarray(sinks)
    rng = jax.random.key(0) if dropout_rate else None
    opts = Options(
        check_block_size(block_size), precision, score_mod, sinks, dropout_rate, rng, return_lse, return_max_logit
    )
    taken: list[str] = []
    jax.eval_shape(lambda: taken.append(_first_taker(candidates, ops, opts)[0]))
    return taken[0]


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
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
) -> Array:
    """The attention weights ``(..., T, S)`` that :func:`attention` applies to v (before dropout).

    q ``(..., T, D)`` and k ``(..., S, D)`` and the keyword arguments are as for
    :func:`attention`, ``score_mod`` and ``sinks (...)`` included. Each row sums to 1 over its
    attended keys, or with ``sinks`` to ``1 - e^sink / (Σ_s e^{x_ts} + e^sink)``: the sink's
    share, which has no column here; a fully masked row is all zeros. The weights are in float32
    for bfloat16/float16/float32 inputs and float64 for float64 inputs.
    """
    ops = check_operands(q, k, None, mask=mask, bias=bias, scale=scale, q_offset=q_offset, kv_offset=kv_offset)
    check_score_mod(score_mod)
    return dense_weights(ops, precision, score_mod, None if sinks is None else jnp.asarray(sinks))
