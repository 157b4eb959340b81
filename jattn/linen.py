"""Flax Linen attention modules: thin layers over :func:`jattn.attention`.

The same modules as :mod:`jattn.nnx` (see there for every option) with the same parameter names
(``wq``, ``wk``, ``wv`` and, with an output projection, ``wo``; each an ``nn.Dense``); given the
same weights both return the same output. Dropout draws from the ``'dropout'`` rng collection
when not deterministic. Decoding with a cache is in the NNX modules.
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

__all__ = ["CrossAttention", "SelfAttention"]


class _Attention(nn.Module):
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
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    def _dense(self, features: int, name: str) -> nn.Dense:
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

    def _run(
        self,
        x: Array,
        context: Array,
        mask: Array | Mask | None,
        context_mask: Array | None,
        deterministic: bool | None,
        return_weights: bool,
        path: tuple[str | None, int | tuple[int, int] | None] = (None, None),
    ) -> Array | tuple[Array, Array]:
        implementation = self.implementation if path[0] is None else path[0]
        block_size = self.block_size if path[1] is None else path[1]
        _heads.check_path(implementation, block_size)
        kv_heads, depth = _heads.check_heads(self.d_model, self.num_heads, self.num_kv_heads, self.qkv_features)
        _heads.check_kind(self.kind, self.feature_map)
        _heads.check_options(
            kv_features=context.shape[-1],
            out_features=self.out_features,
            out_proj=self.out_proj,
            use_bias=self.use_bias,
            dropout_rate=self.dropout_rate,
            deterministic=self.deterministic,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            sequence_axis=self.sequence_axis,
        )
        _heads.check_call(deterministic, return_weights)
        out_proj = self.out_proj if self.out_proj is not None else self.num_heads > 1 or self.out_features is not None
        if self.out_features is not None and not out_proj:
            raise ValueError(f"out_features={self.out_features} needs out_proj=True")
        deterministic = self.deterministic if deterministic is None else deterministic
        use_dropout = self.dropout_rate > 0 and not deterministic
        out, weights, _ = _heads.multihead(
            self._dense(self.num_heads * depth, "wq")(x),
            self._dense(kv_heads * depth, "wk")(context),
            self._dense(kv_heads * depth, "wv")(context),
            num_heads=self.num_heads,
            num_kv_heads=kv_heads,
            mask=mask,
            kv_mask=context_mask,
            kind=self.kind,
            feature_map=self.feature_map,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if use_dropout else None,
            precision=self.precision,
            return_weights=return_weights,
            sequence_axis=self.sequence_axis,
            implementation=implementation,
            block_size=block_size,
        )
        if out_proj:
            out = self._dense(self.out_features or self.d_model, "wo")(out)
        return (out, weights) if return_weights else out


class SelfAttention(_Attention):
    """Multi-head self-attention over ``x (B, T, d_model)``; see :class:`jattn.nnx.SelfAttention`."""

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array | Mask | None = None,
        deterministic: bool | None = None,
        return_weights: bool = False,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (B, T, d_model)`` to itself.

        ``mask``: boolean ``(T, T)``, ``(B, T, T)`` (per example, the same for every head) or
        ``(B, N, T, T)`` (any axis may be 1), or a Mask. ``implementation`` and ``block_size``
        override the module's fields (None: keep them).
        """
        _heads.check_input("x", x, self.d_model)
        return self._run(x, x, mask, None, deterministic, return_weights, (implementation, block_size))


class CrossAttention(_Attention):
    """Cross-attention from ``x (B, T, d_model)`` to ``context (B, S, context_features)``.

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
    ) -> Array | tuple[Array, Array]:
        """Attends ``x`` to ``context``; ``context_mask (B, S)`` is False at context padding.

        ``implementation`` and ``block_size`` override the module's fields (None: keep them).
        """
        check_int("context_features", self.context_features, min=1)
        _heads.check_context(x, self.d_model, context, self.context_features, context_mask)
        path = (implementation, block_size)
        return self._run(x, context, mask, context_mask, deterministic, return_weights, path)
