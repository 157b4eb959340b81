"""Flax NNX attention modules: thin layers over the jattn core.

Softmax attention is :func:`jattn.attention`; ``kind='linear'`` uses :func:`jattn.linear_attention`.
The call itself (batch dims, masks, QK norm, rotary embedding, the decoding cache) is shared with
:mod:`jattn.linen` in ``jattn._heads``; the cache is a dict of arrays (``jattn._cache``) held in
``nnx.Cache`` variables.

Parameters (the article's names): ``wq`` (``d_model -> N*D``), ``wk`` and ``wv`` (keys/values
features ``-> K*D``, K = ``num_kv_heads``) and, when there is an output projection, ``wo``
(``N*D -> out features``); each an ``nnx.Linear`` holding ``kernel`` and, with ``use_bias``,
``bias``. With ``normalize_qk``: ``query_ln`` and ``key_ln``, bias-free ``nnx.LayerNorm`` over
the head depth D (Flax's names). Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from jattn import _heads
from jattn._checks import check_bool
from jattn._masks import Mask
from jattn._score_mods import ScoreMod

__all__ = ["CrossAttention", "SelfAttention"]

_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()
SOW_NAME = "attention_weights"  # the name the weights are sown under (as Flax's attention)


class _Attention(nnx.Module):
    """Projections, QK norms, dropout and the output projection shared by the attention modules."""

    def __init__(
        self,
        d_model: int,
        kv_features: int,
        *,
        num_heads: int,
        num_kv_heads: int | None,
        qkv_features: int | None,
        out_features: int | None,
        out_proj: bool | None,
        use_bias: bool,
        kind: str,
        feature_map: str | Callable[[Array], Array],
        dropout_rate: float,
        deterministic: bool,
        dtype: Any,
        param_dtype: Any,
        precision: jax.lax.PrecisionLike,
        sequence_axis: str | None,
        implementation: str | None,
        block_size: int | tuple[int, int] | None,
        normalize_qk: bool,
        rope: bool,
        rope_base: float,
        decode: bool,
        score_mod: ScoreMod | None,
        sinks: bool,
        kernel_init: nnx.Initializer,
        bias_init: nnx.Initializer,
        rngs: nnx.Rngs,
    ) -> None:
        o = _heads.options(
            d_model,
            kv_features,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            qkv_features=qkv_features,
            out_features=out_features,
            out_proj=out_proj,
            use_bias=use_bias,
            kind=kind,
            feature_map=feature_map,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            sequence_axis=sequence_axis,
            implementation=implementation,
            block_size=block_size,
            normalize_qk=normalize_qk,
            rope=rope,
            rope_base=rope_base,
            decode=decode,
            score_mod=score_mod,
            sinks=sinks,
        )
        self.options = o
        self.deterministic = bool(deterministic)  # Flax's switch: .eval(), .train() and nnx.view set it
        self.d_model, self.kv_features, self.num_heads = o.d_model, o.kv_features, o.num_heads
        self.num_kv_heads, self.head_depth, self.kind = o.num_kv_heads, o.head_depth, o.kind

        def linear(fin: int, fout: int) -> nnx.Linear:
            return nnx.Linear(
                fin,
                fout,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=precision,
                kernel_init=kernel_init,
                bias_init=bias_init,
                rngs=rngs,
            )

        def norm() -> nnx.LayerNorm:  # Flax's QK norm: LayerNorm over D without bias, epsilon 1e-6
            return nnx.LayerNorm(o.head_depth, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        features = o.num_heads * o.head_depth
        self.wq = linear(o.d_model, features)
        self.wk = linear(o.kv_features, o.num_kv_heads * o.head_depth)
        self.wv = linear(o.kv_features, o.num_kv_heads * o.head_depth)
        self.wo = linear(features, o.out_features) if o.out_features is not None else nnx.data(None)
        self.query_ln = norm() if o.normalize_qk else nnx.data(None)
        self.key_ln = norm() if o.normalize_qk else nnx.data(None)
        self.sinks = nnx.Param(jnp.zeros((o.num_heads,), param_dtype)) if o.sinks else nnx.data(None)
        self.dropout_rngs = rngs.dropout.fork() if o.dropout_rate > 0 else nnx.data(None)
        self.cache: dict[str, nnx.Cache] | None = nnx.data(None)

    def set_view(self, deterministic: bool | None = None) -> None:
        """Sets the switches ``nnx.view`` is given (Flax's hook, as on ``nnx.MultiHeadAttention``).

        Args:
          deterministic: if True, dropout is off (the new default of the call-time switch); None: unchanged.
        """
        if deterministic is not None:
            self.deterministic = check_bool("deterministic", deterministic)

    def _call(
        self,
        x: Array,
        context: Array | None,
        mask: Array | Mask | None,
        *,
        context_mask: Array | None = None,
        deterministic: bool | None,
        rngs: nnx.Rngs | None,
        return_weights: bool,
        sow_weights: bool,
        decode: bool | None = False,
        lengths: Array | None = None,
        implementation: str | None,
        block_size: int | tuple[int, int] | None,
    ) -> Array | tuple[Array, Array]:
        _heads.check_call(deterministic, return_weights, decode, sow_weights)
        decode = self.options.decode if decode is None else decode
        if deterministic is None:
            deterministic = check_bool("deterministic (the module attribute)", self.deterministic)
        rng = None
        if self.options.dropout_rate > 0 and not deterministic:
            rng = (rngs.dropout if rngs is not None else self.dropout_rngs)()
        if decode and self.cache is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        cache = {name: var[...] for name, var in self.cache.items()} if decode else None
        sinks = None if self.sinks is None else self.sinks[...]
        layers = _heads.Layers(self.wq, self.wk, self.wv, self.wo, self.query_ln, self.key_ln, sinks)
        out, weights, cache = _heads.forward(
            self.options,
            layers,
            x,
            context,
            mask,
            context_mask=context_mask,
            cache=cache,
            lengths=lengths,
            dropout_rng=rng,
            return_weights=return_weights or sow_weights,
            implementation=implementation,
            block_size=block_size,
        )
        if cache is not None:
            for name, value in cache.items():
                self.cache[name][...] = value
        if sow_weights:
            self.sow(nnx.Intermediate, SOW_NAME, weights)
        return (out, weights) if return_weights else out


class SelfAttention(_Attention):
    """Multi-head self-attention over ``x`` of shape ``(..., T, d_model)``.

    The default construction is the article's module: three bias-free linear maps
    ``d_model -> d_model`` (``wq``, ``wk``, ``wv``), one head, scale ``1/sqrt(d_model)`` and
    output ``(..., T, d_model)`` without an output projection. :class:`jattn.linen.SelfAttention`
    takes the same options under the same names.

    Args:
      d_model: input features.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (default N); N/K query heads share one kv head
        (grouped-query attention; K=1 is multi-query). Must divide N.
      qkv_features: total query features N*D (default d_model); kv heads have the same D.
      out_features: output features; setting it implies an output projection.
      out_proj: add the output projection ``wo``; default True when ``num_heads > 1`` or
        ``out_features`` is set. Without it the output has qkv_features features.
      use_bias: biases on the projections.
      kind: ``'softmax'`` (default) or ``'linear'`` (:func:`jattn.linear_attention`, whose
        only masks are None and ``masks.causal()``).
      feature_map: the feature map of linear attention (``'elu'``, ... or a callable).
      dropout_rate: dropout on the attention weights (softmax kind), in ``[0, 1)``.
      deterministic: the attribute ``deterministic``, the default of the call-time switch;
        dropout is off when True. Flax's convention, as ``nnx.MultiHeadAttention``:
        ``model.eval()`` sets it True and ``model.train()`` False in every nested module, and
        ``nnx.view(model, deterministic=...)`` gives a view with it set (:meth:`set_view`).
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: parameter dtype.
      precision: matmul precision for projections and attention.
      sequence_axis: a mesh axis the sequence is sharded over; when the current mesh
        (``jax.set_mesh``) has it with more than one device, softmax attention runs as ring
        attention over it (:func:`jattn.sequence_parallel_attention`; masks: None or a
        position-only predicate, no dropout). Decoding uses the plain core.
      implementation: the path of :func:`jattn.attention` (``'dense'``, ``'blockwise'``,
        ``'xla'``, ``'cudnn'``; default None: chosen per call). Mask predicates reach the core
        as they are, so the blockwise path skips their empty tiles; overridable per call.
      block_size: the blockwise tiles ``(block_q, block_kv)`` or one int (default: chosen from
        the mask); overridable per call.
      normalize_qk: QK normalisation as Flax's ``MultiHeadAttention(normalize_qk=True)``: a
        bias-free LayerNorm over the head depth D (``query_ln``, ``key_ln``; scale shared by
        the heads, epsilon 1e-6) on queries and keys after their projections.
      rope: rotary position embeddings (:func:`jattn.rope`) on queries and keys (after the
        QK norm) at their absolute positions: ``0..T-1``, or the cache's positions when
        decoding (so decoding equals the full pass). Needs an even head depth D.
      rope_base: the wavelength base of ``rope`` (> 0).
      decode: default for the call-time ``decode`` switch.
      score_mod: a score modification ``(score, batch, head, q_pos, kv_pos) -> score``
        (:mod:`jattn.score_mods`: ``softcap``, ``alibi``, ...) that :func:`jattn.attention`
        applies on every call (softmax kind). ``head`` is the query head n (kv head
        ``n // (N/K)``); ``q_pos``, ``kv_pos`` are absolute positions: ``0..T-1`` in a full
        pass, the cache's positions when decoding (so decoding equals the full pass). Arrays
        it closes over are constants of the module (not parameters): hold learned ones
        yourself and build the module's mod from them.
      sinks: a learned sink logit per query head, the parameter ``sinks (N,)`` (zeros at
        init, head n = k·(N/K) + g as the heads are split), passed as :func:`jattn.attention`'s
        ``sinks``: each row's softmax denominator gains ``e^sink`` (softmax kind).
      kernel_init, bias_init: initialisers of the projections.
      rngs: ``nnx.Rngs`` for the parameters (``params``) and dropout (``dropout``).

    Decoding: :meth:`init_cache`, then calls with ``decode=True`` (see there).
    """

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int = 1,
        num_kv_heads: int | None = None,
        qkv_features: int | None = None,
        out_features: int | None = None,
        out_proj: bool | None = None,
        use_bias: bool = False,
        kind: str = "softmax",
        feature_map: str | Callable[[Array], Array] = "elu",
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        sequence_axis: str | None = None,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
        normalize_qk: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        decode: bool = False,
        score_mod: ScoreMod | None = None,
        sinks: bool = False,
        kernel_init: nnx.Initializer = _KERNEL_INIT,
        bias_init: nnx.Initializer = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(
            d_model,
            d_model,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            qkv_features=qkv_features,
            out_features=out_features,
            out_proj=out_proj,
            use_bias=use_bias,
            kind=kind,
            feature_map=feature_map,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            sequence_axis=sequence_axis,
            implementation=implementation,
            block_size=block_size,
            normalize_qk=normalize_qk,
            rope=rope,
            rope_base=rope_base,
            decode=decode,
            score_mod=score_mod,
            sinks=sinks,
            kernel_init=kernel_init,
            bias_init=bias_init,
            rngs=rngs,
        )

    def __call__(
        self,
        x: Array,
        mask: Array | Mask | None = None,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        decode: bool | None = None,
        lengths: Array | None = None,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (..., T, d_model)`` to itself.

        Args:
          x: ``(..., T, d_model)`` inputs: any number of batch dims ``...`` (none: unbatched).
          mask: boolean array (True = attend): ``(T, T)``, ``(..., T, T)`` per example (the
            same for every head) or ``(..., N, T, T)``, any axis may be 1; or a
            :class:`jattn.masks.Mask` such as ``masks.causal()`` (a per-example predicate,
            e.g. ``masks.padding``, takes the batch dims flattened into one).
          deterministic: overrides the attribute ``deterministic`` (set by the constructor,
            ``.eval()``, ``.train()`` or ``nnx.view``) for this call; dropout is off when True.
          rngs: overrides the constructor's dropout stream.
          return_weights: also return the attention weights ``(..., N, T, S)`` (before dropout).
          sow_weights: sow the weights as ``nnx.Intermediate`` under ``'attention_weights'``
            (Flax's convention; collect them with ``nnx.capture(module, nnx.Intermediate)``).
          decode: attend to the cache as well and append these tokens to it (after
            :meth:`init_cache`); ``mask`` must then be a Mask predicate (default causal), on
            absolute positions. None: the constructor's ``decode``.
          lengths: with ``decode``, how many of the T tokens of each example ``(...)`` are
            real (a ragged batch), integers in ``[0, T]``; the rest are neither attended to nor
            cached. Out of range they raise a ValueError, or, traced (under ``jit``), are
            clipped to ``[0, T]`` and make that example's outputs NaN.
          implementation, block_size: override the constructor's (None: keep them).

        Returns:
          ``(..., T, F)`` with F the out features (or qkv features without ``wo``), and the
          weights when ``return_weights`` (with ``decode``, S = cache slots + T).
        """
        _heads.check_input("x", x, self.d_model)
        return self._call(
            x,
            None,
            mask,
            deterministic=deterministic,
            rngs=rngs,
            return_weights=return_weights,
            sow_weights=sow_weights,
            decode=decode,
            lengths=lengths,
            implementation=implementation,
            block_size=block_size,
        )

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        window: int | None = None,
        pinned: tuple[int, ...] = (),
        dtype: Any = jnp.float32,
    ) -> None:
        """Allocates an empty cache for ``batch_size`` sequences.

        Softmax kind: keys and values of the K kv heads only (after QK norm and rotary
        embedding), in ``max_length`` slots; with ``window=w`` a ring buffer of ``w`` slots
        (enough for ``sliding_window(w)``) plus one pinned slot for each position in ``pinned``
        (the global tokens), instead. Linear kind: the recurrent state ``(kv, z)``. Each
        example has its own next position.

        Args:
          batch_size: positive int B, the number of sequences (the product of x's batch dims).
          max_length: positive int, the most positions the full softmax cache holds. Decoding
            past it raises a ValueError or, traced (under ``jit``), gives NaN outputs for the
            positions past it (which are not cached). The window and linear caches have no
            such limit.
          window: None or a positive int (softmax kind only).
          pinned: distinct non-negative int positions kept beside the window (needs ``window``).
          dtype: floating dtype of the cached keys and values (or state).
        """
        cache = _heads.init_cache(self.options, batch_size, max_length, window, pinned, dtype)
        self.cache = nnx.data({name: nnx.Cache(value) for name, value in cache.items()})


class CrossAttention(_Attention):
    """Multi-head cross-attention from ``x`` to a context of another length and feature size.

    Queries come from ``x (..., T, d_model)``, keys and values from
    ``context (..., S, context_features)`` (the same batch dims).

    Options as :class:`SelfAttention` (no rotary embedding or cache); ``wk`` and ``wv`` map
    ``context_features -> K*D``. ``score_mod`` gets the core's positions, the same as mask
    predicates get: queries aligned at the end of the context (``q_pos = S - T + t``), keys at
    ``0..S-1``.
    """

    def __init__(
        self,
        d_model: int,
        context_features: int,
        *,
        num_heads: int = 1,
        num_kv_heads: int | None = None,
        qkv_features: int | None = None,
        out_features: int | None = None,
        out_proj: bool | None = None,
        use_bias: bool = False,
        kind: str = "softmax",
        feature_map: str | Callable[[Array], Array] = "elu",
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        sequence_axis: str | None = None,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
        normalize_qk: bool = False,
        score_mod: ScoreMod | None = None,
        sinks: bool = False,
        kernel_init: nnx.Initializer = _KERNEL_INIT,
        bias_init: nnx.Initializer = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(
            d_model,
            context_features,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            qkv_features=qkv_features,
            out_features=out_features,
            out_proj=out_proj,
            use_bias=use_bias,
            kind=kind,
            feature_map=feature_map,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            sequence_axis=sequence_axis,
            implementation=implementation,
            block_size=block_size,
            normalize_qk=normalize_qk,
            rope=False,
            rope_base=10000.0,
            decode=False,
            score_mod=score_mod,
            sinks=sinks,
            kernel_init=kernel_init,
            bias_init=bias_init,
            rngs=rngs,
        )

    def __call__(
        self,
        x: Array,
        context: Array,
        mask: Array | Mask | None = None,
        *,
        context_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (..., T, d_model)`` to ``context (..., S, context_features)``.

        Args:
          mask: as for :class:`SelfAttention`, over ``(..., N, T, S)``.
          context_mask: boolean ``(..., S)``, False marks context padding (never attended to);
            a query that sees no valid context returns 0 (before ``wo``).
          deterministic, rngs, return_weights, sow_weights, implementation, block_size: as for
            :class:`SelfAttention`.
        """
        _heads.check_context(x, self.d_model, context, self.kv_features, context_mask)
        return self._call(
            x,
            context,
            mask,
            context_mask=context_mask,
            deterministic=deterministic,
            rngs=rngs,
            return_weights=return_weights,
            sow_weights=sow_weights,
            implementation=implementation,
            block_size=block_size,
        )
