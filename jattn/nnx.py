"""Flax NNX attention modules: thin layers over the jattn core.

Softmax attention is :func:`jattn.attention`; ``kind='linear'`` uses :func:`jattn.linear_attention`.
The call itself (batch dims, masks, QK norm, rotary embedding, the decoding cache) is shared with
:mod:`jattn.linen` in ``jattn._modules.call``, and so are the options, declared once (names, types,
defaults) in ``jattn._modules.options.ModuleOptions``, passed to it by name from each constructor,
and documented once there, in the text each class's docstring shows; the cache is a dict of arrays (``jattn._modules.cache``) held in ``nnx.Cache``
variables.

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

from jattn._masks import Mask
from jattn._modules import (
    CallArguments,
    Layers,
    ModuleOptions,
    PagedBatch,
    check_context,
    check_input,
    configure,
    document_options,
    forward,
    gate_params,
    init_cache,
    init_paged_cache,
    paged_forward,
)
from jattn._scalars import check_bool
from jattn.score_mods import ScoreMod

__all__ = ["CrossAttention", "PagedBatch", "SelfAttention"]

_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()
SOW_NAME = "attention_weights"  # the name the weights are sown under (as Flax's attention)


class _Attention(nnx.Module):
    """Projections, QK norms, dropout and the output projection shared by the attention modules."""

    def __init__(
        self,
        d_model: int,
        kv_features: int,
        options: ModuleOptions,
        *,
        cross: bool,
        kernel_init: nnx.Initializer,
        bias_init: nnx.Initializer,
        rngs: nnx.Rngs,
    ) -> None:
        o = configure(d_model, kv_features, options, cross=cross)
        self.options = o
        self.deterministic = bool(o.deterministic)  # Flax's switch: .eval(), .train() and nnx.view set it
        self.d_model, self.kv_features, self.num_heads = o.d_model, o.kv_features, o.num_heads
        self.num_kv_heads, self.head_depth, self.kind = o.num_kv_heads, o.head_depth, o.kind
        init = dict(kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
        self.wq = self._linear(o.d_model, o.qkv_features, **init)
        kv = o.num_householder * o.num_kv_heads * o.head_depth  # DeltaProduct: n_h keys and values a token
        self.wk = self._linear(o.kv_features, kv, **init)
        self.wv = self._linear(o.kv_features, kv, **init)
        self.wo = self._linear(o.qkv_features, o.out_features, **init) if o.out_proj else nnx.data(None)
        self.query_ln = self._norm(rngs) if o.normalize_qk else nnx.data(None)
        self.key_ln = self._norm(rngs) if o.normalize_qk else nnx.data(None)
        self.sinks = nnx.Param(jnp.zeros((o.num_heads,), o.param_dtype)) if o.sinks else nnx.data(None)
        gates = gate_params(o)  # a recurrent kind's (jattn._linear.kinds)
        self.gate_names = tuple(gates)
        for name, (shape, init) in gates.items():
            setattr(self, name, nnx.Param(init(rngs.params(), shape, o.param_dtype)))
        self.dropout_rngs = rngs.dropout.fork() if o.dropout_rate > 0 else nnx.data(None)
        self.cache: dict[str, nnx.Cache] | None = nnx.data(None)

    def _linear(
        self, fin: int, fout: int, *, kernel_init: nnx.Initializer, bias_init: nnx.Initializer, rngs: nnx.Rngs
    ) -> nnx.Linear:
        """A projection ``(B, L, fin) -> (B, L, fout)`` with the module's bias, dtypes and precision."""
        o = self.options
        return nnx.Linear(
            fin,
            fout,
            use_bias=o.use_bias,
            dtype=o.dtype,
            param_dtype=o.param_dtype,
            precision=o.precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            rngs=rngs,
        )

    def _norm(self, rngs: nnx.Rngs) -> nnx.LayerNorm:
        """Flax's QK norm: LayerNorm over D without bias, epsilon 1e-6."""
        o = self.options
        return nnx.LayerNorm(o.head_depth, use_bias=False, dtype=o.dtype, param_dtype=o.param_dtype, rngs=rngs)

    def set_view(self, deterministic: bool | None = None) -> None:
        """Sets the switches ``nnx.view`` is given (Flax's hook, as on ``nnx.MultiHeadAttention``).

        Args:
          deterministic: if True, dropout is off (the new default of the call-time switch); None: unchanged.
        """
        if deterministic is not None:
            self.deterministic = check_bool("deterministic", deterministic)

    def _layers(self) -> Layers:
        """The projections, QK norms, sinks and gates as the shared call takes them."""
        sinks = None if self.sinks is None else self.sinks[...]
        gates = {name: getattr(self, name)[...] for name in self.gate_names} or None
        return Layers(self.wq, self.wk, self.wv, self.wo, self.query_ln, self.key_ln, sinks, gates)

    def _paged_call(self, x: Array, mask: Mask | None, batch: PagedBatch, implementation: str | None) -> Array:
        """A serving step of the flat ragged tokens ``x (Q, d_model)`` on the paged pool (``jattn._modules.paged``)."""
        pool = None if self.cache is None else {name: var[...] for name, var in self.cache.items()}
        if pool is None or "k_pages" not in pool:
            raise ValueError("paged=... needs init_paged_cache(num_pages, page_size) first")
        out, pool = paged_forward(self.options, self._layers(), x, pool, batch, mask, implementation)
        for name, value in pool.items():
            self.cache[name][...] = value
        return out

    def _call(
        self, x: Array, context: Array | None, call: CallArguments, rngs: nnx.Rngs | None
    ) -> Array | tuple[Array, Array]:
        deterministic = call.deterministic
        if deterministic is None:
            deterministic = check_bool("deterministic (the module attribute)", self.deterministic)
        rng = None
        if self.options.dropout_rate > 0 and not deterministic:
            rng = (rngs.dropout if rngs is not None else self.dropout_rngs)()
        decode = call.decoding(self.options)
        if decode and self.cache is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        cache = {name: var[...] for name, var in self.cache.items()} if decode else None
        out, weights, cache = forward(self.options, self._layers(), x, context, call, cache=cache, dropout_rng=rng)
        if cache is not None:
            for name, value in cache.items():
                self.cache[name][...] = value
        if call.sow_weights:
            self.sow(nnx.Intermediate, SOW_NAME, weights)
        return (out, weights) if call.return_weights else out


@document_options("nnx")
class SelfAttention(_Attention):
    """Multi-head self-attention over ``x`` of shape ``(..., T, d_model)``.

    The default construction is the article's module: three bias-free linear maps
    ``d_model -> d_model`` (``wq``, ``wk``, ``wv``), one head, scale ``1/sqrt(d_model)`` and
    output ``(..., T, d_model)`` without an output projection. :class:`jattn.linen.SelfAttention`
    takes the same options under the same names.

    A call's ``mask=None`` is bidirectional in a full pass (every token sees the later ones, as in
    Flax) and causal with ``decode=True``: a decoder passes ``masks.causal()`` on every call, or
    is built with ``causal=True``.

    Args:
      d_model: input features.
      {options}
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
        causal: bool = False,
        score_mod: ScoreMod | None = None,
        sinks: bool = False,
        num_householder: int | None = None,
        kernel_init: nnx.Initializer = _KERNEL_INIT,
        bias_init: nnx.Initializer = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        options = ModuleOptions(
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
            causal=causal,
            score_mod=score_mod,
            sinks=sinks,
            num_householder=num_householder,
        )
        super().__init__(
            d_model, d_model, options, cross=False, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs
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
        paged: PagedBatch | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (..., T, d_model)`` to itself.

        Args:
          x: ``(..., T, d_model)`` inputs: any number of batch dims ``...`` (none: unbatched).
          mask: None (the default) is bidirectional in a full pass, every token attending to
            the later ones too (Flax's convention), and causal with ``decode``: a decoder passes
            ``masks.causal()`` here (or is built with ``causal=True``, which ands it into every
            mask). Otherwise a boolean array (True = attend): ``(T, T)``, ``(..., T, T)`` per
            example (the same for every head) or ``(..., N, T, T)``, any axis may be 1; or a
            :class:`jattn.masks.Mask` such as ``masks.causal()`` (a per-example predicate,
            e.g. ``masks.padding(kv_lengths=...)``, takes the batch dims flattened into one).
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
          implementation, block_size: override the constructor's (None: keep them); softmax
            kind only.
          paged: a :class:`PagedBatch`: ``x (Q, d_model)`` are the flat ragged tokens of many
            requests, continuing their keys in the pool of :meth:`init_paged_cache` (their own
            keys and values are written there first), attended with
            :func:`jattn.paged_attention`; ``mask`` a predicate (default causal) and
            ``implementation`` its path (``'fused'``, ``'xla'`` or None). Returns ``(Q, F)``.

        Returns:
          ``(..., T, F)`` with F the out features (or qkv features without ``wo``), and the
          weights when ``return_weights`` (with ``decode``, S = cache slots + T).
        """
        check_input("x", x, self.d_model)
        if paged is not None:
            if return_weights or sow_weights or decode or lengths is not None or block_size is not None:
                raise ValueError("paged=... takes x, mask and implementation only (no weights, decode or lengths)")
            return self._paged_call(x, mask, paged, implementation)
        call = CallArguments(
            mask=mask,
            context_mask=None,
            deterministic=deterministic,
            return_weights=return_weights,
            sow_weights=sow_weights,
            decode=decode,
            lengths=lengths,
            implementation=implementation,
            block_size=block_size,
        )
        return self._call(x, None, call, rngs)

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
            such limit; the log kinds' (``'log_ssd'``, ``'log_gated_deltanet'``) holds one state per
            Fenwick level of the positions below it and has the full cache's limit.
          window: None or a positive int (softmax kind only).
          pinned: distinct non-negative int positions kept beside the window (needs ``window``).
          dtype: floating dtype of the cached keys and values (or state).
        """
        cache = init_cache(self.options, batch_size, max_length, window, pinned, dtype)
        self.cache = nnx.data({name: nnx.Cache(value) for name, value in cache.items()})

    def init_paged_cache(self, num_pages: int, page_size: int, *, dtype: Any = jnp.float32) -> None:
        """Allocates an empty paged pool, the cache of calls with ``paged=PagedBatch(...)`` (softmax kind).

        ``k_pages`` and ``v_pages (num_pages, page_size, K, D)``: keys (after QK norm and rotary
        embedding) and values of the K kv heads, shared by every request; which pages a request
        holds is the caller's (its ``page_table``). Replaces any cache the module held.

        Args:
          num_pages: positive int P.
          page_size: positive int Z, tokens a page.
          dtype: floating dtype of the pool (queries are cast to it for the attention).
        """
        cache = init_paged_cache(self.options, num_pages, page_size, dtype)
        self.cache = nnx.data({name: nnx.Cache(value) for name, value in cache.items()})


@document_options("nnx")
class CrossAttention(_Attention):
    """Multi-head cross-attention from ``x`` to a context of another length and feature size.

    Queries come from ``x (..., T, d_model)``, keys and values from
    ``context (..., S, context_features)`` (the same batch dims).

    Options as :class:`SelfAttention` (no rotary embedding, cache or ``causal``; kind
    ``'softmax'`` or ``'linear'``); ``wk`` and ``wv`` map ``context_features -> K*D``.
    ``score_mod`` gets the core's positions, the same as mask predicates get: queries aligned at
    the end of the context (``q_pos = S - T + t``), keys at ``0..S-1``.

    Args:
      d_model: query input features.
      context_features: key/value input features.
      {options}
      kernel_init, bias_init: initialisers of the projections.
      rngs: ``nnx.Rngs`` for the parameters (``params``) and dropout (``dropout``).
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
        options = ModuleOptions.cross(
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
            score_mod=score_mod,
            sinks=sinks,
        )
        init = dict(kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
        super().__init__(d_model, context_features, options, cross=True, **init)

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
        check_context(x, self.d_model, context, self.kv_features, context_mask)
        call = CallArguments(
            mask=mask,
            context_mask=context_mask,
            deterministic=deterministic,
            return_weights=return_weights,
            sow_weights=sow_weights,
            decode=False,
            lengths=None,
            implementation=implementation,
            block_size=block_size,
        )
        return self._call(x, context, call, rngs)
