"""implementation=None (issue #45, item 3): the platform's fused paths of jattn.AUTO_ORDER tried in order.

Each fused path takes a call or refuses it by itself (a "partly" cell of SUPPORT, decided per call),
and the next candidate runs; an explicit implementation's refusal reaches the caller. The platform
fact is switched to 'gpu' / 'tpu' as the other kernel tests do, so the GPU kernel and splash run in
Pallas interpret mode. Every choice is checked by name (jattn.choose_implementation), by the run
itself (the automatic call gives bit for bit the result of the named path, and so ran it) and by
its value against the float64 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks
from tests import reference as ref

B, N, T, S, D = 1, 3, 40, 24, 16  # distinct sizes: a misread axis fails
E = D  # jax.nn (cuDNN) needs E == D: E != D would keep cuDNN out by its table cell


def _rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _operands(dtype=jnp.float32, t=T, s=S):
    return _rand((B, N, t, D), 0, dtype), _rand((B, N, s, D), 1, dtype), _rand((B, N, s, E), 2, dtype)


def _check_choice(kw, want, dtype=jnp.float32, t=T, s=S):
    """``choose_implementation`` names ``want``, the automatic call ran it (same bits) and equals the reference."""
    q, k, v = _operands(dtype, t, s)
    assert jattn.choose_implementation(q, k, v, **kw) == want
    auto, named = jax.jit(  # one program: the choice is made while tracing, as eagerly
        lambda q, k, v: (jattn.attention(q, k, v, **kw), jattn.attention(q, k, v, implementation=want, **kw))
    )(q, k, v)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(named, np.float32))
    mask, bias = kw.get("mask"), kw.get("bias")
    dense = None
    if isinstance(mask, masks.Mask):
        dense = np.asarray(mask.dense(t, s, q_offset=kw.get("q_offset"), kv_offset=kw.get("kv_offset", 0)))
        if dense.ndim == 4:  # per example (B, 1, t, s) against q (B, N, t, D)
            dense = dense.reshape(dense.shape[0], 1, t, s)
    elif mask is not None:
        dense = np.asarray(mask)
    want_out, _, _ = ref.attention(q, k, v, dense, None if bias is None else ref.f64(bias))
    np.testing.assert_allclose(ref.f64(auto), want_out, **ref.tol(dtype))


def test_auto_order_is_written_beside_support():
    """Every platform's fused paths are known paths, fused ones (never the blockwise/dense rule's)."""
    assert set(jattn.AUTO_ORDER) >= {"cpu", "gpu", "tpu"}
    for paths in jattn.AUTO_ORDER.values():
        assert set(paths) <= set(jattn.IMPLEMENTATIONS) - {"dense", "blockwise"}
    assert jattn.AUTO_ORDER["cpu"] == ()


GPU_CALLS = {
    # name: (keyword arguments, dtype, the path implementation=None takes on a GPU)
    "no mask": ({}, jnp.float32, "pallas"),
    "causal": (dict(mask=masks.causal()), jnp.float32, "pallas"),
    "causal shifted": (dict(mask=masks.causal(), q_offset=-5, kv_offset=2), jnp.float32, "pallas"),
    "padding": (dict(mask=masks.padding(q_lengths=np.array([31]), kv_lengths=np.array([17]))), jnp.float32, "pallas"),
    "causal & padding": (dict(mask=masks.causal() & masks.padding(kv_lengths=np.array([20]))), jnp.float32, "pallas"),
    # jattn's GPU kernel takes windows, documents and score mods (per-tile kinds): the kernel, not XLA's tiles
    "window": (dict(mask=masks.sliding_window(8)), jnp.float32, "pallas"),
    "window, blocks asked for": (dict(mask=masks.sliding_window(8), block_size=(8, 8)), jnp.float32, "pallas"),
    "segment ids": (
        dict(mask=masks.segment_ids(np.arange(T)[None] // 9, np.arange(S)[None] // 6)),
        jnp.float32,
        "pallas",
    ),
    "window bf16": (dict(mask=masks.sliding_window(8, 0), q_offset=0), jnp.bfloat16, "pallas"),
    # cells that say "no" for the fused paths: never tried
    "array mask": (dict(mask=np.tril(np.ones((T, S), bool), 16)), jnp.float32, "dense"),
    "bias": (dict(bias=_rand((T, S), 5)), jnp.float32, "dense"),
}


@pytest.mark.parametrize("case", list(GPU_CALLS))
def test_gpu_takes_the_kernel_where_it_can_and_falls_back_where_it_refuses(monkeypatch, case):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    kw, dtype, want = GPU_CALLS[case]
    _check_choice(kw, want, dtype)


def test_gpu_named_kernel_refusal_reaches_the_caller_naming_the_argument(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    q = _rand((B, N, 9, 264), 0)  # deeper than the kernel's 256
    with pytest.raises(
        ValueError, match=r"implementation='pallas' \(jattn's GPU kernel\) takes head depths D, E up to 256"
    ):
        jattn.attention(q, q, q, mask=masks.causal(), implementation="pallas")
    q, k, v = _operands()
    with pytest.raises(ValueError, match=r"implementation='pallas' cannot take bias.*use one of"):
        jattn.attention(q, k, v, bias=_rand((T, S), 5), implementation="pallas")


def test_gpu_falls_back_where_the_kernel_refuses_this_call(monkeypatch):
    """A head depth beyond the kernel's 256: the kernel refuses, cuDNN refuses float32, the CPU rule runs."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    q, k, v = _rand((B, N, 9, 264), 0), _rand((B, N, 7, 264), 1), _rand((B, N, 7, 5), 2)
    mask = masks.causal()
    assert jattn.choose_implementation(q, k, v, mask=mask) == "dense"
    out = jattn.attention(q, k, v, mask=mask)
    want, _, _ = ref.attention(q, k, v, np.tril(np.ones((9, 7), bool), -2))
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))


def test_cudnn_refuses_what_it_has_no_kernel_for():
    """Named: float32, or no CUDA GPU under JAX, is a ValueError naming the argument, before jax.nn sees it."""
    q, k, v = _operands()
    with pytest.raises(ValueError, match=r"implementation='cudnn' takes bfloat16 or float16 inputs only, got float32"):
        jattn.attention(q, k, v, mask=masks.causal(), q_offset=0, implementation="cudnn")
    q, k, v = _operands(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"implementation='cudnn' takes a CUDA GPU only; JAX's backend is 'cpu'"):
        jattn.attention(q, k, v, mask=masks.sliding_window(8, 0), q_offset=0, implementation="cudnn")
    with pytest.raises(ValueError, match=r"'cudnn' expresses causal\(\) and sliding_window\(l, 0\) only"):
        jattn.attention(q, k, v, mask=masks.causal(), implementation="cudnn")  # T < S, bottom-right: not aligned


def test_forward_mode_takes_the_gpu_kernel_and_falls_back_from_splash(monkeypatch):
    """Under jvp the automatic choice keeps the GPU kernel (its tangent kernel); on TPU splash (reverse mode only)
    refuses by name and the next path runs."""
    q, k, v = _operands()
    t = _rand(q.shape, 7)
    keep = np.asarray(masks.causal().dense(T, S))
    with jax.enable_x64(True):  # traced here, under float64
        want, want_t = jax.jit(
            lambda q, t: jax.jvp(lambda x: ref.dense_jax(x, ref.f64(k), ref.f64(v), keep=keep)[0], (q,), (t,))
        )(ref.f64(q), ref.f64(t))
    for platform, kernel in (("gpu", True), ("tpu", False)):
        monkeypatch.setattr(platform_facts, "platform", lambda p=platform: p)
        jvp = lambda x: jax.jvp(lambda x: jattn.attention(x, k, v, mask=masks.causal()), (x,), (t,))  # noqa: E731
        out, tangent = jvp(q)
        np.testing.assert_allclose(ref.f64(out), np.asarray(want), **ref.tol(jnp.float32))
        np.testing.assert_allclose(ref.f64(tangent), np.asarray(want_t), **ref.tol(jnp.float32))
        assert ("jattn_gpu_jvp" in str(jax.make_jaxpr(jvp)(q))) == kernel, platform
    with pytest.raises(ValueError, match=r"forward mode .* of implementation='pallas'"):
        jax.jvp(lambda x: jattn.attention(x, k, v, mask=masks.causal(), implementation="pallas"), (q,), (t,))


def test_gpu_choice_under_jit_and_grad_equals_the_reference(monkeypatch):
    """A refused call falls back inside jit and grad too (the refusal comes while tracing)."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    q, k, v = _operands()
    mask = masks.sliding_window(8)
    g = np.random.default_rng(4).normal(size=(B, N, T, E))
    loss = lambda q, k, v: jnp.sum(jattn.attention(q, k, v, mask=mask) * jnp.asarray(g, jnp.float32))  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    dense = np.asarray(mask.dense(T, S))
    for got, want in zip(grads, ref.attention_grads(q, k, v, g, dense)[:3], strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


# The old rule on CPU, by hand: dense below AUTO_BLOCKWISE_MIN score entries per head, blockwise
# from there or when blocks are asked for, dense where blockwise cannot take the call.
CPU_CALLS = {
    "no mask": ({}, "dense"),
    "causal": (dict(mask=masks.causal()), "dense"),
    "window": (dict(mask=masks.sliding_window(8)), "dense"),
    "padding": (dict(mask=masks.padding(kv_lengths=np.array([17]))), "dense"),
    "array mask": (dict(mask=np.tril(np.ones((T, S), bool), 16)), "dense"),
    "bias": (dict(bias=_rand((T, S), 5)), "dense"),
    "blocks asked for": (dict(mask=masks.causal(), block_size=8), "blockwise"),
    "per-example offsets": (dict(mask=masks.causal(), q_offset=np.array([3]), kv_offset=np.array([0])), "dense"),
}


@pytest.mark.parametrize("case", list(CPU_CALLS))
def test_cpu_choice_is_the_old_rule(monkeypatch, case):
    monkeypatch.setattr(platform_facts, "platform", lambda: "cpu")
    kw, want = CPU_CALLS[case]
    _check_choice(kw, want)


def test_cpu_choice_is_blockwise_for_long_scores(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "cpu")
    long = jnp.zeros((1, 1024, 8))
    assert jattn.AUTO_BLOCKWISE_MIN <= 1024 * 1024
    for mask in (None, masks.causal(), masks.sliding_window(64)):
        assert jattn.choose_implementation(long, long, long, mask=mask) == "blockwise"
    assert jattn.choose_implementation(long[:, :8], long, long) == "dense"


TPU_T, TPU_S = 100, 120  # splash pads to its blocks of 128
TPU_CALLS = {
    "causal": (dict(mask=masks.causal()), "pallas"),
    "window": (dict(mask=masks.sliding_window(9, 2)), "pallas"),
    "segment ids & causal": (
        dict(mask=masks.segment_ids(np.arange(TPU_T)[None] // 30, np.arange(TPU_S)[None] // 40) & masks.causal()),
        "pallas",
    ),
    # splash refuses a disjunction with a per-example mask ("partly"): the next path
    "padding | causal": (dict(mask=masks.padding(kv_lengths=np.array([50])) | masks.causal()), "dense"),
    "bias": (dict(bias=_rand((TPU_T, TPU_S), 5)), "dense"),
}


@pytest.mark.parametrize("case", list(TPU_CALLS))
def test_tpu_splash_takes_masks_and_a_bias_falls_back(monkeypatch, case):
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    kw, want = TPU_CALLS[case]
    _check_choice(kw, want, t=TPU_T, s=TPU_S)
