"""Flax Linen attention modules: thin layers over :func:`jattn.attention`.

Parameter names match :mod:`jattn.nnx`: ``wq``, ``wk``, ``wv`` and (with an output
projection) ``wo``, each an ``nn.Dense`` holding ``kernel`` and, with ``use_bias``, ``bias``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import Array

from jattn import _heads

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Multi-head self-attention over ``x`` of shape ``(B, T, d_model)``.

    The same module as :class:`jattn.nnx.SelfAttention` (see there for every field); given the
    same weights both return the same output. Dropout draws from the ``'dropout'`` rng
    collection when not deterministic.
    """

    d_model: int
    num_heads: int = 1
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    out_proj: bool | None = None
    use_bias: bool = False
    dropout_rate: float = 0.0
    deterministic: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: jax.lax.PrecisionLike = None
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        deterministic: bool | None = None,
        return_weights: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (B, T, d_model)`` to itself; arguments as in :class:`jattn.nnx.SelfAttention`."""
        kv_heads, head_depth = _heads.check_heads(self.d_model, self.num_heads, self.num_kv_heads, self.qkv_features)
        _heads.check_input("x", x, self.d_model)
        out_proj = self.out_proj if self.out_proj is not None else self.num_heads > 1 or self.out_features is not None
        if self.out_features is not None and not out_proj:
            raise ValueError(f"out_features={self.out_features} needs out_proj=True")

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

        deterministic = self.deterministic if deterministic is None else deterministic
        use_dropout = self.dropout_rate > 0 and not deterministic
        out, weights = _heads.multihead(
            dense(self.num_heads * head_depth, "wq")(x),
            dense(kv_heads * head_depth, "wk")(x),
            dense(kv_heads * head_depth, "wv")(x),
            num_heads=self.num_heads,
            num_kv_heads=kv_heads,
            mask=mask,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if use_dropout else None,
            precision=self.precision,
            return_weights=return_weights,
        )
        if out_proj:
            out = dense(self.out_features or self.d_model, "wo")(out)
        return (out, weights) if return_weights else out
