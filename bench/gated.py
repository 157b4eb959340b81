"""``python -m bench --gated``: the chunkwise form of :func:`jattn.gated_linear_attention` against its step-by-step
recurrence and against softmax causal attention (the blockwise path) at the same sizes, forward + backward
(Gated DeltaNet, GLA, KDA: ``gk`` with ``beta``, RWKV-7's diagonal-plus-low-rank transition ``a``, ``b``, Gated DeltaProduct); and
:func:`jattn.log_linear_attention`'s chunkwise form against its linear base (SSD, Gated DeltaNet).

Each candidate is ``jax.grad`` of the sum of its output with respect to q, k, v (and the gates), jitted, timed
alternated in one process (medians). The recurrence's backward keeps a state a step (B N T D E floats).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jattn
from bench.suite import alternated_ms

LOG_CHUNK = 64  # log-linear's chunk: the levels above it cost T·D·E each, those below it C² per chunk


def gated_candidates(T: int, B: int, N: int, D: int) -> dict:
    """Zero-argument callables, each one jitted forward + backward at ``(B, N, T, D)`` (E = D)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(x, (B, N, T, D)) for x in keys[:3])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, N, T)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, N, T)))
    gk = jnp.broadcast_to(g[..., None] / D, (B, N, T, D))
    n = 2  # DeltaProduct's Householder steps a token: its k, v, beta have T·n sub-steps
    k2, v2 = (jax.random.normal(x, (B, N, n * T, D)) for x in jax.random.split(keys[0], 2))
    k2 = k2 / jnp.linalg.norm(k2, axis=-1, keepdims=True)
    beta2 = jax.nn.sigmoid(jax.random.normal(keys[1], (B, N, n * T)))
    levels = jax.nn.softplus(jax.random.normal(keys[4], (B, N, T, max(T - 1, 0).bit_length() + 1)))
    kappa, rate, decay = _rwkv7_transition(keys[4], (B, N, T, D))

    def timed(f, *args):
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(len(args)))))
        return lambda: jax.block_until_ready(grad(*args))

    def gated(mode, num_householder=1, **kw):
        return lambda q, k, v, *gates: jattn.gated_linear_attention(
            q, k, v, mode=mode, num_householder=num_householder, **dict(zip(kw, gates, strict=True))
        )

    def log_linear(**kw):
        return lambda q, k, v, lam, *gates: jattn.log_linear_attention(
            q, k, v, level_weights=lam, chunk_size=LOG_CHUNK, **dict(zip(kw, gates, strict=True))
        )

    def rwkv7(mode):  # RWKV-7's transition diag(exp(gk)) - (rate ⊙ κ̂) κ̂ᵀ
        return lambda q, k, v, gk, kappa, rate: jattn.gated_linear_attention(
            q, k, v, gk=gk, a=-kappa, b=kappa * rate, mode=mode
        )

    return {
        "gated deltanet, chunkwise": timed(gated("chunk", g=0, beta=0), q, k, v, g, beta),
        "log-linear gated deltanet, chunkwise": timed(log_linear(g=0, beta=0), q, k, v, levels, g, beta),
        "ssd, chunkwise": timed(gated("chunk", g=0), q, k, v, g),
        "log-linear ssd, chunkwise": timed(log_linear(g=0), q, k, v, levels, g),
        "gated deltanet, recurrent": timed(gated("recurrent", g=0, beta=0), q, k, v, g, beta),
        "gla, chunkwise": timed(gated("chunk", gk=0), q, k, v, gk),
        "kda, chunkwise": timed(gated("chunk", gk=0, beta=0), q, k, v, gk, beta),
        "gated deltaproduct n_h=2, chunkwise": timed(
            gated("chunk", g=0, beta=0, num_householder=2), q, k2, v2, g, beta2
        ),
        "gated deltaproduct n_h=2, recurrent": timed(
            gated("recurrent", g=0, beta=0, num_householder=2), q, k2, v2, g, beta2
        ),
        "rwkv7, chunkwise": timed(rwkv7("chunk"), q, k, v, decay, kappa, rate),
        "rwkv7, recurrent": timed(rwkv7("recurrent"), q, k, v, decay, kappa, rate),
        "softmax causal, blockwise": timed(
            lambda q, k, v: jattn.attention(q, k, v, mask=jattn.masks.causal(), implementation="blockwise"), q, k, v
        ),
    }


def _rwkv7_transition(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RWKV-7's removal key κ̂ (unit), in-context learning rate α in (0, 1) and log decays in (-e^-1/2, 0)."""
    keys = jax.random.split(key, 3)
    kappa = jax.random.normal(keys[0], shape)
    kappa = kappa / jnp.linalg.norm(kappa, axis=-1, keepdims=True)
    rate = jax.nn.sigmoid(jax.random.normal(keys[1], shape))
    return kappa, rate, -jnp.exp(-0.5) * jax.nn.sigmoid(jax.random.normal(keys[2], shape))


def gated_case(T: int, B: int = 1, N: int = 4, D: int = 64, repeats: int = 5) -> dict[str, float]:
    """ms of each candidate of :func:`gated_candidates`, alternated."""
    return alternated_ms(gated_candidates(T, B, N, D), repeats)
