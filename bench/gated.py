"""``python -m bench --gated``: the chunkwise form of :func:`jattn.gated_linear_attention` against its step-by-step
recurrence and against softmax causal attention (the blockwise path) at the same sizes, forward + backward;
GLA (``gk``) and KDA (``gk`` with ``beta``) beside Gated DeltaNet (``g`` with ``beta``).

Each candidate is ``jax.grad`` of the sum of its output with respect to q, k, v (and the gates), jitted, timed
alternated in one process (medians). The recurrence's backward keeps a state a step (B N T D E floats).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jattn
from bench.suite import alternated_ms


def gated_candidates(T: int, B: int, N: int, D: int) -> dict:
    """Zero-argument callables, each one jitted forward + backward at ``(B, N, T, D)`` (E = D)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(x, (B, N, T, D)) for x in keys[:3])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, N, T)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, N, T)))
    gk = jnp.broadcast_to(g[..., None] / D, (B, N, T, D))

    def timed(f, *args):
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(len(args)))))
        return lambda: jax.block_until_ready(grad(*args))

    def gated(mode, **kw):
        return lambda q, k, v, *gates: jattn.gated_linear_attention(
            q, k, v, mode=mode, **dict(zip(kw, gates, strict=True))
        )

    return {
        "gated deltanet, chunkwise": timed(gated("chunk", g=0, beta=0), q, k, v, g, beta),
        "gated deltanet, recurrent": timed(gated("recurrent", g=0, beta=0), q, k, v, g, beta),
        "gla, chunkwise": timed(gated("chunk", gk=0), q, k, v, gk),
        "kda, chunkwise": timed(gated("chunk", gk=0, beta=0), q, k, v, gk, beta),
        "softmax causal, blockwise": timed(
            lambda q, k, v: jattn.attention(q, k, v, mask=jattn.masks.causal(), implementation="blockwise"), q, k, v
        ),
    }


def gated_case(T: int, B: int = 1, N: int = 4, D: int = 64, repeats: int = 5) -> dict[str, float]:
    """ms of each candidate of :func:`gated_candidates`, alternated."""
    return alternated_ms(gated_candidates(T, B, N, D), repeats)
