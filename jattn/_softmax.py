"""The softmax as three stable parts (part 2 of the article series).

For a row of logits ``x`` and a boolean ``where`` (True = keep):

1. ``max``: the row maximum over kept entries, ``m = max_j x_j``;
2. ``exp``: the shifted exponentials ``e_j = exp(x_j - m)``, exactly 0 where not kept;
3. ``sum``: the normaliser ``l = sum_j e_j``.

Then ``softmax(x) = e / l`` and ``logsumexp(x) = m + log(l)``. Subtracting ``m`` keeps every
``e_j`` in ``[0, 1]``, so nothing overflows whatever the size of the logits.

A row with no kept entry is a defined case: ``m = 0``, ``e = 0``, ``l = 0``, its softmax is all
zeros and its log-sum-exp is ``-inf``. Masked entries never reach the arithmetic, so a NaN or
``inf`` there neither leaks into the result nor into the gradient. A NaN at a kept entry
propagates to the whole row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["SoftmaxParts", "exp_below_one", "shifted_exp", "softmax", "softmax_parts"]

# 2^f on [-1/2, 1/2] as 1 + c1 f + ... + c6 f^6: a weighted least-squares fit to the relative error
# in float64; evaluated by Horner in float32 it is within 0.9 ulp of 2^f (1.2 without fused
# multiply-adds).
_EXP2_POLY = (
    1.0, 0.6931471824645996, 0.24022646248340607, 0.05550350248813629,
    0.0096187274903059, 0.0013392880791798234, 0.00015266820264514536,
)  # fmt: skip
_ROUND = 12582912.0  # 1.5 * 2^23: t + this rounds t to an integer held in the low mantissa bits


def exp_below_one(x: Array) -> Array:
    """``exp(min(x, 0))`` elementwise: exactly 0 at ``-inf``, exactly 1 at 0, NaN at NaN.

    For float32 it is computed as ``2^t``, ``t = x log2(e)`` cut to ``[-127, 0]``: ``t = n + f``
    with ``n`` the nearest integer, ``2^f`` a degree-6 polynomial and ``2^n`` built in the
    exponent bits. Measured (exhaustively on ``[-1, -1/4]``, on a dense grid elsewhere): within
    1.5 ulp relative for ``x >= -1`` compiled (1.7 evaluated op by op, without fused
    multiply-adds) and ``2^-23.5`` absolute everywhere; the rounding of ``t`` grows the relative
    error with ``|x|`` (64 ulp near -87, at weights below ``e^-87``), and results below
    ``2^-126`` are 0. In an online softmax every weight is at most 1 and each row's sum at least
    1, so the absolute error is within the rounding of that sum. It costs fewer instructions than
    XLA's general ``exp`` (which also guards overflow and positive arguments), and the blockwise
    path runs it once per score in the forward and again in the backward, both inside its custom
    VJP (differentiated only by forward-over-reverse, where its JVP, that of the polynomial, is
    ``e^x`` within 1.1e-6 relative). Other dtypes use ``jnp.exp``.
    """
    if x.dtype != jnp.float32:
        return jnp.exp(jnp.minimum(x, jnp.zeros((), x.dtype)))
    t = x * jnp.float32(1.4426950408889634)  # log2(e)
    t = jnp.where(t > 0, jnp.float32(0), jnp.where(t < -127, jnp.float32(-127), t))  # NaN passes
    n = jax.lax.round(t, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    f = t - n  # exact, in [-1/2, 1/2]
    p = jnp.float32(_EXP2_POLY[-1])
    for c in _EXP2_POLY[-2::-1]:
        p = p * f + jnp.float32(c)
    # n again, as the integer in the low bits of t + 1.5·2^23 (same rounding): 2^n = (n + 127) << 23.
    bits = jax.lax.bitcast_convert_type(t + jnp.float32(_ROUND), jnp.int32) + jnp.int32(127)
    return p * jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, jnp.int32(23)), jnp.float32)


def shifted_exp(x: Array, m: Array) -> Array:
    """``exp(x - m)`` for ``m`` a row maximum of ``x``, never above 1.

    Compilers may evaluate ``x - m`` as one fused multiply-add of the unrounded score (XLA on CPU
    does, under ``jit``), which can exceed the rounded maximum by half an ulp of the logit: for
    logits near 1e8 that is ``exp(16)``. Clamping the exponent at 0 keeps every weight in
    ``[0, 1]`` whatever the rounding; the clamp is held constant under differentiation, so the
    gradient is that of ``exp(x - m)``.
    """
    d = x - m
    return jnp.exp(d - jax.lax.stop_gradient(jnp.maximum(d, jnp.zeros_like(d))))


class SoftmaxParts(NamedTuple):
    """The stable parts of a softmax over the last axis; see the module docstring.

    Attributes:
      max: ``(..., 1)`` row maximum over kept entries (0 for a row with none kept). It is
        held constant under differentiation, as the softmax does not depend on it.
      exp: ``(..., S)`` ``exp(x - max)`` at kept entries, exactly 0 elsewhere.
      sum: ``(..., 1)`` the normaliser ``sum(exp)`` (0 for a row with none kept).
    """

    max: Array
    exp: Array
    sum: Array

    def safe_sum(self) -> Array:
        """``(..., 1)`` the normaliser with empty rows' 0 replaced by 1, safe to divide by."""
        return jnp.where(self.sum == 0, jnp.ones_like(self.sum), self.sum)

    def weights(self) -> Array:
        """``(..., S)`` the softmax ``exp / sum``; all zeros on a row with no kept entry."""
        return self.exp / self.safe_sum()

    def logsumexp(self) -> Array:
        """``(...,)`` ``max + log(sum)``; ``-inf`` on a row with no kept entry."""
        lse = self.max + jnp.log(self.safe_sum())
        return jnp.where(self.sum == 0, -jnp.inf, lse)[..., 0]


def softmax_parts(x: Array, where: Array | None = None) -> SoftmaxParts:
    """Split ``softmax(x)`` over the last axis into its stable parts.

    Args:
      x: ``(..., S)`` logits, floating point.
      where: optional boolean, broadcastable to ``x`` at equal rank; True keeps an entry.

    Returns:
      A :class:`SoftmaxParts` ``(max, exp, sum)`` in ``x.dtype``.
    """
    if where is None:
        where = jnp.ones((1,) * x.ndim, dtype=bool)
    m = jnp.max(x, axis=-1, keepdims=True, where=where, initial=-jnp.inf)
    m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, jnp.zeros_like(m), m))
    # The inner `where` keeps masked entries (possibly NaN or inf) out of the exp and out of
    # its gradient; the outer one makes them exactly zero.
    e = jnp.where(where, shifted_exp(jnp.where(where, x, m), m), jnp.zeros_like(x))
    return SoftmaxParts(m, e, jnp.sum(e, axis=-1, keepdims=True))


def softmax(x: Array, where: Array | None = None) -> Array:
    """``(..., S) -> (..., S)`` the stable softmax over the last axis, built from its parts.

    A row with no kept entry gives all zeros (not NaN, not uniform weights).
    """
    return softmax_parts(x, where).weights()


def zero_empty_rows(out: Array, seen: Array, lse: Array | None = None) -> tuple[Array, Array | None]:
    """The contract for rows that see no key: ``out (..., T, E)`` 0 and ``lse (..., T)`` ``-inf`` where ``seen`` is False.

    ``seen (..., T)`` is True for a row with at least one key to attend to. For the paths whose
    kernels give such a row something else (jax.nn: the mean of v; splash: NaN or the mean).
    """
    out = jnp.where(seen[..., None], out, jnp.zeros((), out.dtype))
    return out, None if lse is None else jnp.where(seen, lse.astype(jnp.float32), -jnp.inf)
