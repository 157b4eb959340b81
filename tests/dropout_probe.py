"""The dropout factor a path applies, read off its output (nothing of jattn's hash reproduced)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jattn


def dropout_factor(rate: float, lead_q, lead_kv, T: int, S: int, key, **kw) -> np.ndarray:
    """The factor Z ``(*lead, T, S)`` (0 or 1 / keep_prob) of ``jattn.attention(..., **kw)`` at ``rate`` and ``key``.

    With q = k = 0 every weight is 1 / S, and v = I (S x S) puts weight s of row t in out[..., t, s]: out = Z / S.
    """
    q, k = jnp.zeros((*lead_q, T, 3), jnp.float32), jnp.zeros((*lead_kv, S, 3), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (*lead_kv, S, S))
    return np.asarray(jattn.attention(q, k, v, dropout_rate=rate, dropout_rng=key, **kw), np.float64) * S
