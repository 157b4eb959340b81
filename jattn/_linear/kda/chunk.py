"""KDA's chunkwise parts: the delta rule's UT transform with a decay per key feature (Kimi Delta Attention).

Dimension key as in :mod:`jattn._core`; C: the steps of a chunk. The parts are those the gated / delta-rule
family's chunk scan carries the state through (:mod:`jattn._linear.gated_delta_rule.chunk`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from jattn._linear.chunking import documents, einsum, lower_triangle, running_sums, unit_lower_inverse
from jattn._linear.kda.pair_sums import pair_sums

__all__ = ["feature_delta_parts"]


def feature_delta_parts(q, k, v, g, gk, beta, runs, precision) -> tuple[Array, ...]:
    """Per chunk, the delta rule with a decay per key feature (KDA): the parts of :func:`_carry_step`, all chunks at once.

    With ``b_t (D,)`` the running sums of the log decays from the chunk's start and ``Γ_ts = exp(b_t - b_s)``
    per feature, the writes solve ``(I + A) Δ = diag(β) (V - (exp(b) ⊙ K) S_0)`` with
    ``A_ts = β_t Σ_f k_tf Γ_tsf k_sf`` (s < t), the outputs are ``(exp(b_t) ⊙ q_t) S_0 + Σ_{s<=t}
    (Σ_f q_tf Γ_tsf k_sf) δ_s`` and the last state ``exp(b_C) ⊙ S_0 + Σ_s (Γ_Cs ⊙ k_s) δ_sᵀ``
    (:func:`jattn._linear.kda.pair_sums.pair_sums` forms the pair sums).
    """
    seen, first, last = documents(runs)
    hi, lo = running_sums(gk if g is None else gk + g[..., None], axis=-2)  # (..., C, D)
    into = jnp.where(first[..., None], jnp.exp(hi + lo), 0.0)
    reach = jnp.where(last[..., None], jnp.exp((hi[..., -1:, :] - hi) + (lo[..., -1:, :] - lo)), 0.0)
    scores, a = pair_sums(q, k, hi, lo, precision)
    scores = jnp.where(seen, scores, 0.0)
    a = beta[..., :, None] * jnp.where(seen & lower_triangle(seen.shape, -1), a, 0.0)
    inverse = unit_lower_inverse(a)
    rhs = beta[..., None] * jnp.concatenate([v, into * k], axis=-1)  # (..., C, E + D)
    solved = einsum("...ts,...sx->...tx", inverse, rhs, precision=precision)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    return into * q, reach * k, into[..., -1, :], scores, u, w
