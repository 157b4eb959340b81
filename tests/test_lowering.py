"""The fused kernels lower for the hardware they are written for, checked on a CPU (issue #45).

``jax.jit(f).trace(*args).lower(lowering_platforms=(...,))`` builds the program the accelerator would
compile: a kernel that cannot be lowered for its hardware fails here, in CI, without one. TPU:
splash attention is a Mosaic ``tpu_custom_call`` (forward one, backward two: dK/dV and dQ); the
same call lowered for the CPU runs the kernel in interpret mode and holds none. The platform switch
selects the TPU translation, as in tests/test_pallas.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks

TPU_CASES = {
    # name: (mask, score_mod, q lead, kv lead): grouped heads B=2, K=3, G=4 (q_offset 6: T=131, S=97)
    "causal-gqa": (masks.causal(), None, (2, 3, 4), (2, 3, 1)),
    "window-softcap-gqa": (masks.sliding_window(40), jattn.score_mods.softcap(3.0), (2, 3, 4), (2, 3, 1)),
    "causal-segments-softcap": (
        masks.causal()
        & masks.segment_ids(np.arange(2 * 131).reshape(2, 131) // 50, np.arange(2 * 97).reshape(2, 97) // 50),
        jattn.score_mods.softcap(3.0),
        (2, 3),
        (2, 1),
    ),
}


def _programs(case):
    """``(forward, grad)`` of implementation='pallas' for the case, with their arguments."""
    mask, mod, lq, lkv = TPU_CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.normal(size=(*lead, n, 8)), jnp.float32) for lead, n in ((lq, 131), (lkv, 97), (lkv, 97))
    )

    def forward(q, k, v):
        return jattn.attention(q, k, v, mask=mask, score_mod=mod, q_offset=6, implementation="pallas")

    grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)), argnums=(0, 1, 2))
    return forward, grad, (q, k, v)


@pytest.mark.parametrize("case", list(TPU_CASES))
def test_splash_lowers_to_mosaic_for_tpu_and_to_interpret_mode_for_cpu(monkeypatch, case):
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    forward, grad, args = _programs(case)
    for fn, kernels in ((forward, 1), (grad, 3)):
        traced = jax.jit(fn).trace(*args)
        tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
        assert tpu.count("@tpu_custom_call") == kernels, (fn, tpu.count("@tpu_custom_call"))
        assert "@tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()
