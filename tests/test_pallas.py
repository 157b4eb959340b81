"""implementation='pallas' (issues #15, #45): jattn's GPU kernel and TPU splash attention, run here in
Pallas interpret mode (the GPU kernel's own tests, every mask kind, score mods, sinks and lse, are
in tests/test_gpu_kernel.py).

Every translation (causal placed by offsets, windows, other predicates as a NumPy mask, padding,
segment ids, GQA broadcasting, odd lengths padded to the blocks, T != S, E != D, scale) against
the float64 reference, values and gradients, at small sizes: interpret mode runs the kernel's
grid as loops (splash needs blocks of 128, so its cases are T, S ~ 100-160). The TPU kernel is
selected by setting the platform switch, as the blockwise tests do (the automatic choice:
tests/test_automatic_choice.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks
from jattn._checks import KernelRefusalError
from tests import reference as ref

CASES = {
    # name: (mask, kw, q lead, kv lead, T, S, E, dtype, scale); D = 7
    "full-gqa-odd": (None, {}, (2, 3), (2, 1), 11, 13, 7, jnp.float32, None),
    "causal-bottom-right": (masks.causal(), {}, (2, 3), (2, 3), 11, 13, 5, jnp.float32, 0.3),
    # queries before every key (dropped rows), padding of both sides, an example without keys
    "padding-causal-queries-before-keys": (
        masks.padding(q_lengths=np.array([5, 11]), kv_lengths=np.array([0, 9])) & masks.causal(),
        dict(q_offset=-3),
        (2, 3),
        (2, 1),
        11,
        13,
        4,
        jnp.float32,
        None,
    ),
    # queries past the keys' end: the kernel's causal bound reaches the padded keys (hidden by the column)
    "padding-causal-queries-past-keys-bf16": (
        masks.padding(kv_lengths=np.array([3, 20])) & masks.causal(),
        dict(q_offset=6, kv_offset=1),
        (2,),
        (2,),
        7,
        9,
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

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
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


@pytest.mark.parametrize("mask", [masks.padding(kv_lengths=np.array([2])) | masks.causal(), np.eye(6, dtype=bool)])
def test_splash_translation_refuses_per_example_disjunctions_and_arrays(monkeypatch, mask):
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    q = jnp.ones((1, 6, 4))
    with pytest.raises(ValueError, match="implementation='pallas' cannot take mask"):
        jattn.attention(q, q, q, mask=mask, implementation="pallas")


@pytest.mark.parametrize(
    "platform, kw, row",
    [
        ("tpu", dict(score_mod=jattn.score_mods.alibi(jnp.ones(3))), "score_mod"),
        ("tpu", dict(score_mod=lambda s, *_: 2.0 * jnp.tanh(s / 2.0)), "score_mod"),  # a softcap jattn cannot see
        ("tpu", dict(mask=masks.padding(kv_lengths=np.array([2, 6, 1]))), "mask \\(per-example"),  # q lacks the batch
    ],
)
def test_the_kernels_refuse_per_call_naming_the_argument_and_the_paths_that_take_it(monkeypatch, platform, kw, row):
    """A "partly" cell's refusal is a KernelRefusalError (the automatic choice's cue to try the next path)."""
    monkeypatch.setattr(platform_facts, "platform", lambda: platform)
    q, kv = jnp.ones((3, 6, 4)), jnp.ones((2, 3, 6, 4))  # q broadcasts against k's batch of 2
    where = "on TPU" if platform == "tpu" else "the GPU kernel"
    with pytest.raises(KernelRefusalError, match=f"implementation='pallas' cannot take {row}.*{where}.*'blockwise'"):
        jattn.attention(q, kv, kv, implementation="pallas", **kw)


SPLASH_CASES = {
    # name: (mask, kw, q lead, kv lead, T, S, E, dtype, scale); D = 7, blocks of 128 (splash's least)
    "native-causal-window-gqa-shifted": (
        masks.causal() & masks.sliding_window(40, 3),
        dict(q_offset=-9),
        (2, 2),
        (2, 1),
        131,
        97,
        5,
        jnp.float32,
        0.3,
    ),
    "numpy-mask-padding-segments-bf16": (
        (masks.chunked(50) | masks.sliding_window(4))
        & masks.padding(q_lengths=np.array([100, 131]), kv_lengths=np.array([0, 90]))
        & masks.segment_ids(np.arange(2 * 131).reshape(2, 131) // 60, np.arange(2 * 101).reshape(2, 101) // 60),
        {},
        (2, 1),
        (2, 1),
        131,
        101,
        7,
        jnp.bfloat16,
        None,
    ),
}


@pytest.mark.parametrize("case", list(SPLASH_CASES))
def test_splash_translation_equals_the_reference(monkeypatch, case):
    """The TPU translation (splash attention in interpret mode): native and NumPy masks, padding and segment ids."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    mask, kw, lq, lkv, T, S, E, dtype, scale = SPLASH_CASES[case]
    q, k, v = _rand((*lq, T, 7), 0, dtype), _rand((*lkv, S, 7), 1, dtype), _rand((*lkv, S, E), 2, dtype)
    g = np.random.default_rng(3).normal(size=(*np.broadcast_shapes(lq, lkv), T, E))
    dense = np.asarray(mask.dense(T, S, **kw))
    if dense.ndim == 4:
        dense = dense.reshape(dense.shape[0], *(1,) * (len(lq) - 1), T, S)
    assert not dense.any(-1).all()  # some rows see no key: they must give 0 (splash gives NaN or the mean of v)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, scale=scale, implementation="pallas", **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, _, _ = ref.attention(q, k, v, dense, None, scale)
    assert out.dtype == dtype
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, None, scale)[:3], strict=True):
        ref.assert_grad_close(got, w, dtype)


@pytest.mark.parametrize("q_lengths", [None, np.array([0, 8])])
def test_an_example_without_keys_gives_zero_and_zero_gradients(q_lengths):
    """kv_lengths 0 for one example (found by the slow fuzz: the kernel's backward gave NaN there)."""
    q, k, v = _rand((2, 8, 2), 0, jnp.float32), _rand((2, 3, 2), 1, jnp.float32), _rand((2, 3, 2), 2, jnp.float32)
    mask = masks.padding(q_lengths=q_lengths, kv_lengths=np.array([0, 2]))
    g = _rand((2, 8, 2), 3, jnp.float32)

    def grads(impl):
        loss = lambda q, k, v: jnp.sum(jattn.attention(q, k, v, mask=mask, implementation=impl) * g)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (_, got), (_, want) = grads("pallas"), grads("dense")
    assert np.all(np.asarray(got[0])[0] == 0) and np.all(np.asarray(got[1])[0] == 0)  # example 0 sees no key
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **ref.tol(jnp.float32))


GQA_CASES = {
    # name: (mask, kw, q lead, kv lead, T, S, E, dtype, softcap); D = 7; B != K != G != T != S
    "causal-gqa-softcap": (masks.causal(), dict(q_offset=6), (2, 3, 4), (2, 3, 1), 131, 97, 5, jnp.float32, 2.0),
    # k and v shared over the batch: the kernel's groups are (batch, group), kv heads K alone
    "window-kv-shared-over-batch-softcap-bf16": (
        masks.sliding_window(30),
        {},
        (2, 3, 4),
        (3, 1),
        101,
        133,
        7,
        jnp.bfloat16,
        5.0,
    ),
    # per-example segment ids: the kernel's batch B, then K kv heads of G query heads
    "segments-gqa": (
        masks.segment_ids(np.arange(2 * 131).reshape(2, 131) // 40, np.arange(2 * 97).reshape(2, 97) // 40),
        {},
        (2, 3, 4),
        (2, 3, 1),
        131,
        97,
        6,
        jnp.float32,
        None,
    ),
}


def _gqa_call(case, **extra):
    """The case's q, k, v and a loss of implementation='pallas' on them (sum of out · g), g and the dense mask."""
    mask, kw, lq, lkv, T, S, E, dtype, cap = GQA_CASES[case]
    q, k, v = _rand((*lq, T, 7), 0, dtype), _rand((*lkv, S, 7), 1, dtype), _rand((*lkv, S, E), 2, dtype)
    g = np.random.default_rng(3).normal(size=(*np.broadcast_shapes(lq, lkv), T, E))
    mod = None if cap is None else jattn.score_mods.softcap(cap)
    dense = np.asarray(mask.dense(T, S, **kw))
    if dense.ndim == 4:
        dense = dense.reshape(dense.shape[0], *(1,) * (len(lq) - 1), T, S)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, score_mod=mod, implementation="pallas", **kw, **extra)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    return (q, k, v), loss, g, dense


@pytest.mark.parametrize("case", list(GQA_CASES))
def test_splash_grouped_heads_and_softcap_equal_the_reference(monkeypatch, case):
    """GQA through splash's own grouped heads and its soft-cap: values and gradients against the float64 reference."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    (q, k, v), loss, g, dense = _gqa_call(case)
    cap, dtype = GQA_CASES[case][-1], q.dtype
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    mod = None if cap is None else (lambda s, *_: cap * np.tanh(s / cap))
    want, _, _ = ref.attention(q, k, v, dense, None, None, score_mod=mod)
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, None, None, softcap=cap)[:3], strict=True):
        assert got.shape == w.shape
        ref.assert_grad_close(got, w, dtype)


def _shapes(jaxpr):
    """The shapes of every value ``jaxpr`` and the jaxprs nested in it make."""
    for e in jaxpr.eqns:
        yield from (tuple(getattr(x.aval, "shape", ())) for x in e.outvars)
        for p in e.params.values():
            for x in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(x, "eqns") or hasattr(x, "jaxpr"):
                    yield from _shapes(getattr(x, "jaxpr", x))


@pytest.mark.parametrize("case", ["causal-gqa-softcap", "segments-gqa"])
def test_splash_grouped_heads_make_no_copy_of_k_and_v_per_query_head(monkeypatch, case):
    """No value of the forward and backward program holds keys for more heads than k has (B·K of them)."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    (q, k, v), loss, _, _ = _gqa_call(case, block_size=128)  # 128: S pads to 128, T to 256, told apart below
    lead_q, S = q.shape[:-2], k.shape[-2]
    kv_heads = 2 * 3  # B · K
    program = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v).jaxpr
    keyed = [s for s in _shapes(program) if len(s) >= 2 and s[-2] in (S, 128) and s[-1] in (7, v.shape[-1])]
    assert any(math.prod(s[:-2]) == kv_heads for s in keyed)  # the kernel's k and v (the test sees them)
    too_many = [s for s in keyed if math.prod(s[:-2]) > kv_heads]
    assert not too_many, f"k or v repeated over the {math.prod(lead_q)} query heads: {too_many}"


def test_splash_grouped_heads_under_jit_and_vmap_equal_eager_and_a_loop(monkeypatch):
    """jit equals the eager call; vmap over a new leading axis equals a loop over it (grouped heads, softcap)."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    (q, k, v), _, _, _ = _gqa_call("causal-gqa-softcap")
    mask, kw, *_, cap = GQA_CASES["causal-gqa-softcap"]

    def f(q, k, v):
        mod = jattn.score_mods.softcap(cap)
        return jattn.attention(q, k, v, mask=mask, score_mod=mod, implementation="pallas", **kw)

    eager, jitted = f(q, k, v), jax.jit(f)
    np.testing.assert_allclose(jitted(q, k, v), eager, **ref.tol(jnp.float32))
    mapped = jax.jit(jax.vmap(f))(q, k, v)  # over B: each call is then (K, G) against (K, 1)
    for b in range(q.shape[0]):  # the loop's calls: one program
        np.testing.assert_allclose(mapped[b], jitted(q[b], k[b], v[b]), **ref.tol(jnp.float32))
    np.testing.assert_allclose(mapped, eager, **ref.tol(jnp.float32))
