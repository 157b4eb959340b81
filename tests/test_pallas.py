"""implementation='pallas' (issue #15): JAX's GPU flash kernel, run here in Pallas interpret mode.

Every translation (causal placed by offsets, padding, GQA broadcasting, odd lengths padded to the
blocks, T != S, E != D, scale) against the float64 reference, values and gradients, at tiny
sizes: interpret mode runs the kernel's grid as loops. The automatic choice is tested per
platform by setting the platform switch, as the blockwise tests do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._blockwise as bw
from jattn import masks
from tests import reference as ref

LENGTHS_Q, LENGTHS_KV = np.array([5, 11]), np.array([0, 9])
CASES = {
    # name: (mask, kw, q lead, kv lead, T, S, E, dtype, scale); D = 7
    "full-gqa-odd": (None, {}, (2, 3), (2, 1), 11, 13, 7, jnp.float32, None),
    "causal-bottom-right": (masks.causal(), {}, (2, 3), (2, 3), 11, 13, 5, jnp.float32, 0.3),
    "causal-queries-before-keys": (masks.causal(), dict(q_offset=-3), (1, 2), (1, 2), 9, 7, 4, jnp.float32, None),
    "causal-queries-past-keys": (masks.causal(), dict(q_offset=6, kv_offset=1), (2,), (2,), 7, 9, 5, jnp.float32, None),
    "padding-causal-empty-example": (
        masks.padding(LENGTHS_Q, LENGTHS_KV) & masks.causal(),
        {},
        (2, 3),
        (2, 1),
        11,
        13,
        5,
        jnp.float32,
        None,
    ),
    "padding-kv-only-bf16": (
        masks.padding(kv_lengths=np.array([3, 20])),
        {},
        (2, 1),
        (2, 1),
        13,
        11,
        6,
        jnp.bfloat16,
        None,
    ),
}


def _rand(shape, seed, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_equals_the_reference(case):
    """Values and gradients of q, k, v against the float64 reference (blocks of 8: several per axis)."""
    mask, kw, lq, lkv, T, S, E, dtype, scale = CASES[case]
    q, k, v = _rand((*lq, T, 7), 0, dtype), _rand((*lkv, S, 7), 1, dtype), _rand((*lkv, S, E), 2, dtype)
    g = np.random.default_rng(3).normal(size=(*np.broadcast_shapes(lq, lkv), T, E))
    dense = None if mask is None else np.asarray(mask.dense(T, S, **kw))
    if dense is not None and dense.ndim == 4:  # per example (B, 1, T, S) against q (B, N, T, D)
        dense = dense.reshape(dense.shape[0], *(1,) * (len(lq) - 1), T, S)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, scale=scale, implementation="pallas", block_size=8, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    want, _, _ = ref.attention(q, k, v, dense, None, scale)
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, None, scale)[:3], strict=True):
        ref.assert_grad_close(got, w, dtype)


def test_pallas_traced_scale_and_default_blocks():
    """A scale traced under jit is folded into q; without block_size the kernel takes 16 x 16 here."""
    q, k, v = _rand((3, 7, 8), 0, jnp.float32), _rand((3, 19, 8), 1, jnp.float32), _rand((3, 19, 8), 2, jnp.float32)
    out = jax.jit(lambda s: jattn.attention(q, k, v, mask=masks.causal(), scale=s, implementation="pallas"))(0.7)
    want, _, _ = ref.attention(q, k, v, np.asarray(masks.causal().dense(7, 19)), None, 0.7)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    "mask",
    [masks.sliding_window(2), masks.segment_ids(np.zeros((1, 6), int)), masks.causal() | masks.chunked(2)],
)
def test_pallas_refuses_what_the_kernel_cannot_express(mask):
    q = jnp.ones((1, 6, 4))
    with pytest.raises(ValueError, match=r"implementation='pallas' expresses causal\(\), padding\(\)"):
        jattn.attention(q, q, q, mask=mask, implementation="pallas")


def test_pallas_refuses_on_tpu_for_now(monkeypatch):
    monkeypatch.setattr(bw, "platform", lambda: "tpu")
    q = jnp.ones((1, 6, 4))
    with pytest.raises(ValueError, match="implementation='pallas' has no TPU translation"):
        jattn.attention(q, q, q, implementation="pallas")


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_automatic_choice_prefers_pallas_on_gpu_only_where_every_cell_is_yes(monkeypatch, platform):
    """On GPU: 'pallas' for what it fully honours; a "partly"/"no" cell falls back to the CPU order."""
    monkeypatch.setattr(bw, "platform", lambda: platform)
    q = jnp.zeros((2, 3, 6, 5))
    on_gpu = "pallas" if platform == "gpu" else "dense"
    assert jattn.choose_implementation(q, q, q) == on_gpu
    assert jattn.choose_implementation(q, q, q, mask=masks.causal(), q_offset=1) == "dense"  # partly: a mask
    assert jattn.choose_implementation(q, q, q, return_lse=True) == "dense"
    assert jattn.choose_implementation(q, q, q, bias=q[..., :6]) == "dense"
    assert jattn.choose_implementation(q, q, q, block_size=4) == ("pallas" if platform == "gpu" else "blockwise")
