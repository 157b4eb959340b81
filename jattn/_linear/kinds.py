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
- ``'deltaproduct'`` (DeltaProduct, Siems et al. 2025) and ``'gated_deltaproduct'`` (with ``g`` as SSD): ``n_h``
  delta steps a token (the module option ``num_householder``, default 2): k and v projected to ``n_h·N·D``
  features, ``beta = sigmoid(x w_beta)`` with ``w_beta (F, n_h·N)``, laid out as flash-linear-attention's
  (``(n h d)`` and ``(n h)``: sub-step outermost). ``beta`` stays in [0, 1]: flash-linear-attention's default
  ``allow_neg_eigval`` (``2·sigmoid``, Householder eigenvalues down to -1) is not offered, as
  :func:`jattn.gated_linear_attention` checks ``beta`` in [0, 1].
- ``'log_ssd'``, ``'log_gated_deltanet'``: log-linear attention (:func:`jattn.log_linear_attention`) over SSD
  and Gated DeltaNet, their gates as those kinds', with the level weights of the paper's Mamba-2 model
  (its ``lambda_mode='positive'``): ``λ = softplus(level_scale ⊙ (x w_level))`` per head and level
  (``w_level (F, N·LOG_LEVELS)``, ``level_scale (N, LOG_LEVELS)`` initialised to ones), for positions below
  ``2^(LOG_LEVELS - 1)``.
- ``'rwkv7'`` (RWKV-7 "Goose"'s attention core, the diagonal-plus-low-rank transition of
  :func:`jattn.gated_linear_attention`'s ``a``, ``b``): a decay per step and key feature through a tanh LoRA,
  ``gk = -exp(-1/2) · sigmoid(tanh(x w_decay_down) w_decay_up + b_decay)`` (RWKV-7's ``w = exp(-e^{-1/2}
  sigmoid(·))``, so ``gk`` in (-0.607, 0); ``b_decay`` from -5.5 to 0.5 over each head's features); the in-context
  learning rate ``α = sigmoid(x w_iclr_down w_iclr_up + b_iclr)`` per key feature; the removal key
  ``κ̂ = L2-normalise(k ⊙ k_k)`` over D (``k_k (N·D,)``, 0.85 at first); the key written
  ``k ⊙ (1 + (α - 1) ⊙ k_a)`` (``k_a``, 1 at first: the written key is ``α ⊙ k``); the transition
  ``a = -κ̂``, ``b = κ̂ ⊙ α`` (``diag(w) - (α ⊙ κ̂) κ̂ᵀ``). LoRA ranks 16. Kept out (the rest of RWKV-7's
  time mixing): the token shift (each projection's lerp with the previous token: it would need the last token
  in the decoding cache), the value residual from the first layer (``v_first``), the output gate, the bonus
  ``(r · (k ⊙ r_k)) v`` and the per-head group norm; q (RWKV's ``r``) is scaled by ``1/sqrt(D)`` (RWKV-7 by 1,
  before its group norm).
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

from jattn._arrays import compute_dtype

__all__ = [
    "DELTAPRODUCT_KINDS",
    "DELTA_KINDS",
    "LOG_KINDS",
    "LOG_LEVELS",
    "RECURRENT_KINDS",
    "gate_params",
    "gates",
    "head_inputs",
    "qk_features",
]

DELTAPRODUCT_KINDS = ("deltaproduct", "gated_deltaproduct")
LOG_KINDS = ("log_ssd", "log_gated_deltanet")  # log-linear attention over SSD and Gated DeltaNet
RECURRENT_KINDS = (
    "retention",
    "ssd",
    "gla",
    "deltanet",
    "gated_deltanet",
    "kda",
    "rwkv7",
    *DELTAPRODUCT_KINDS,
    *LOG_KINDS,
)
DELTA_KINDS = ("deltanet", "gated_deltanet", "kda", *DELTAPRODUCT_KINDS, "log_gated_deltanet")
SSD_KINDS = ("ssd", "gated_deltanet", "gated_deltaproduct", *LOG_KINDS)  # Mamba-2's decay per step and head
LOG_LEVELS = 20  # the log kinds' levels: positions below 2^19
GLA_RANK, GLA_TEMPERATURE = 16, 16.0
RWKV7_RANK, RWKV7_DECAY = 16, float(np.exp(-0.5))  # LoRA rank; the largest log decay -e^(-1/2)

Init = Callable[[Array, tuple[int, ...], jnp.dtype], Array]


def _uniform_log(low: float, high: float) -> Init:
    """Initialises ``log U[low, high]``."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, low, high))


def _dt_bias(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:
    """Mamba-2's ``dt_bias``: softplus of it log-uniform in [0.001, 0.1] (the inverse softplus of such a dt)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, np.log(1e-3), np.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


def gate_params(
    kind: str, features: int, heads: int, depth: int, householder: int = 1
) -> dict[str, tuple[tuple[int, ...], Init]]:
    """The gate parameters of ``kind`` for input ``features`` F, N = ``heads``, D = ``depth``: name -> (shape, init).

    ``householder``: the DeltaProduct kinds' ``n_h`` (a beta per sub-step and head).
    """
    dense = jax.nn.initializers.lecun_normal()
    params: dict[str, tuple[tuple[int, ...], Init]] = {}
    if kind in SSD_KINDS:
        params |= {"a_log": ((heads,), _uniform_log(1.0, 16.0)), "w_dt": ((features, heads), dense)}
        params["dt_bias"] = ((heads,), _dt_bias)
    if kind == "gla":
        params |= {"w_gk_down": ((features, GLA_RANK), dense), "w_gk_up": ((GLA_RANK, heads * depth), dense)}
        params["b_gk"] = ((heads * depth,), jax.nn.initializers.zeros)
    if kind == "kda":
        params |= {"a_log": ((heads,), _uniform_log(1.0, 16.0)), "w_gk_down": ((features, depth), dense)}
        params |= {"w_gk_up": ((depth, heads * depth), dense), "dt_bias": ((heads * depth,), _dt_bias)}
    if kind in DELTA_KINDS:
        params["w_beta"] = ((features, householder * heads), dense)
    if kind in LOG_KINDS:
        params["w_level"] = ((features, heads * LOG_LEVELS), dense)
        params["level_scale"] = ((heads, LOG_LEVELS), jax.nn.initializers.ones)
    if kind == "rwkv7":
        params |= _rwkv7_params(features, heads, depth)
    return params


def _rwkv7_params(features: int, heads: int, depth: int) -> dict[str, tuple[tuple[int, ...], Init]]:
    """RWKV-7's decay and in-context learning rate LoRAs and its ``k_k``, ``k_a`` (module docstring)."""
    dense, width = jax.nn.initializers.lecun_normal(), heads * depth
    small = jax.nn.initializers.variance_scaling(0.1, "fan_in", "normal")

    def constant(value: float) -> Init:
        return lambda key, shape, dtype: jnp.full(shape, value, dtype)

    def spread(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:  # -5.5 .. 0.5 over each head's D
        return jnp.tile(jnp.linspace(-5.5, 0.5, depth, dtype=dtype), heads)

    return {
        "w_decay_down": ((features, RWKV7_RANK), dense),
        "w_decay_up": ((RWKV7_RANK, width), small),
        "b_decay": ((width,), spread),
        "w_iclr_down": ((features, RWKV7_RANK), dense),
        "w_iclr_up": ((RWKV7_RANK, width), small),
        "b_iclr": ((width,), jax.nn.initializers.zeros),
        "k_k": ((width,), constant(0.85)),
        "k_a": ((width,), constant(1.0)),
    }


def gates(kind: str, params: dict[str, Array], x: Array, heads: int, depth: int, dtype: Any = None) -> dict[str, Array]:
    """``g``, ``gk``, ``beta`` and ``level_weights`` of ``kind`` for ``x (B, T, F)`` in the heads layout ``(B, N, 1, T[, D])``.

    ``level_weights`` (the log kinds): ``(B, N, 1, T, LOG_LEVELS)``.

    The DeltaProduct kinds' ``beta`` is per sub-step, ``(B, N, 1, T·n_h)`` (token t's j-th at ``t·n_h + j``).

    Computed in the module's compute dtype (:func:`jattn._arrays.compute_dtype` of its ``dtype``, or without one
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
    if kind in SSD_KINDS:
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
        n = params["w_beta"].shape[-1] // heads  # DeltaProduct's n_h sub-steps a token ((n h): sub-step outermost)
        beta = jax.nn.sigmoid(x @ param("w_beta")).reshape(b, t, n, heads)
        out["beta"] = beta.transpose(0, 3, 1, 2).reshape(b, heads, 1, t * n)  # (B, N, 1, T·n_h)
    if kind in LOG_KINDS:
        levels = (x @ param("w_level")).reshape(b, t, heads, LOG_LEVELS) * params["level_scale"].astype(compute)[
            None, None
        ]
        out["level_weights"] = jax.nn.softplus(levels).transpose(0, 2, 1, 3)[:, :, None]  # (B, N, 1, T, L)
    if kind == "rwkv7":

        def features(y: Array) -> Array:  # (B, T, N*D) -> (B, N, 1, T, D)
            return y.reshape(*y.shape[:2], heads, depth).transpose(0, 2, 1, 3)[:, :, None]

        lora = jnp.tanh(x @ param("w_decay_down")) @ param("w_decay_up") + param("b_decay")
        out["gk"] = features(-RWKV7_DECAY * jax.nn.sigmoid(lora))
        out["iclr"] = features(jax.nn.sigmoid(x @ param("w_iclr_down") @ param("w_iclr_up") + param("b_iclr")))
        out |= {n: params[n].astype(compute).reshape(1, heads, 1, 1, depth) for n in ("k_k", "k_a")}
    return out


def head_inputs(kind: str, q: Array, k: Array, gates: dict[str, Array]) -> tuple[Array, Array, dict[str, Array]]:
    """The q, k ``(..., T, D)`` and keyword arguments a kind passes :func:`jattn.gated_linear_attention`.

    From the projected q, k and :func:`gates`: :func:`qk_features` and the gates as they are, or for ``'rwkv7'``
    the written key and the transition ``a``, ``b`` (module docstring), in the gates' compute dtype.
    """
    if kind != "rwkv7":
        return qk_features(kind, q), qk_features(kind, k), gates
    rate, k_k, k_a = gates["iclr"], gates["k_k"], gates["k_a"]
    removal = k.astype(rate.dtype) * k_k
    removal = removal * jax.lax.rsqrt(jnp.sum(removal * removal, axis=-1, keepdims=True) + 1e-12)
    written = (k.astype(rate.dtype) * (1.0 + (rate - 1.0) * k_a)).astype(k.dtype)
    return q, written, {"gk": gates["gk"], "a": -removal, "b": removal * rate}


def qk_features(kind: str, x: Array) -> Array:
    """The q or k ``(..., D)`` a kind reads: SiLU then an L2 norm over D for the delta kinds, else as is.

    Computed in x's compute dtype (:func:`jattn._arrays.compute_dtype`: float64 for float64, else float32).
    """
    if kind not in DELTA_KINDS:
        return x
    y = jax.nn.silu(x.astype(compute_dtype(x.dtype)))
    return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
