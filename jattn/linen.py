"""Flax Linen attention modules: thin layers over :func:`jattn.attention`.

The same modules as :mod:`jattn.nnx` (see there for every option) with the same option names and
parameter names (``wq``, ``wk``, ``wv`` and, with an output projection, ``wo``, each an
``nn.Dense``; ``query_ln``, ``key_ln`` with ``normalize_qk``); given the same weights both return
the same output. The call itself is shared with NNX in ``jattn._heads``.

Dropout draws from the ``'dropout'`` rng collection when not deterministic, or from a call-time
``dropout_rng``. The call's ``deterministic`` overrides the field of that name (default False);
Flax's ``MultiHeadDotProductAttention`` takes one or the other (both set raise there), and where
it takes a setting the two agree: the field alone, or the call's value with the field unset. Decoding keeps the cache in the ``'cache'`` collection (Flax's convention)::

    cache = layer.init(key, batch_size, max_length, method="init_cache")["cache"]
    y, vars = layer.apply({"params": params, "cache": cache}, x, decode=True, mutable=["cache"])

Weights are sown into ``'intermediates'`` under ``'attention_weights'`` with ``sow_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import Array

from jattn import _heads
from jattn._checks import check_int
from jattn._masks import Mask
from jattn._score_mods import ScoreMod

__all__ = ["CrossAttention", "SelfAttention"]

SOW_NAME = "attention_weights"


class _Attention(nn.Module):
    """Options: as :class:`jattn.nnx.SelfAttention` (the same names, types and defaults).

    Attributes:
      d_model, num_heads, num_kv_heads, qkv_features, out_features, out_proj, use_bias, kind,
      feature_map, dropout_rate, deterministic, dtype, param_dtype, precision, sequence_axis,
      implementation, block_size, normalize_qk, score_mod, sinks, kernel_init, bias_init: see
      :class:`jattn.nnx.SelfAttention` (with ``sinks`` the parameter ``sinks (N,)``).
    """

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

    def _options(self, kv_features: int) -> _heads.Options:
        return _heads.options(
            self.d_model,
            kv_features,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            qkv_features=self.qkv_features,
            out_features=self.out_features,
            out_proj=self.out_proj,
            use_bias=self.use_bias,
            kind=self.kind,
            feature_map=self.feature_map,
            dropout_rate=self.dropout_rate,
            deterministic=self.deterministic,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            sequence_axis=self.sequence_axis,
            implementation=self.implementation,
            block_size=self.block_size,
            normalize_qk=self.normalize_qk,
            rope=getattr(self, "rope", False),
            rope_base=getattr(self, "rope_base", 10000.0),
            decode=getattr(self, "decode", False),
            score_mod=self.score_mod,
            sinks=self.sinks,
        )

    def _run(
        self,
        x: Array,
        context: Array | None,
        mask: Array | Mask | None,
        *,
        kv_features: int,
        context_mask: Array | None = None,
        deterministic: bool | None,
        dropout_rng: Array | None,
        return_weights: bool,
        sow_weights: bool,
        decode: bool | None = False,
        lengths: Array | None = None,
        implementation: str | None,
        block_size: int | tuple[int, int] | None,
    ) -> Array | tuple[Array, Array]:
        o = self._options(kv_features)
        _heads.check_call(deterministic, return_weights, decode, sow_weights)
        decode = o.decode if decode is None else decode
        deterministic = self.deterministic if deterministic is None else deterministic  # the call's value wins
        rng = None
        if o.dropout_rate > 0 and not deterministic:
            rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
        cache = None
        if decode:
            cache = self.variables.get("cache")
            if not cache:
                raise ValueError(
                    "decode=True needs a cache: variables from module.init(key, batch_size, max_length, "
                    "method='init_cache')['cache']"
                )
            cache = dict(cache)

        def dense(features: int, name: str) -> nn.Dense:
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

        def norm(name: str) -> nn.LayerNorm:  # Flax's QK norm: LayerNorm over D without bias, epsilon 1e-6
            return nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        kv = o.num_kv_heads * o.head_depth
        layers = _heads.Layers(
            dense(o.num_heads * o.head_depth, "wq"),
            dense(kv, "wk"),
            dense(kv, "wv"),
            dense(o.out_features, "wo") if o.out_features is not None else None,
            norm("query_ln") if o.normalize_qk else None,
            norm("key_ln") if o.normalize_qk else None,
            self.param("sinks", nn.initializers.zeros_init(), (o.num_heads,), self.param_dtype) if o.sinks else None,
        )
        out, weights, cache = _heads.forward(
            o,
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
                self.put_variable("cache", name, value)
        if sow_weights:
            self.sow("intermediates", SOW_NAME, weights)
        return (out, weights) if return_weights else out


class SelfAttention(_Attention):
    """Multi-head self-attention over ``x (..., T, d_model)``; see :class:`jattn.nnx.SelfAttention`.

    Attributes:
      rope, rope_base: rotary position embeddings, as :class:`jattn.nnx.SelfAttention`.
      decode: default for the call-time ``decode`` (Flax's field of that name).
    """

    rope: bool = False
    rope_base: float = 10000.0
    decode: bool = False

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
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (..., T, d_model)`` to itself.

        Args: as :meth:`jattn.nnx.SelfAttention.__call__`, and
          deterministic: overrides the ``deterministic`` field for this call (None: the field).
          dropout_rng: a key for dropout, instead of the ``'dropout'`` rng collection.
          sow_weights: sow the weights ``(..., N, T, S)`` into ``'intermediates'`` under
            ``'attention_weights'`` (read them with ``mutable=['intermediates']``).
          decode: continue the cached tokens (the ``'cache'`` collection from
            :meth:`init_cache`, passed mutable); None: the ``decode`` field.
        """
        check_int("d_model", self.d_model, min=1)  # the field first: x is checked against it
        _heads.check_input("x", x, self.d_model)
        return self._run(
            x,
            None,
            mask,
            kv_features=self.d_model,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
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
        """Creates the empty ``'cache'`` collection, as :meth:`jattn.nnx.SelfAttention.init_cache`.

        Run it as ``module.init(key, batch_size, max_length, window=..., method="init_cache")``.
        """
        cache = _heads.init_cache(self._options(self.d_model), batch_size, max_length, window, pinned, dtype)
        for name, value in cache.items():
            self.put_variable("cache", name, value)


class CrossAttention(_Attention):
    """Cross-attention from ``x (..., T, d_model)`` to ``context (..., S, context_features)``.

    See :class:`jattn.nnx.CrossAttention`.
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
        _heads.check_context(x, self.d_model, context, self.context_features, context_mask)
        return self._run(
            x,
            context,
            mask,
            kv_features=self.context_features,
            context_mask=context_mask,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            sow_weights=sow_weights,
            implementation=implementation,
            block_size=block_size,
        )
