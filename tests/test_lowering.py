"""implementation='pallas' lowered for real GPUs on a CPU: jattn's kernel must reach Triton, in every derivative it takes.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton lowering
without a GPU; the platform facts are switched to a GPU (jattn's platform switch, and the backend
the kernel asks whether to interpret on), so the kernel is lowered rather than interpreted. The
forward is one ``__gpu$xla.gpu.triton`` call, the gradient three (forward, dq, dk/dv); neither
program holds a ``(T, S)``-shaped array (nor one of the padded lengths).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks, score_mods

B, K, G, T, S, D = 2, 2, 2, 40, 72, 64
TP, SP = 64, 128  # T and S padded to the default blocks (64 x 64)

CASES = {
    "causal": dict(mask=masks.causal()),
    "sliding-window": dict(mask=masks.sliding_window(16)),
    "segment-ids": dict(
        mask=masks.segment_ids(np.arange(B * T).reshape(B, T) // 9, np.arange(B * S).reshape(B, S) // 16)
    ),
    "softcap-causal": dict(mask=masks.causal(), score_mod=score_mods.softcap(30.0)),
    "alibi-padding": dict(
        mask=masks.padding(kv_lengths=np.array([30, 72])), score_mod=score_mods.alibi(jnp.ones((K * G,)))
    ),
}


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel is lowered, not interpreted


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grad_lower_to_triton_without_a_score_matrix(on_gpu, case):
    kw = CASES[case]
    q = jnp.zeros((B, K, G, T, D), jnp.bfloat16)
    k, v = jnp.zeros((B, K, 1, S, D), jnp.bfloat16), jnp.zeros((B, K, 1, S, D), jnp.bfloat16)

    def f(q, k, v):
        return jattn.attention(q, k, v, implementation="pallas", **kw)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    for fn, calls in ((f, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
        text = _cuda_text(fn, q, k, v)
        assert text.count("__gpu$xla.gpu.triton") == calls, case
        for t, s in ((T, S), (TP, SP)):
            assert not re.search(rf"\b{t}x{s}x", text), f"a ({t}, {s}) array in the {case} program"
