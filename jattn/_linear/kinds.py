"""The modules' recurrent kinds, one record each: their gates (parameters and what they compute), how they run.

A :class:`RecurrentKind` holds all a kind is: its :class:`Gate` s (each its parameters with their initialisers and
what it computes from the input), whether q and k take the delta rule's feature map, whether it runs DeltaProduct's
sub-steps or log-linear attention's level states, and any map of its own from q, k and the gates to the call
(RWKV-7's). :data:`RECURRENT` maps each name to its record; :func:`register_kind` adds one (the module kinds of
:mod:`jattn._modules.kinds` read them, so a registered kind is a ``kind=`` of :class:`jattn.nnx.SelfAttention` and
:class:`jattn.linen.SelfAttention` at once). Shared by :mod:`jattn.nnx` and :mod:`jattn.linen` (each stores the
parameters its own way); the kinds run :func:`jattn.gated_linear_attention` (or :func:`jattn.log_linear_attention`)
over the heads. What each kind computes from ``x (B, T, F)`` (N heads of depth D; the papers' choices, named after
them):

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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._arrays import compute_dtype
from jattn._linear.gated import gated_linear_attention
from jattn._linear.log_linear.attention import log_linear_attention
from jattn._linear.log_linear.levels import levels_needed

__all__ = ["LOG_LEVELS", "RECURRENT", "RECURRENT_KINDS", "Gate", "RecurrentKind", "register_kind"]

LOG_LEVELS = 20  # the log kinds' levels: positions below 2^19
GLA_RANK, GLA_TEMPERATURE = 16, 16.0
RWKV7_RANK, RWKV7_DECAY = 16, float(np.exp(-0.5))  # LoRA rank; the largest log decay -e^(-1/2)

Init = Callable[[Array, tuple[int, ...], jnp.dtype], Array]
Params = dict[str, tuple[tuple[int, ...], Init]]
Param = Callable[[str], Array]  # a parameter by name, in the compute dtype; a bias or per-head vector as (1, 1, X)


@dataclasses.dataclass(frozen=True)
class Gate:
    """One gate of a recurrent kind: its parameters and what it computes from ``x (B, T, F)``.

    ``params(F, N, D, n_h)`` gives each parameter's ``(shape, init)``; ``compute(param, x, N, D)`` the gates, keyword
    arguments of :func:`jattn.gated_linear_attention` (or :func:`jattn.log_linear_attention`) in the heads layout
    ``(B, N, 1, T[, D])`` (``param(name)`` reads a parameter in x's compute dtype).
    """

    params: Callable[[int, int, int, int], Params]
    compute: Callable[[Param, Array, int, int], dict[str, Array]]


@dataclasses.dataclass(frozen=True)
class RecurrentKind:
    """A module kind that runs a recurrence over the heads: its gates and how it calls the core.

    ``delta``: q and k through SiLU and an L2 norm over D (the delta rule's; the others take them as projected).
    ``householder``: DeltaProduct's sub-steps (the module option ``num_householder``, default 2, k and v projected
    to ``n_h·N·D``). ``levels``: :func:`jattn.log_linear_attention`'s level states (:data:`LOG_LEVELS` of them).
    ``inputs(q, k, gates) -> (q, k, keyword arguments)``: the kind's own map to the call where the gates are not
    its keyword arguments as they are (RWKV-7's transition); None: the feature map above and the gates as they are.
    """

    name: str
    gates: tuple[Gate, ...] = ()
    delta: bool = False
    householder: bool = False
    levels: bool = False
    inputs: Callable[[Array, Array, dict[str, Array]], tuple[Array, Array, dict[str, Array]]] | None = None

    def params(self, features: int, heads: int, depth: int, householder: int = 1) -> Params:
        """The gate parameters for input ``features`` F, N = ``heads``, D = ``depth``: name -> (shape, init).

        ``householder``: the DeltaProduct kinds' ``n_h`` (a beta per sub-step and head).
        """
        params: Params = {}
        for gate in self.gates:
            params |= gate.params(features, heads, depth, householder)
        return params

    def compute_gates(
        self, params: dict[str, Array], x: Array, heads: int, depth: int, dtype: Any = None
    ) -> dict[str, Array]:
        """The gates for ``x (B, T, F)`` in the heads layout ``(B, N, 1, T[, D])``, keyword arguments of the core.

        Computed in the module's compute dtype (:func:`jattn._arrays.compute_dtype` of its ``dtype``, or without
        one of x's and the parameters' promoted dtype, as its projections infer theirs): float64 in a float64
        module, else float32.
        """
        compute = compute_dtype(functools.reduce(jnp.promote_types, [p.dtype for p in params.values()], x.dtype))
        compute = compute if dtype is None else compute_dtype(jnp.dtype(dtype))
        x = x.astype(compute)

        def param(name: str) -> Array:  # a bias or per-head parameter, broadcast over (B, T) explicitly
            y = params[name].astype(compute)
            return y if y.ndim == 2 else y[None, None]

        out: dict[str, Array] = {}
        for gate in self.gates:
            out |= gate.compute(param, x, heads, depth)
        return out

    def head_inputs(self, q: Array, k: Array, gates: dict[str, Array]) -> tuple[Array, Array, dict[str, Array]]:
        """The q, k ``(..., T, D)`` and keyword arguments the kind passes the core, from the projected q, k and gates."""
        if self.inputs is not None:
            return self.inputs(q, k, gates)
        return self.features(q), self.features(k), gates

    def features(self, x: Array) -> Array:
        """The q or k ``(..., D)`` the kind reads: SiLU then an L2 norm over D (``delta``), else as is.

        Computed in x's compute dtype (:func:`jattn._arrays.compute_dtype`: float64 for float64, else float32).
        """
        if not self.delta:
            return x
        y = jax.nn.silu(x.astype(compute_dtype(x.dtype)))
        return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)

    def state(self, batch: int, heads: int, depth: int, max_length: int, dtype: Any) -> Array:
        """A decoding cache's empty state: ``(B, N, 1, D, D)``, or ``(B, N, 1, L, D, D)`` a level each (``levels``).

        float32 (float64 for float64), as :func:`jattn.gated_linear_attention` keeps it; the levels cover positions
        below ``max_length`` (a ValueError where they would need more than :data:`LOG_LEVELS`).
        """
        dtype = jnp.promote_types(dtype, jnp.float32)
        if not self.levels:
            return jnp.zeros((batch, heads, 1, depth, depth), dtype)
        levels = levels_needed(max_length)
        if levels > LOG_LEVELS:
            raise ValueError(
                f"max_length={max_length} needs {levels} levels; kind={self.name!r} has {LOG_LEVELS} (positions "
                f"below {2 ** (LOG_LEVELS - 1)})"
            )
        return jnp.zeros((batch, heads, 1, levels, depth, depth), dtype)

    def attend(
        self,
        qh: Array,
        kh: Array,
        vh: Array,
        gates: dict[str, Array],
        *,
        valid: Array | None,
        state: Array | None,
        start: Array | None,
        num_householder: int,
        precision: jax.lax.PrecisionLike,
    ) -> tuple[Array, Array | None]:
        """The kind over the heads ``(B, N, 1, T, D)`` (K = N): ``out (B, N, 1, T, E)`` and the state after the last step.

        ``valid (B, 1, 1, T)``; ``state`` the cache's (None without one); ``start (B, 1, 1)`` the cache's position
        (the level states sit there; ``levels`` only). DeltaProduct (``num_householder`` n_h > 1): k, v and ``beta``
        have ``T·n_h`` sub-steps. Without a cache, the chunk form over the whole sequence; with one, one token is
        a recurrent step, a prompt the chunk form (the levels: the recurrent form from the cache's position).
        """
        qh, kh, kwargs = self.head_inputs(qh, kh, gates)
        if self.levels:
            if state is None:
                return log_linear_attention(qh, kh, vh, **kwargs, kv_mask=valid, precision=precision), None
            kwargs = kwargs | {"level_weights": kwargs["level_weights"][..., : state.shape[-3]]}
            return log_linear_attention(
                qh, kh, vh, **kwargs, kv_mask=valid, initial_state=state, return_state=True, mode="recurrent",
                start=start, precision=precision,
            )  # fmt: skip
        return gated_linear_attention(
            qh, kh, vh, **kwargs, num_householder=num_householder, kv_mask=valid, initial_state=state,
            return_state=True, mode="recurrent" if qh.shape[-2] == 1 else "chunk", precision=precision,
        )  # fmt: skip


# -- the gates --------------------------------------------------------------------------------------------------


def _uniform_log(low: float, high: float) -> Init:
    """Initialises ``log U[low, high]``."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, low, high))


def _dt_bias(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:
    """Mamba-2's ``dt_bias``: softplus of it log-uniform in [0.001, 0.1] (the inverse softplus of such a dt)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, np.log(1e-3), np.log(1e-1)))
    return dt + jnp.log(-jnp.expm1(-dt))


def _per_head(y: Array) -> Array:
    """``(B, T, N) -> (B, N, 1, T)``."""
    return y.transpose(0, 2, 1)[:, :, None, :]


def _per_feature(y: Array, heads: int, depth: int) -> Array:
    """``(B, T, N·D) -> (B, N, 1, T, D)``."""
    return y.reshape(*y.shape[:2], heads, depth).transpose(0, 2, 1, 3)[:, :, None]


_DENSE = jax.nn.initializers.lecun_normal()

RETENTION = Gate(  # a fixed decay per head, g_n = log(1 - 2^(-5 - n))
    params=lambda f, n, d, h: {},
    compute=lambda param, x, n, d: {
        "g": jnp.log1p(-(2.0 ** -(5.0 + jnp.arange(n, dtype=x.dtype))))[None, :, None, None]
    },
)

SSD_DECAY = Gate(  # Mamba-2: g = -exp(a_log) softplus(x w_dt + dt_bias), a decay per step and head
    params=lambda f, n, d, h: {
        "a_log": ((n,), _uniform_log(1.0, 16.0)),
        "w_dt": ((f, n), _DENSE),
        "dt_bias": ((n,), _dt_bias),
    },
    compute=lambda param, x, n, d: {
        "g": _per_head(-jnp.exp(param("a_log")) * jax.nn.softplus(x @ param("w_dt") + param("dt_bias")))
    },
)

GLA_DECAY = Gate(  # gk = log sigmoid(x w_gk_down w_gk_up + b_gk) / 16, a decay per step and key feature
    params=lambda f, n, d, h: {
        "w_gk_down": ((f, GLA_RANK), _DENSE),
        "w_gk_up": ((GLA_RANK, n * d), _DENSE),
        "b_gk": ((n * d,), jax.nn.initializers.zeros),
    },
    compute=lambda param, x, n, d: {
        "gk": _per_feature(
            jax.nn.log_sigmoid(x @ param("w_gk_down") @ param("w_gk_up") + param("b_gk")) / GLA_TEMPERATURE, n, d
        )
    },
)


def _kda_decay(param: Param, x: Array, n: int, d: int) -> dict[str, Array]:
    """Kimi Linear's decay: ``gk = -exp(a_log) softplus(x w_gk_down w_gk_up + dt_bias)`` per head and feature."""
    rate = jnp.repeat(jnp.exp(param("a_log")[0, 0]), d)[None, None]  # (1, 1, N·D)
    return {
        "gk": _per_feature(-rate * jax.nn.softplus(x @ param("w_gk_down") @ param("w_gk_up") + param("dt_bias")), n, d)
    }


KDA_DECAY = Gate(
    params=lambda f, n, d, h: {
        "a_log": ((n,), _uniform_log(1.0, 16.0)),
        "w_gk_down": ((f, d), _DENSE),
        "w_gk_up": ((d, n * d), _DENSE),
        "dt_bias": ((n * d,), _dt_bias),
    },
    compute=_kda_decay,
)


def _beta(param: Param, x: Array, n: int, d: int) -> dict[str, Array]:
    """The delta rule's ``beta = sigmoid(x w_beta)``, ``(B, N, 1, T·n_h)`` (token t's j-th sub-step at ``t·n_h + j``)."""
    w = param("w_beta")
    b, t, sub = *x.shape[:2], w.shape[-1] // n  # DeltaProduct's n_h sub-steps a token ((n h): sub-step outermost)
    beta = jax.nn.sigmoid(x @ w).reshape(b, t, sub, n)
    return {"beta": beta.transpose(0, 3, 1, 2).reshape(b, n, 1, t * sub)}


BETA = Gate(params=lambda f, n, d, h: {"w_beta": ((f, h * n), _DENSE)}, compute=_beta)


def _levels(param: Param, x: Array, n: int, d: int) -> dict[str, Array]:
    """The level weights ``λ = softplus(level_scale ⊙ (x w_level))``, ``(B, N, 1, T, LOG_LEVELS)``."""
    b, t = x.shape[:2]
    levels = (x @ param("w_level")).reshape(b, t, n, LOG_LEVELS) * param("level_scale")[None, None]
    return {"level_weights": jax.nn.softplus(levels).transpose(0, 2, 1, 3)[:, :, None]}


LEVELS = Gate(
    params=lambda f, n, d, h: {
        "w_level": ((f, n * LOG_LEVELS), _DENSE),
        "level_scale": ((n, LOG_LEVELS), jax.nn.initializers.ones),
    },
    compute=_levels,
)


def _rwkv7_params(features: int, heads: int, depth: int, householder: int) -> Params:
    """RWKV-7's decay and in-context learning rate LoRAs and its ``k_k``, ``k_a`` (module docstring)."""
    width = heads * depth
    small = jax.nn.initializers.variance_scaling(0.1, "fan_in", "normal")

    def constant(value: float) -> Init:
        return lambda key, shape, dtype: jnp.full(shape, value, dtype)

    def spread(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:  # -5.5 .. 0.5 over each head's D
        return jnp.tile(jnp.linspace(-5.5, 0.5, depth, dtype=dtype), heads)

    return {
        "w_decay_down": ((features, RWKV7_RANK), _DENSE),
        "w_decay_up": ((RWKV7_RANK, width), small),
        "b_decay": ((width,), spread),
        "w_iclr_down": ((features, RWKV7_RANK), _DENSE),
        "w_iclr_up": ((RWKV7_RANK, width), small),
        "b_iclr": ((width,), jax.nn.initializers.zeros),
        "k_k": ((width,), constant(0.85)),
        "k_a": ((width,), constant(1.0)),
    }


def _rwkv7_gates(param: Param, x: Array, n: int, d: int) -> dict[str, Array]:
    """RWKV-7's decay ``gk``, in-context learning rate ``iclr`` and ``k_k``, ``k_a`` per head ``(1, N, 1, 1, D)``."""
    lora = jnp.tanh(x @ param("w_decay_down")) @ param("w_decay_up") + param("b_decay")
    return {
        "gk": _per_feature(-RWKV7_DECAY * jax.nn.sigmoid(lora), n, d),
        "iclr": _per_feature(jax.nn.sigmoid(x @ param("w_iclr_down") @ param("w_iclr_up") + param("b_iclr")), n, d),
        **{name: param(name).reshape(1, n, 1, 1, d) for name in ("k_k", "k_a")},
    }


def _rwkv7_inputs(q: Array, k: Array, gates: dict[str, Array]) -> tuple[Array, Array, dict[str, Array]]:
    """RWKV-7's written key and transition ``a = -κ̂``, ``b = κ̂ ⊙ α`` (module docstring), in the gates' dtype."""
    rate, k_k, k_a = gates["iclr"], gates["k_k"], gates["k_a"]
    removal = k.astype(rate.dtype) * k_k
    removal = removal * jax.lax.rsqrt(jnp.sum(removal * removal, axis=-1, keepdims=True) + 1e-12)
    written = (k.astype(rate.dtype) * (1.0 + (rate - 1.0) * k_a)).astype(k.dtype)
    return q, written, {"gk": gates["gk"], "a": -removal, "b": removal * rate}


RWKV7 = Gate(params=_rwkv7_params, compute=_rwkv7_gates)

#: Every recurrent kind by name (:func:`register_kind` adds one).
RECURRENT: dict[str, RecurrentKind] = {}


def register_kind(kind: RecurrentKind) -> RecurrentKind:
    """Adds ``kind`` to :data:`RECURRENT` (a ``kind=`` of the modules from then on); returns it.

    A ValueError where the name is taken.
    """
    if kind.name in RECURRENT or kind.name in ("softmax", "linear"):
        raise ValueError(f"a module kind named {kind.name!r} exists already")
    RECURRENT[kind.name] = kind
    return kind


for _kind in (
    RecurrentKind("retention", (RETENTION,)),
    RecurrentKind("ssd", (SSD_DECAY,)),
    RecurrentKind("gla", (GLA_DECAY,)),
    RecurrentKind("deltanet", (BETA,), delta=True),
    RecurrentKind("gated_deltanet", (SSD_DECAY, BETA), delta=True),
    RecurrentKind("kda", (KDA_DECAY, BETA), delta=True),
    RecurrentKind("rwkv7", (RWKV7,), inputs=_rwkv7_inputs),
    RecurrentKind("deltaproduct", (BETA,), delta=True, householder=True),
    RecurrentKind("gated_deltaproduct", (SSD_DECAY, BETA), delta=True, householder=True),
    RecurrentKind("log_ssd", (SSD_DECAY, LEVELS), levels=True),
    RecurrentKind("log_gated_deltanet", (SSD_DECAY, BETA, LEVELS), delta=True, levels=True),
):
    register_kind(_kind)

#: The names of jattn's own recurrent kinds, in their order (:data:`jattn.RECURRENT_KINDS`).
RECURRENT_KINDS = tuple(RECURRENT)
