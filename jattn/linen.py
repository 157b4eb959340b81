"""Flax Linen attention modules: thin layers over :func:`jattn.attention`.

The same modules as :mod:`jattn.nnx` with the same option names and parameter names (``wq``,
``wk``, ``wv`` and, with an output projection, ``wo``, each an ``nn.Dense``; ``query_ln``,
``key_ln`` with ``normalize_qk``); given the same weights both return the same output. The call
itself is shared with NNX in ``jattn._modules.call``, and so are the options, declared and
documented once in ``jattn._modules.options`` (each class's docstring shows them).

Dropout draws from the ``'dropout'`` rng collection when not deterministic, or from a call-time
``dropout_rng``. The call's ``deterministic`` overrides the field of that name (default False);
Flax's ``MultiHeadDotProductAttention`` takes one or the other (both set raise there), and where
it takes a setting the two agree: the field alone, or the call's value with the field unset.
Decoding keeps the cache in the ``'cache'`` collection (Flax's convention)::

    cache = layer.init(key, batch_size, max_length, method="init_cache")["cache"]
    y, vars = layer.apply({"params": params, "cache": cache}, x, decode=True, mutable=["cache"])

Serving from a paged pool keeps ``k_pages`` and ``v_pages`` in the same collection::

    cache = layer.init(key, num_pages, page_size, method="init_paged_cache")["cache"]
    y, vars = layer.apply({"params": params, "cache": cache}, x, paged=batch, mutable=["cache"])

Weights are sown into ``'intermediates'`` under ``'attention_weights'`` with ``sow_weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import Array

from jattn._masks import Mask
from jattn._modules import (
    SELF_ATTENTION_ONLY,
    CallArguments,
    Layers,
    ModuleConfig,
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
from jattn._scalars import check_int
from jattn.score_mods import ScoreMod

__all__ = ["CrossAttention", "PagedBatch", "SelfAttention"]

SOW_NAME = "attention_weights"


class _Attention(nn.Module):
    """The fields, projections and call shared by the Linen modules (their options: the public classes)."""

    d_model: int
    num_heads: int = 1
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    out_proj: bool | None = None
    use_bias: bool = False
    kind: str = "softmax"
    feature_map: str | Callable[[Array], Array] = "elu"
    dropout_rate: float = 0.0
    deterministic: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: jax.lax.PrecisionLike = None
    sequence_axis: str | None = None
    implementation: str | None = None
    block_size: int | tuple[int, int] | None = None
    normalize_qk: bool = False
    score_mod: ScoreMod | None = None
    sinks: bool = False
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    def _config(self, kv_features: int, *, cross: bool = False) -> ModuleConfig:
        """The fields that are options, by their names in :class:`ModuleOptions` (a missing one raises), checked and resolved."""
        names = [f.name for f in dataclasses.fields(ModuleOptions) if not (cross and f.name in SELF_ATTENTION_ONLY)]
        values = {name: getattr(self, name) for name in names}
        options = ModuleOptions.cross(**values) if cross else ModuleOptions(**values)
        return configure(self.d_model, kv_features, options, cross=cross)

    def _dense(self, features: int, name: str) -> nn.Dense:
        """A projection ``(B, L, ·) -> (B, L, features)`` with the module's bias, dtypes, precision and initialisers."""
        return nn.Dense(
            features,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            name=name,
        )

    def _layers(self, o: ModuleConfig) -> Layers:
        """The projections, QK norms and sinks of a module configured as ``o`` (inside the compact call)."""

        def norm(name: str) -> nn.LayerNorm:  # Flax's QK norm: LayerNorm over D without bias, epsilon 1e-6
            return nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        kv = o.num_householder * o.num_kv_heads * o.head_depth  # DeltaProduct: n_h keys and values a token
        return Layers(
            self._dense(o.qkv_features, "wq"),
            self._dense(kv, "wk"),
            self._dense(kv, "wv"),
            self._dense(o.out_features, "wo") if o.out_proj else None,
            norm("query_ln") if o.normalize_qk else None,
            norm("key_ln") if o.normalize_qk else None,
            self.param("sinks", nn.initializers.zeros_init(), (o.num_heads,), self.param_dtype) if o.sinks else None,
            {name: self.param(name, init, shape, self.param_dtype) for name, (shape, init) in gate_params(o).items()}
            or None,
        )

    def _decoding_cache(self) -> dict[str, Array]:
        """The ``'cache'`` collection, which a decoding call needs."""
        cache = self.variables.get("cache")
        if not cache:
            raise ValueError(
                "decode=True needs a cache: variables from module.init(key, batch_size, max_length, "
                "method='init_cache')['cache']"
            )
        return dict(cache)

    def _run(
        self, x: Array, context: Array | None, o: ModuleConfig, call: CallArguments, dropout_rng: Array | None
    ) -> Array | tuple[Array, Array]:
        """The call of a module configured as ``o`` (checked before ``call``, so its errors come first)."""
        deterministic = self.deterministic if call.deterministic is None else call.deterministic  # the call's wins
        rng = None
        if o.dropout_rate > 0 and not deterministic:
            rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
        cache = self._decoding_cache() if call.decoding(o) else None
        out, weights, cache = forward(o, self._layers(o), x, context, call, cache=cache, dropout_rng=rng)
        if cache is not None:
            for name, value in cache.items():
                self.put_variable("cache", name, value)
        if call.sow_weights:
            self.sow("intermediates", SOW_NAME, weights)
        return (out, weights) if call.return_weights else out


@document_options("linen")
class SelfAttention(_Attention):
    """Multi-head self-attention over ``x (..., T, d_model)``, as :class:`jattn.nnx.SelfAttention`.

    A call's ``mask=None`` is bidirectional in a full pass (every token sees the later ones, as in
    Flax) and causal with ``decode=True``: a decoder passes ``masks.causal()`` on every call, or
    sets ``causal=True``.

    Attributes:
      d_model: input features.
      {options}
      kernel_init, bias_init: initialisers of the projections.
    """

    rope: bool = False
    rope_base: float = 10000.0
    decode: bool = False
    causal: bool = False
    num_householder: int | None = None

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array | Mask | None = None,
        deterministic: bool | None = None,
        return_weights: bool = False,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
        *,
        dropout_rng: Array | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        lengths: Array | None = None,
        paged: PagedBatch | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (..., T, d_model)`` to itself.

        Args: as :meth:`jattn.nnx.SelfAttention.__call__` (``paged``: the flat ragged tokens ``x (Q, d_model)``
        of a serving step on the pool of :meth:`init_paged_cache`, the ``'cache'`` collection passed mutable), and
          deterministic: overrides the ``deterministic`` field for this call (None: the field).
          dropout_rng: a key for dropout, instead of the ``'dropout'`` rng collection.
          sow_weights: sow the weights ``(..., N, T, S)`` into ``'intermediates'`` under
            ``'attention_weights'`` (read them with ``mutable=['intermediates']``).
          decode: continue the cached tokens (the ``'cache'`` collection from
            :meth:`init_cache`, passed mutable); None: the ``decode`` field.
        """
        check_int("d_model", self.d_model, min=1)  # the field first: x is checked against it
        check_input("x", x, self.d_model)
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
        if paged is not None:
            if return_weights or sow_weights or decode or lengths is not None or block_size is not None:
                raise ValueError("paged=... takes x, mask and implementation only (no weights, decode or lengths)")
            return self._paged(x, mask, paged, implementation)
        return self._run(x, None, self._config(self.d_model), call, dropout_rng)

    def _paged(self, x: Array, mask: Mask | None, batch: PagedBatch, implementation: str | None) -> Array:
        """A serving step of ``x (Q, d_model)`` on the pool in ``'cache'`` (``jattn._modules.paged``)."""
        o = self._config(self.d_model)
        layers = self._layers(o)  # the parameters first: module.init with paged=... creates them
        pool = dict(self.variables.get("cache") or {})
        if "k_pages" not in pool:
            raise ValueError(
                "paged=... needs a paged cache: variables from module.init(key, num_pages, page_size, "
                "method='init_paged_cache')['cache']"
            )
        out, pool = paged_forward(o, layers, x, pool, batch, mask, implementation)
        for name, value in pool.items():
            self.put_variable("cache", name, value)
        return out

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        window: int | None = None,
        pinned: tuple[int, ...] = (),
        dtype: Any = jnp.float32,
    ) -> None:
        """Creates the empty ``'cache'`` collection, as :meth:`jattn.nnx.SelfAttention.init_cache`.

        Run it as ``module.init(key, batch_size, max_length, window=..., method="init_cache")``.
        """
        cache = init_cache(self._config(self.d_model), batch_size, max_length, window, pinned, dtype)
        for name, value in cache.items():
            self.put_variable("cache", name, value)

    def init_paged_cache(self, num_pages: int, page_size: int, *, dtype: Any = jnp.float32) -> None:
        """Creates the paged pool in ``'cache'``, as :meth:`jattn.nnx.SelfAttention.init_paged_cache`.

        Run it as ``module.init(key, num_pages, page_size, method="init_paged_cache")``.
        """
        cache = init_paged_cache(self._config(self.d_model), num_pages, page_size, dtype)
        for name, value in cache.items():
            self.put_variable("cache", name, value)


@document_options("linen")
class CrossAttention(_Attention):
    """Cross-attention from ``x (..., T, d_model)`` to ``context (..., S, context_features)``.

    As :class:`jattn.nnx.CrossAttention` (kind ``'softmax'`` or ``'linear'``).

    Attributes:
      d_model: query input features.
      {options}
      kernel_init, bias_init: initialisers of the projections.
      context_features: key/value input features.
    """

    context_features: int = 0

    @nn.compact
    def __call__(
        self,
        x: Array,
        context: Array,
        mask: Array | Mask | None = None,
        context_mask: Array | None = None,
        deterministic: bool | None = None,
        return_weights: bool = False,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
        *,
        dropout_rng: Array | None = None,
        sow_weights: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x`` to ``context``; ``context_mask (..., S)`` is False at context padding.

        Other arguments as :meth:`SelfAttention.__call__`.
        """
        check_int("d_model", self.d_model, min=1)  # the fields first: x and context are checked against them
        check_int("context_features", self.context_features, min=1)
        check_context(x, self.d_model, context, self.context_features, context_mask)
        config = self._config(self.context_features, cross=True)
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
        return self._run(x, context, config, call, dropout_rng)
