"""The gates of the modules' recurrent kinds: their parameters and how they are computed from the input.

Shared by :mod:`jattn.nnx` and :mod:`jattn.linen` (each stores the parameters its own way); the kinds
run :func:`jattn.gated_linear_attention` over the heads. What each kind computes from ``x (B, T, F)``
(N heads of depth D; the papers' choices, named after them):

- ``'retention'`` (RetNet): a fixed decay per head, ``g_n = log(1 - 2^(-5 - n))``; no parameters.
- ``'ssd'`` (Mamba-2's SSD form): a decay per step and head, ``g = -exp(a_log) · softplus(x w_dt + dt_bias)``
  (``a_log (N,)`` from log U[1, 16], ``dt_bias (N,)`` so that softplus(dt_bias) is log-uniform in
  [0.001, 0.1], ``w_dt (F, N)``).
- ``'gla'`` (gated linear attention): a decay per step and key feature through a rank-16 map,
  ``gk = log sigmoid(x w_gk_down w_gk_up + b_gk) / 16`` (``w_gk_down (F, 16)``, ``w_gk_up (16, N·D)``).
- ``'deltanet'``: the delta rule's ``beta = sigmoid(x w_beta)`` (``w_beta (F, N)``), no decay.
- ``'gated_deltanet'``: ``beta`` as DeltaNet and ``g`` as SSD.
- ``'kda'`` (Kimi Delta Attention, Kimi Linear): ``beta`` as DeltaNet and a decay per step, head and key
  feature as Kimi Linear's (flash-linear-attention's ``KimiDeltaAttention``), SSD's form through a rank-D
  map: ``gk = -exp(a_log) · softplus(x w_gk_down w_gk_up + dt_bias)`` (``a_log (N,)`` per head from
  log U[1, 16], ``w_gk_down (F, D)``, ``w_gk_up (D, N·D)``, ``dt_bias (N·D,)`` as SSD's, per head and
  feature). Simplified from the paper's layer: no short convolution (as every kind here), no output gate
  and RMS norm before ``wo``, no lower bound on the decay.

The delta kinds take q and k through SiLU and an L2 norm over D (DeltaNet's choice, which keeps the
delta rule stable); the others take them as projected. No kind has the short causal convolution some
papers put before q, k and v: decoding then needs no convolution cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._online import compute_dtype

__all__ = ["DELTA_KINDS", "RECURRENT_KINDS", "gate_params", "gates", "qk_features"]

RECURRENT_KINDS = ("retention", "ssd", "gla", "deltanet", "gated_deltanet", "kda")
DELTA_KINDS = ("deltanet", "gated_deltanet", "kda")
GLA_RANK, GLA_TEMPERATURE = 16, 16.0

Init = Callable[[Array, tuple[int, ...], jnp.dtype], Array]


def _uniform_log(low: float, high: float) -> Init:
    """Initialises ``log U[low, high]``."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, low, high))


def _dt_bias(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:
    """Mamba-2's ``dt_bias``: softplus of it log-uniform in [0.001, 0.1] (the inverse softplus of such a dt)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, np.log(1e-3), np.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


def gate_params(kind: str, features: int, heads: int, depth: int) -> dict[str, tuple[tuple[int, ...], Init]]:
    """The gate parameters of ``kind`` for input ``features`` F, N = ``heads``, D = ``depth``: name -> (shape, init)."""
    dense = jax.nn.initializers.lecun_normal()
    params: dict[str, tuple[tuple[int, ...], Init]] = {}
    if kind in ("ssd", "gated_deltanet"):
        params |= {"a_log": ((heads,), _uniform_log(1.0, 16.0)), "w_dt": ((features, heads), dense)}
        params["dt_bias"] = ((heads,), _dt_bias)
    if kind == "gla":
        params |= {"w_gk_down": ((features, GLA_RANK), dense), "w_gk_up": ((GLA_RANK, heads * depth), dense)}
        params["b_gk"] = ((heads * depth,), jax.nn.initializers.zeros)
    if kind == "kda":
        params |= {"a_log": ((heads,), _uniform_log(1.0, 16.0)), "w_gk_down": ((features, depth), dense)}
        params |= {"w_gk_up": ((depth, heads * depth), dense), "dt_bias": ((heads * depth,), _dt_bias)}
    if kind in DELTA_KINDS:
        params["w_beta"] = ((features, heads), dense)
    return params


def gates(kind: str, params: dict[str, Array], x: Array, heads: int, depth: int, dtype: Any = None) -> dict[str, Array]:
    """``g``, ``gk`` and ``beta`` of ``kind`` for ``x (B, T, F)`` in the heads layout ``(B, N, 1, T[, D])``.

    Computed in the module's compute dtype (:func:`jattn._online.compute_dtype` of its ``dtype``, or without one
    of x's and the parameters' promoted dtype, as its projections infer theirs): float64 in a float64 module,
    else float32.
    """
    compute = compute_dtype(functools.reduce(jnp.promote_types, [p.dtype for p in params.values()], x.dtype))
    compute = compute if dtype is None else compute_dtype(jnp.dtype(dtype))
    x = x.astype(compute)
    b, t = x.shape[:2]

    def per_head(y: Array) -> Array:  # (B, T, N) -> (B, N, 1, T)
        return y.transpose(0, 2, 1)[:, :, None, :]

    def param(name: str) -> Array:  # a bias or per-head parameter, broadcast over (B, T) explicitly
        y = params[name].astype(compute)
        return y if y.ndim == 2 else y[None, None]

    out: dict[str, Array] = {}
    if kind == "retention":
        out["g"] = jnp.log1p(-(2.0 ** -(5.0 + jnp.arange(heads, dtype=compute))))[None, :, None, None]
    if kind in ("ssd", "gated_deltanet"):
        dt = jax.nn.softplus(x @ param("w_dt") + param("dt_bias"))
        out["g"] = per_head(-jnp.exp(param("a_log")) * dt)
    if kind == "gla":
        gk = (
            jax.nn.log_sigmoid(x @ param("w_gk_down") @ param("w_gk_up") + param("b_gk")) / GLA_TEMPERATURE
        )  # (B, T, N*D)
        out["gk"] = gk.reshape(b, t, heads, depth).transpose(0, 2, 1, 3)[:, :, None]
    if kind == "kda":
        rate = jnp.repeat(jnp.exp(params["a_log"].astype(compute)), depth)[None, None]  # (1, 1, N*D)
        gk = -rate * jax.nn.softplus(x @ param("w_gk_down") @ param("w_gk_up") + param("dt_bias"))  # (B, T, N*D)
        out["gk"] = gk.reshape(b, t, heads, depth).transpose(0, 2, 1, 3)[:, :, None]
    if kind in DELTA_KINDS:
        out["beta"] = per_head(jax.nn.sigmoid(x @ param("w_beta")))
    return out


def qk_features(kind: str, x: Array) -> Array:
    """The q or k ``(..., D)`` a kind reads: SiLU then an L2 norm over D for the delta kinds, else as is.

    Computed in x's compute dtype (:func:`jattn._online.compute_dtype`: float64 for float64, else float32).
    """
    if kind not in DELTA_KINDS:
        return x
    y = jax.nn.silu(x.astype(compute_dtype(x.dtype)))
    return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
