"""Flax NNX attention modules: thin layers over :func:`jattn.attention`.

Parameters (the article's names): ``wq``, ``wk``, ``wv`` (``nnx.Linear`` d_model -> qkv
features; ``wk``/``wv`` produce ``num_kv_heads`` heads) and, when there is an output projection,
``wo`` (qkv features -> out features). Each holds ``kernel`` and, with ``use_bias``, ``bias``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from jattn import _heads

__all__ = ["SelfAttention"]

_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()


class SelfAttention(nnx.Module):
    """Multi-head self-attention over ``x`` of shape ``(B, T, d_model)``.

    The default construction is the article's module: three bias-free linear maps
    ``d_model -> d_model`` (``wq``, ``wk``, ``wv``), one head, scale ``1/sqrt(d_model)`` and
    output ``(B, T, d_model)`` without an output projection.

    Args:
      d_model: input features.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (default N); N/K query heads share one kv head
        (grouped-query attention; K=1 is multi-query).
      qkv_features: total query/key/value features N*D (default d_model).
      out_features: output features; setting it implies an output projection.
      out_proj: add the output projection ``wo``; default True when ``num_heads > 1`` or
        ``out_features`` is set. Without it the output has qkv_features features.
      use_bias: biases on the projections.
      dropout_rate: dropout on the attention weights.
      deterministic: default for the call-time switch; dropout is off when True.
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: parameter dtype.
      precision: matmul precision for projections and attention.
      kernel_init, bias_init: initialisers of the projections.
      rngs: ``nnx.Rngs`` for the parameters (``params``) and dropout (``dropout``).
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
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        kernel_init: nnx.Initializer = _KERNEL_INIT,
        bias_init: nnx.Initializer = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        self.num_kv_heads, head_depth = _heads.check_heads(d_model, num_heads, num_kv_heads, qkv_features)
        self.d_model, self.num_heads = d_model, num_heads
        self.dropout_rate, self.deterministic, self.precision = dropout_rate, deterministic, precision
        features = num_heads * head_depth
        kv_features = self.num_kv_heads * head_depth
        if out_proj is None:
            out_proj = num_heads > 1 or out_features is not None
        if out_features is not None and not out_proj:
            raise ValueError(f"out_features={out_features} needs out_proj=True")

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

        self.wq = linear(d_model, features)
        self.wk = linear(d_model, kv_features)
        self.wv = linear(d_model, kv_features)
        self.wo = linear(features, out_features or d_model) if out_proj else None
        self.dropout_rngs = rngs.dropout.fork() if dropout_rate > 0 else None

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (B, T, d_model)`` to itself.

        Args:
          x: ``(B, T, d_model)`` inputs.
          mask: boolean, True = attend, broadcastable to ``(B, N, T, T)``.
          deterministic: overrides the constructor's switch; dropout is off when True.
          rngs: overrides the constructor's dropout stream.
          return_weights: also return the attention weights ``(B, N, T, T)`` (before dropout).

        Returns:
          ``(B, T, F)`` with F the out features (or qkv features without ``wo``), and the
          weights when ``return_weights``.
        """
        _heads.check_input("x", x, self.d_model)
        deterministic = self.deterministic if deterministic is None else deterministic
        rng = None
        if self.dropout_rate > 0 and not deterministic:
            stream = rngs.dropout if rngs is not None else self.dropout_rngs
            rng = stream()
        out, weights = _heads.multihead(
            self.wq(x),
            self.wk(x),
            self.wv(x),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            mask=mask,
            dropout_rate=self.dropout_rate if rng is not None else 0.0,
            dropout_rng=rng,
            precision=self.precision,
            return_weights=return_weights,
        )
        if self.wo is not None:
            out = self.wo(out)
        return (out, weights) if return_weights else out
