r"""The chunkwise form of the diagonal-plus-low-rank (DPLR, RWKV-7) recurrence of :func:`jattn.gated_linear_attention`.

Dimension key as in :mod:`jattn._core`. Per leading index, with ``w_t = exp(gk_t)`` (D,) and the state
``S (D, E)``::

    S_t = (diag(w_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ,     o_t = S_tᵀ q_t  (q scaled)

(flash-linear-attention's ``dplr`` / RWKV-7 form: ``a`` reads the state, ``b`` writes what it read; both act on
``S_{t-1}``, beside the decay, not after it).

**Chunkwise form.** With ``c_t`` the running sum of the log decays from the chunk's start (``c_{-1} = 0``) and the
reads ``u_t = a_tᵀ S_{t-1}`` (E,), a chunk's steps unroll to

    S_t = diag(e^{c_t}) S_0 + Σ_{s<=t} diag(e^{c_t - c_s}) (k_s v_sᵀ + b_s u_s)
    u_t = (a_t ⊙ e^{c_{t-1}})ᵀ S_0 + Σ_{s<t} [A_ak]_ts v_s + [A_ab]_ts u_s

with ``[A_xy]_ts = Σ_f x_tf y_sf e^{c_{t-1,f} - c_{s,f}}`` for ``s < t``: the reads solve the unit lower-triangular
system ``(I - A_ab) U = A_ak V + (A ⊙ e^{c_{-1}}) S_0`` (the WY-like form of the product of the chunk's
transitions), and ``o_t = (q_t ⊙ e^{c_t})ᵀ S_0 + Σ_{s<=t} [A_qk]_ts v_s + [A_qb]_ts u_s`` with ``e^{c_t - c_s}``.
Every exponent is a difference ``c_t - c_s`` or ``c_{t-1} - c_s`` with ``s <= t`` (``s < t``): ``<= 0``, kept to
twice the precision as the per-feature form does (:func:`jattn._linear.chunking.running_sums`). The chunks
run in a rematerialised ``lax.scan``: O(T) memory forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.chunking import documents, einsum, in_chunks, lower_triangle, running_sums, unit_lower_inverse
from jattn._linear.dplr.steps import LowRankSteps

__all__ = ["chunked"]


def chunked(steps: LowRankSteps, state: Array, chunk_size: int, precision) -> tuple[Array, Array]:
    """The chunkwise form (module docstring): a rematerialised ``lax.scan`` over chunks of ``chunk_size`` steps."""
    *lead, T, E = steps.v.shape
    c = max(min(chunk_size, T), 1)
    n = -(-T // c)

    def chunked(x: Array) -> Array:  # (*lead, T, ...) -> (n, *lead, c, ...), padded with dropped steps
        return jnp.moveaxis(in_chunks(x, len(lead), c), len(lead), 0)

    runs = jnp.cumsum(chunked(steps.reset).astype(jnp.int32), axis=-1)  # each step's document in its chunk
    xs = (*(chunked(x) for x in steps[:6]), runs)
    state, out = jax.lax.scan(jax.checkpoint(_chunk_step(precision)), state, xs)
    out = jnp.moveaxis(out, 0, len(lead)).reshape(*lead, n * c, E)[..., :T, :]
    return out, state


def _shifted(x: Array, fill: float = 0.0) -> Array:
    """``x (..., C, D)`` one step later: row t holds row t - 1, row 0 ``fill``."""
    return jnp.concatenate([jnp.full_like(x[..., :1, :], fill), x[..., :-1, :]], axis=-2)


def _chunk_step(precision):
    """The scan body: ``(S_0, a chunk's steps) -> (S_C, out (..., C, E))``.

    The exponents ``c_t - c_s`` are ``(hi_t - hi_s) + (lo_t - lo_s)`` (:func:`running_sums`); the ``lo`` parts go
    into the vectors (``e^lo_t q_t``, ``e^-lo_s k_s``), the ``(C, C, D)`` exponents are formed from ``hi`` alone,
    once: ``e^{c_{t-1} - c_s}`` is row t - 1 of ``e^{c_t - c_s}``.
    """

    def step(S, x):
        q, k, v, gk, a, b, runs = x
        seen, first, last = documents(runs)
        before = seen & lower_triangle(seen.shape, -1)
        hi, lo = running_sums(gk, axis=-2)  # (..., C, D)
        up, down, up0 = jnp.exp(lo), jnp.exp(-lo), jnp.exp(_shifted(lo))
        at = jnp.exp(jnp.where(seen[..., None], hi[..., :, None, :] - hi[..., None, :, :], -jnp.inf))
        after = jnp.where(
            before[..., None], jnp.concatenate([jnp.zeros_like(at[..., :1, :, :]), at[..., :-1, :, :]], axis=-3), 0.0
        )
        kb = jnp.stack([k * down, b * down], axis=-3)  # (..., 2, C, D)
        qk, qb = jnp.moveaxis(
            einsum("...tsf,...xsf->...xts", (q * up)[..., :, None, :] * at, kb, precision=precision), -3, 0
        )
        ak, ab = jnp.moveaxis(
            einsum("...tsf,...xsf->...xts", (a * up0)[..., :, None, :] * after, kb, precision=precision), -3, 0
        )
        into = jnp.where(first[..., None], jnp.exp(hi) * up, 0.0)  # e^{c_t} for the first document's steps
        into0 = jnp.where(first[..., None], _shifted(into, 1.0), 0.0)  # e^{c_{t-1}}, 1 at the chunk's first step
        rhs = einsum("...ts,...se->...te", ak, v, precision=precision)
        rhs = rhs + einsum("...tf,...fe->...te", a * into0, S, precision=precision)
        reads = einsum("...ts,...se->...te", unit_lower_inverse(-ab), rhs, precision=precision)  # U
        out = einsum("...tf,...fe->...te", q * into, S, precision=precision)
        out = out + einsum("...ts,...se->...te", qk, v, precision=precision)
        out = out + einsum("...ts,...se->...te", qb, reads, precision=precision)
        reach = jnp.where(last[..., None], jnp.exp(hi[..., -1:, :] - hi) * (up[..., -1:, :] * down), 0.0)
        S = into[..., -1, :, None] * S + einsum("...sf,...se->...fe", k * reach, v, precision=precision)
        S = S + einsum("...sf,...se->...fe", b * reach, reads, precision=precision)
        return S, out

    return step
