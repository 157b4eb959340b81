"""jattn's own GPU kernel (implementation='pallas' on GPU, jattn._gpu), run here in Pallas interpret mode.

The platform is switched to 'gpu' (as the blockwise tests switch it); on a CPU the kernel is
interpreted, on a GPU (bench/gpu.sh) it is compiled by Triton. Every mask kind the kernel takes
as per-tile kinds, grouped heads, E != D, odd distinct sizes (B != N != T != S, T and S not
multiples of the block), score mods, sinks and the log-sum-exp: values and gradients against
the float64 references of tests/reference.py (NumPy; JAX in float64 for the gradients of arrays a
score_mod closes over). Sizes are tiny: interpret mode runs the kernels' grids as loops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks, score_mods
from tests import reference as ref
from tests.dropout_probe import dropout_factor


@pytest.fixture(autouse=True)
def on_gpu(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")


def _rand(shape, seed, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


_IDS_Q = np.array([[0] * 6 + [1] * 9 + [2] * 4, [0] * 19])  # (B=2, T=19): documents, one example a single one
_IDS_KV = np.array([[0] * 8 + [1] * 10 + [2] * 5, [0] * 23])  # (B=2, S=23)

CASES = {
    # name: (mask, kw, q lead, kv lead, T, S, D, E, dtype, scale, block)
    "causal-gqa": (masks.causal(), {}, (2, 3, 2), (2, 3, 1), 19, 23, 8, 6, jnp.float32, 0.3, 8),
    "window-static-offsets-f16": (
        masks.sliding_window(5) & masks.causal(),
        dict(q_offset=7, kv_offset=2),
        (3, 2),
        (3, 2),
        13,
        29,
        8,
        8,
        jnp.float16,
        None,
        8,
    ),
    "chunked-or-global-bf16": (
        masks.chunked(6) | masks.global_tokens([0, 9]),
        {},
        (2, 3),
        (2, 3),
        21,
        17,
        16,
        16,
        jnp.bfloat16,
        None,
        8,
    ),
    "prefix-lm-depth-40": (masks.prefix_lm(5), {}, (3, 2), (3, 1), 17, 17, 40, 24, jnp.float32, None, 16),
    "segments-and-padding-causal": (
        masks.segment_ids(_IDS_Q, _IDS_KV) & masks.padding(kv_lengths=np.array([20, 0])) & masks.causal(),
        {},
        (2, 3),
        (2, 1),
        19,
        23,
        8,
        5,
        jnp.float32,
        None,
        8,
    ),
    "padding-or-window-queries-padded": (
        masks.padding(q_lengths=np.array([4, 11]), kv_lengths=np.array([5, 9])) | masks.sliding_window(2),
        {},
        (2, 3),
        (2, 3),
        11,
        13,
        8,
        8,
        jnp.float32,
        None,
        8,
    ),
    "not-segments-full-blocks": (
        ~masks.segment_ids(_IDS_Q[:, :16], _IDS_KV[:, :16]) | masks.causal(),
        {},
        (2, 3),
        (2, 3),
        16,
        16,
        8,
        8,
        jnp.float32,
        None,
        8,
    ),
}


def _dense(mask, kw, lq, T, S):
    """The mask as an explicit boolean array against q's leading dims (per example: (B, 1, ..., T, S))."""
    if mask is None:
        return None
    dense = np.asarray(mask.dense(T, S, **kw))
    if dense.ndim == 4:
        dense = dense.reshape(dense.shape[0], *(1,) * (len(lq) - 1), T, S)
    return dense


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_equal_the_reference(case):
    """Out and dq, dk, dv (k, v unrepeated under GQA: their gradients sum the group) against float64 NumPy."""
    mask, kw, lq, lkv, T, S, D, E, dtype, scale, block = CASES[case]
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lkv, S, D), 1, dtype), _rand((*lkv, S, E), 2, dtype)
    g = np.random.default_rng(3).normal(size=(*np.broadcast_shapes(lq, lkv), T, E))
    dense = _dense(mask, kw, lq, T, S)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, scale=scale, implementation="pallas", block_size=block, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, _, _ = ref.attention(q, k, v, dense, None, scale, q_offset=kw.get("q_offset"))
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, None, scale)[:3], strict=True):
        assert got.shape == w.shape
        ref.assert_grad_close(got, w, dtype)


def test_eager_equals_jit_and_vmap_equals_a_loop():
    """The kernel eagerly, under jit, and vmapped over an extra axis against a Python loop over it."""
    mask = masks.causal() & masks.padding(kv_lengths=np.array([9, 4]))
    q, k, v = (
        _rand((3, 2, 2, 9, 8), 0, jnp.float32),
        _rand((3, 2, 2, 11, 8), 1, jnp.float32),
        _rand((3, 2, 2, 11, 8), 2, jnp.float32),
    )

    def f(q, k, v):
        return jattn.attention(q, k, v, mask=mask, implementation="pallas", block_size=8)

    eager = f(q[0], k[0], v[0])
    np.testing.assert_array_equal(eager, jax.jit(f)(q[0], k[0], v[0]))
    mapped = jax.vmap(f)(q, k, v)
    for n in range(3):
        np.testing.assert_allclose(mapped[n], f(q[n], k[n], v[n]), **ref.tol(jnp.float32))


def test_softcap_and_sinks():
    """A soft cap applied in the kernel and sinks in every row's denominator: values, dq, dk, dv and d sinks."""
    q, k, v = (
        _rand((2, 3, 13, 8), 0, jnp.float32),
        _rand((2, 3, 17, 8), 1, jnp.float32),
        _rand((2, 3, 17, 8), 2, jnp.float32),
    )
    q = q * 4  # logits beyond the cap
    sinks = _rand((3,), 4, jnp.float32)
    g = np.random.default_rng(3).normal(size=(2, 3, 13, 8))
    mask = masks.sliding_window(6)

    def loss(q, k, v, sinks):
        out = jattn.attention(
            q, k, v, mask=mask, score_mod=score_mods.softcap(2.5), sinks=sinks, implementation="pallas", block_size=8
        )
        return jnp.sum(out * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    dense = np.asarray(mask.dense(13, 17))
    cap = lambda s, *_: 2.5 * np.tanh(s / 2.5)  # noqa: E731
    want, _, _ = ref.attention(q, k, v, dense, score_mod=cap, sinks=sinks)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    wants = ref.attention_grads(q, k, v, g, dense, sinks=sinks, softcap=2.5)
    for got, w in zip(grads, (*wants[:3], wants[4]), strict=True):
        ref.assert_grad_close(got, w, jnp.float32)


def test_lse_values_and_gradients():
    """return_lse: the log-sum-exp (-inf for a row that sees no key) and its gradients (through out and lse)."""
    q, k, v = (
        _rand((2, 3, 11, 8), 0, jnp.float32),
        _rand((2, 3, 14, 8), 1, jnp.float32),
        _rand((2, 3, 14, 8), 2, jnp.float32),
    )
    mask = masks.causal()
    kw = dict(q_offset=-2)  # the first two queries see no key
    dense = np.asarray(mask.dense(11, 14, **kw))
    gl = np.random.default_rng(5).normal(size=(2, 3, 11))

    def loss(q, k, v):
        _, lse = jattn.attention(q, k, v, mask=mask, return_lse=True, implementation="pallas", block_size=8, **kw)
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jnp.asarray(gl, jnp.float32)), lse

    (_, lse), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _, _, want = ref.attention(q, k, v, dense, q_offset=-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    np.testing.assert_allclose(
        np.where(np.isneginf(want), 0, ref.f64(lse)), np.where(np.isneginf(want), 0, want), **ref.tol(jnp.float32)
    )
    dq, dk, _ = ref.lse_grads(q, k, gl, dense)
    ref.assert_grad_close(grads[0], dq, jnp.float32)
    ref.assert_grad_close(grads[1], dk, jnp.float32)
    np.testing.assert_array_equal(grads[2], 0)  # lse does not read v


def test_max_logit_is_each_rows_largest_kept_modified_logit():
    """return_max_logit: the row max of the scaled, soft-capped, masked scores (-inf for a row that sees no key),
    with sinks (which join the denominator, not the max) and grouped heads; under jvp its tangent is 0."""
    B, K, G, T, S, D = 2, 3, 2, 11, 14, 8
    q, k, v = (
        _rand((B, K, G, T, D), 0, jnp.float32) * 3,
        _rand((B, K, 1, S, D), 1, jnp.float32),
        _rand((B, K, 1, S, D), 2, jnp.float32),
    )
    sinks = _rand((K, G), 4, jnp.float32)
    kw = dict(q_offset=-2)  # the first two queries see no key

    def f(q, k, v):
        return jattn.attention(
            q, k, v, mask=masks.causal(), score_mod=score_mods.softcap(2.5), sinks=sinks, return_lse=True,
            return_max_logit=True, implementation="pallas", block_size=8, **kw,
        )  # fmt: skip

    (out, lse, top), (_, _, d_top) = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), _tangents((q, k, v), 10))
    dense = np.asarray(masks.causal().dense(T, S, **kw))
    cap = lambda s, *_: 2.5 * np.tanh(s / 2.5)  # noqa: E731
    want, _, want_lse, want_top = ref.attention(q, k, v, dense, score_mod=cap, sinks=sinks, q_offset=-2, stats=True)
    np.testing.assert_array_equal(np.isneginf(top), np.isneginf(want_top))
    assert np.isneginf(want_top).sum() == B * K * G * 2
    seen = ~np.isneginf(want_top)
    np.testing.assert_allclose(ref.f64(top)[seen], want_top[seen], **ref.tol(jnp.float32))
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(ref.f64(lse), want_lse, **ref.tol(jnp.float32))
    np.testing.assert_array_equal(d_top, 0)


def _dense_jax64(q, k, v, keep, scale, score_mod, lead):
    """Float64 JAX attention with a score modification (written from the definition): JAX differentiates it."""
    s = jnp.einsum("...td,...sd->...ts", q, k) * scale
    T, S = s.shape[-2:]
    batch, head = (jnp.asarray(x) for x in ref.lead_indices(lead))
    unit = (1,) * len(lead)
    s = score_mod(s, batch, head, jnp.arange(S - T, S).reshape(*unit, T, 1), jnp.arange(S).reshape(*unit, 1, S))
    s = jnp.where(keep, s, -jnp.inf)
    w = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    return jnp.einsum("...ts,...se->...te", w / jnp.sum(w, -1, keepdims=True), v)


@pytest.mark.parametrize("which", ["alibi", "user-fn-of-a-table"])
def test_score_mods_closing_over_arrays_and_their_gradients(which):
    """ALiBi's slopes and a user function's per-head table get gradients from the kernel (float64 JAX reference)."""
    B, K, G, T, S, D = 2, 3, 2, 13, 15, 8
    q, k, v = (
        _rand((B, K, G, T, D), 0, jnp.float32),
        _rand((B, K, 1, S, D), 1, jnp.float32),
        _rand((B, K, 1, S, D), 2, jnp.float32),
    )
    table = _rand((K * G,), 4, jnp.float32) ** 2
    if which == "alibi":
        make = score_mods.alibi
    else:
        make = lambda t: lambda s, b, h, qp, kp: s * t[h] + 0.25 * jnp.sin(t[h]) * (b.astype(s.dtype) - 0.5)  # noqa: E731
    mask = masks.causal()
    g = np.random.default_rng(3).normal(size=(B, K, G, T, D))

    def loss(q, k, v, t):
        out = jattn.attention(q, k, v, mask=mask, score_mod=make(t), scale=0.5, implementation="pallas", block_size=8)
        return jnp.sum(out * jnp.asarray(g, jnp.float32))

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table)
    with jax.enable_x64(True):
        keep = jnp.asarray(mask.dense(T, S))

        def ref_loss(q, k, v, t):
            return jnp.sum(_dense_jax64(q, k, v, keep, 0.5, make(t), (B, K, G)) * jnp.asarray(g))

        args = tuple(jnp.asarray(ref.f64(x)) for x in (q, k, v, table))
        want = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3))(*args)
        want = (np.asarray(want[0]), tuple(np.asarray(w) for w in want[1]))
    np.testing.assert_allclose(float(got[0]), want[0], rtol=1e-5)
    for a, w in zip(got[1], want[1], strict=True):
        ref.assert_grad_close(a, w, jnp.float32)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(mask=np.tril(np.ones((6, 6), bool))), "mask"),
        (dict(mask=masks.predicate(lambda b, h, i, j: j <= i + h)), "batch and head"),
        (dict(mask=masks.causal(), q_offset=np.array([0, 1])), "offset"),
        (dict(bias=np.zeros((6, 6), np.float32)), "bias"),
        (dict(precision="highest"), "precision"),
        (dict(score_mod=score_mods.relative_position_bias(np.ones((32, 3), np.float32))), "score_mod.*gather"),
    ],
)
def test_what_the_kernel_cannot_take_is_a_named_value_error(kw, match):
    q = jnp.ones((2, 3, 6, 4))
    with pytest.raises(ValueError, match=match):
        jattn.attention(q, q, q, implementation="pallas", **kw)


def test_head_depth_beyond_256_is_a_kernel_refusal():
    q = jnp.ones((1, 4, 264))
    with pytest.raises(ValueError, match="head depths D, E up to 256") as e:
        jattn.attention(q, q, q, implementation="pallas")
    assert type(e.value).__name__ == "KernelRefusalError"


def _tangents(args, seed):
    return tuple(_rand(x.shape, seed + n, x.dtype) for n, x in enumerate(args))


@pytest.mark.parametrize("case", list(CASES))
def test_jvp_equals_the_reference(case):
    """Forward mode through the tangent kernel: out, lse and their tangents against float64 JAX (jvp of dense)."""
    mask, kw, lq, lkv, T, S, D, E, dtype, scale, block = CASES[case]
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lkv, S, D), 1, dtype), _rand((*lkv, S, E), 2, dtype)
    tangents = _tangents((q, k, v), 10)
    dense = _dense(mask, kw, lq, T, S)

    def f(q, k, v):
        return jattn.attention(
            q, k, v, mask=mask, scale=scale, return_lse=True, implementation="pallas", block_size=block, **kw
        )

    (out, lse), (d_out, d_lse) = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), tangents)
    with jax.enable_x64(True):
        wide = (scale or 1 / np.sqrt(D)) * np.sqrt(D)  # dense_jax scales by 1/sqrt(D)
        args = (jnp.asarray(ref.f64(q)) * wide, *(jnp.asarray(ref.f64(x)) for x in (k, v)))
        dt = (jnp.asarray(ref.f64(tangents[0])) * wide, *(jnp.asarray(ref.f64(t)) for t in tangents[1:]))
        want, d_want = jax.jit(lambda a, t: jax.jvp(lambda q, k, v: ref.dense_jax(q, k, v, keep=dense), a, t))(args, dt)
    assert d_out.dtype == dtype and d_out.shape == want[0].shape and d_lse.dtype == jnp.float32
    np.testing.assert_allclose(ref.f64(out), np.asarray(want[0]), **ref.tol(dtype))
    ref.assert_grad_close(d_out, np.asarray(d_want[0]), dtype)
    seen = np.isfinite(np.asarray(want[1]))
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    ref.assert_grad_close(np.where(seen, d_lse, 0), np.where(seen, np.asarray(d_want[1]), 0), jnp.float32)


def test_jvp_in_sinks_softcap_and_the_arrays_a_score_mod_closes_over():
    """Tangents in the sinks (soft cap in the kernel) and in ALiBi's slopes (a closed-over array) against float64 JAX."""
    B, K, G, T, S, D = 2, 3, 2, 13, 15, 8
    q, k, v = (
        _rand((B, K, G, T, D), 0, jnp.float32) * 3,
        _rand((B, K, 1, S, D), 1, jnp.float32),
        _rand((B, K, 1, S, D), 2, jnp.float32),
    )
    sinks, slopes = _rand((K, G), 4, jnp.float32), _rand((K * G,), 5, jnp.float32) ** 2
    tangents = _tangents((q, k, v, sinks, slopes), 20)
    mask = masks.sliding_window(6)
    keep = np.asarray(mask.dense(T, S))

    def capped(q, k, v, sinks):
        mod = score_mods.softcap(2.5)
        return jattn.attention(q, k, v, mask=mask, score_mod=mod, sinks=sinks, implementation="pallas", block_size=8)

    def alibi(q, k, v, slopes):
        mod = score_mods.alibi(slopes)
        return jattn.attention(q, k, v, mask=mask, score_mod=mod, scale=0.5, implementation="pallas", block_size=8)

    got_cap = jax.jvp(capped, (q, k, v, sinks), tangents[:4])  # eagerly (the kernel's jvp outside jit)
    got_alibi = jax.jit(lambda a, t: jax.jvp(alibi, a, t))((q, k, v, slopes), (*tangents[:3], tangents[4]))
    with jax.enable_x64(True):
        wide = lambda xs: tuple(jnp.asarray(ref.f64(x)) for x in xs)  # noqa: E731
        want_cap, want_alibi = jax.jit(  # one program
            lambda a, t: (
                jax.jvp(lambda q, k, v, s: ref.dense_jax(q, k, v, keep=keep, sinks=s, softcap=2.5)[0], a[:4], t[:4]),
                jax.jvp(
                    lambda q, k, v, t: _dense_jax64(q, k, v, keep, 0.5, score_mods.alibi(t), (B, K, G)),
                    (*a[:3], a[4]),
                    (*t[:3], t[4]),
                ),
            )
        )(wide((q, k, v, sinks, slopes)), wide(tangents))
    for got, want in ((got_cap, want_cap), (got_alibi, want_alibi)):
        np.testing.assert_allclose(ref.f64(got[0]), np.asarray(want[0]), **ref.tol(jnp.float32))
        ref.assert_grad_close(got[1], np.asarray(want[1]), jnp.float32)


def test_jvp_vmapped_equals_a_loop():
    """jvp under vmap (jacfwd's form) over q and per-example documents, k and v shared: each index as its own call."""
    B, K, G, T, S, D = 2, 2, 3, 9, 11, 8
    n = 3
    q = _rand((n, B, K, G, T, D), 0, jnp.float32)
    k, v = _rand((B, K, 1, S, D), 1, jnp.float32), _rand((B, K, 1, S, D), 2, jnp.float32)
    tq = _rand((n, B, K, G, T, D), 3, jnp.float32)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 2, size=(n, B, S)))

    def f(q, ids, tq):
        mask = masks.causal() & masks.segment_ids(ids[:, S - T :], ids)

        def call(q, k, v):
            return jattn.attention(q, k, v, mask=mask, implementation="pallas", block_size=8)

        return jax.jvp(call, (q, k, v), (tq, k, v))

    mapped = jax.jit(jax.vmap(f))(q, ids, tq)
    call = jax.jit(f)  # one program for the loop's calls
    for i in range(n):
        for a, b in zip(mapped, call(q[i], ids[i], tq[i]), strict=True):
            np.testing.assert_allclose(a[i], b, **ref.tol(jnp.float32))


def test_tpu_kernel_refuses_sinks_lse_and_score_mods_other_than_softcap(monkeypatch):
    """Splash attention (TPU) takes none of them: a ValueError naming the argument and the paths that take it."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    q = jnp.ones((1, 2, 8, 4))
    for kw, name in (
        (dict(score_mod=score_mods.alibi(jnp.ones((2,)))), "score_mod"),
        (dict(sinks=jnp.zeros((2,))), "sinks"),
        (dict(return_lse=True), "return_lse"),
        (dict(return_max_logit=True), "return_max_logit"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate"),
    ):
        with pytest.raises(ValueError, match=rf"implementation='pallas' cannot take {name}: on TPU.*use one of"):
            jattn.attention(q, q, q, implementation="pallas", **kw)


def test_second_order_through_the_dense_path():
    """grad of grad: the backward kernels differentiated through the dense path equal dense's own second order
    (grouped heads, documents traced under jit, sinks; ALiBi with constant slopes and with slopes being
    differentiated, their share reaching them through the kernel's row values)."""
    B, K, G, T, S, D = 2, 3, 2, 7, 9, 8
    q, k, v = (
        _rand((B, K, G, T, D), 0, jnp.float32),
        _rand((B, K, 1, S, D), 1, jnp.float32),
        _rand((B, K, 1, S, D), 2, jnp.float32),
    )
    ids = jnp.asarray(np.arange(B * S).reshape(B, S) // 4 % 2)
    sinks = jnp.asarray(np.linspace(-1.0, 1.0, K * G).reshape(K, G), jnp.float32)

    def outer(impl, **kw):
        def first(q, k, v, ids):
            mask = masks.causal() & masks.segment_ids(ids[:, S - T :], ids)
            return jnp.sum(jnp.sin(jattn.attention(q, k, v, mask=mask, sinks=sinks, implementation=impl, **kw)))

        def loss(q, k, v, ids):
            dq, dk, dv = jax.grad(first, argnums=(0, 1, 2))(q, k, v, ids)
            return jnp.sum(dq**2) + jnp.sum(dk * dv)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    got, want = outer("pallas", block_size=8)(q, k, v, ids), outer("dense")(q, k, v, ids)
    for a, w in zip(got, want, strict=True):
        ref.assert_grad_close(a, np.asarray(w, np.float64), jnp.float32)

    def alibi_loss(q, slopes, impl):
        kw = dict(block_size=8) if impl == "pallas" else {}
        mod = score_mods.alibi(slopes)
        return jnp.sum(jattn.attention(q, q, q, mask=masks.causal(), score_mod=mod, implementation=impl, **kw) ** 2)

    q5, slopes = _rand((2, 5, 6, 8), 3, jnp.float32), jnp.asarray([1.0, 0.5, 0.25, 0.125, 0.0625], jnp.float32)

    def constant(impl, q, slopes):  # slopes closed over as constants (under jit too): no share of the second derivative
        return jax.jit(lambda q: (jax.grad(lambda q: jnp.sum(jax.grad(alibi_loss)(q, slopes, impl) ** 2))(q),))(q)

    def learned(impl, q, slopes):  # the first gradient's norm in (q, slopes), differentiated in both
        def norm(q, slopes):
            dq, ds = jax.grad(alibi_loss, argnums=(0, 1))(q, slopes, impl)
            return jnp.sum(dq**2) + jnp.sum(jnp.sin(ds))

        return jax.jit(jax.grad(norm, argnums=(0, 1)))(q, slopes)

    @functools.partial(jax.jit, static_argnums=0)
    def hvp(impl, q, slopes):  # forward over reverse, along (q, ones) in (q, slopes)
        grads = functools.partial(jax.grad(alibi_loss, argnums=(0, 1)), impl=impl)
        return jax.jvp(grads, (q, slopes), (q, jnp.ones_like(slopes)))[1]

    for second in (constant, learned, hvp):
        with jax.enable_x64(True):
            want = second("dense", *(jnp.asarray(ref.f64(x)) for x in (q5, slopes)))
        # squared gradients amplify float32 rounding past the table's tolerance: as close as dense's own float32
        for got, dense, w in zip(second("pallas", q5, slopes), second("dense", q5, slopes), want, strict=True):
            w = np.asarray(w)
            err, floor = (np.max(np.abs(ref.f64(x) - w)) for x in (got, dense))
            assert err <= 2 * floor + 1e-5 * np.max(np.abs(w)), (second.__name__, err, floor)


def test_second_order_with_learned_slopes_over_several_reference_tiles():
    """grad of grad in (q, slopes) at T = 256, where the reference path (blockwise) calls the score mod on tiles of
    several shapes: equal to float64 dense as closely as the blockwise path's own float32 (jax 0.11+ raised
    UnexpectedTracerError here while the score mod, closing over the first derivative's slopes, was traced again)."""
    q = _rand((1, 2, 256, 8), 6, jnp.float32)
    slopes = jnp.asarray([0.5, 0.125], jnp.float32)

    def second(impl, q, slopes):
        def loss(q, slopes):
            out = jattn.attention(q, q, q, mask=masks.causal(), score_mod=score_mods.alibi(slopes), implementation=impl)
            return jnp.sum(out**2)

        def norm(q, slopes):
            dq, ds = jax.grad(loss, argnums=(0, 1))(q, slopes)
            return jnp.sum(dq**2) + jnp.sum(jnp.sin(ds))

        return jax.jit(jax.grad(norm, argnums=(0, 1)))(q, slopes)

    with jax.enable_x64(True):
        want = second("dense", *(jnp.asarray(ref.f64(x)) for x in (q, slopes)))
    for got, blockwise, w in zip(second("pallas", q, slopes), second("blockwise", q, slopes), want, strict=True):
        w = np.asarray(w)
        err, floor = (np.max(np.abs(ref.f64(x) - w)) for x in (got, blockwise))
        assert err <= 2 * floor + 1e-5 * np.max(np.abs(w)), (err, floor)


def test_second_order_with_learned_slopes_under_vmap_equals_a_loop():
    """vmap of grad of grad in (q, slopes), each copy its own slopes: the folded copies' row values reach
    their own slopes, as a loop of one call each (test_second_order_through_the_dense_path holds one call
    to float64)."""

    def loss(q, slopes, impl):
        kw = dict(block_size=8) if impl == "pallas" else {}
        out = jattn.attention(
            q, q, q, mask=masks.causal(), score_mod=score_mods.alibi(slopes), implementation=impl, **kw
        )
        return jnp.sum(out**2)

    def second(q, slopes, impl):
        def norm(q, slopes):
            dq, ds = jax.grad(loss, argnums=(0, 1))(q, slopes, impl)
            return jnp.sum(dq**2) + jnp.sum(jnp.sin(ds))

        return jax.grad(norm, argnums=(0, 1))(q, slopes)

    q = _rand((3, 2, 5, 7, 8), 4, jnp.float32)
    slopes = jnp.asarray(np.random.default_rng(5).uniform(0.1, 1.0, (3, 5)), jnp.float32)
    mapped = jax.vmap(functools.partial(second, impl="pallas"))(q, slopes)
    for i in range(q.shape[0]):
        for got, want in zip(mapped, second(q[i], slopes[i], "pallas"), strict=True):
            ref.assert_grad_close(got[i], np.asarray(want, np.float64), jnp.float32)


_RATE = 0.3


def _factor(lead_q, lead_kv, T, S, key, **kw):
    return dropout_factor(_RATE, lead_q, lead_kv, T, S, key, **kw)


def test_dropout_drops_what_the_blockwise_path_drops():
    """The kernel's keep bits are the dense and blockwise paths' in every (grouped) row, for two block sizes."""
    key, lq, lkv, T, S = jax.random.key(11), (2, 3, 2), (2, 3, 1), 11, 13
    want = _factor(lq, lkv, T, S, key, implementation="dense")
    blockwise = _factor(lq, lkv, T, S, key, implementation="blockwise", block_size=(4, 3))
    np.testing.assert_array_equal(blockwise != 0, want != 0)  # the same bits; 1 / keep may round apart (jax 0.12)
    np.testing.assert_allclose(blockwise, want, rtol=1e-6)
    for block in (8, 16):
        got = _factor(lq, lkv, T, S, key, implementation="pallas", block_size=block)
        np.testing.assert_array_equal(got != 0, want != 0, err_msg=f"block_size={block}")
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"block_size={block}")
    assert 0.5 < np.mean(want != 0) < 0.9  # a real draw (keep_prob 0.7)


def _dropout_case():
    B, K, G, T, S, D, E = 2, 3, 2, 11, 13, 8, 6
    args = _rand((B, K, G, T, D), 0, jnp.float32), _rand((B, K, 1, S, D), 1, jnp.float32)
    mask = masks.causal() & masks.padding(kv_lengths=np.array([13, 6]))
    kw = dict(mask=mask, q_offset=-2, dropout_rate=_RATE, dropout_rng=jax.random.key(5))  # rows 0, 1 see no key
    drop = _factor((B, K, G), (B, K, 1), T, S, jax.random.key(5), implementation="dense")
    keep = np.asarray(mask.dense(T, S, q_offset=-2)).reshape(B, 1, 1, T, S)
    return (*args, _rand((B, K, 1, S, E), 2, jnp.float32)), kw, drop, keep


def test_dropout_values_and_gradients_equal_the_reference():
    """out = (P ∘ Z) v, dq, dk, dv (grouped heads, documents padded, rows that see nothing) against float64 NumPy."""
    (q, k, v), kw, drop, keep = _dropout_case()
    g = np.random.default_rng(3).normal(size=(*q.shape[:-1], v.shape[-1]))

    def loss(q, k, v):
        out = jattn.attention(q, k, v, implementation="pallas", block_size=8, **kw)
        return jnp.sum(out * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _, w, _ = ref.attention(q, k, v, keep)
    np.testing.assert_allclose(ref.f64(out), np.matmul(w * drop, ref.f64(v)), **ref.tol(jnp.float32))
    for got, want in zip(grads, ref.attention_grads(q, k, v, g, keep, drop=drop)[:3], strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


def test_dropout_jvp_and_second_order():
    """Forward mode (one-pass kernel) against float64 JAX with Z materialised; grad of grad as the dense path's."""
    (q, k, v), kw, drop, keep = _dropout_case()
    tangents = _tangents((q, k, v), 10)

    def f(q, k, v):
        return jattn.attention(q, k, v, return_lse=True, implementation="pallas", block_size=8, **kw)

    (out, lse), (d_out, d_lse) = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), tangents)
    with jax.enable_x64(True):

        def want_f(q, k, v):
            s = jnp.where(keep, jnp.einsum("...td,...sd->...ts", q, k) / np.sqrt(q.shape[-1]), -jnp.inf)
            lse = jax.nn.logsumexp(s, -1)
            w = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
            return jnp.einsum("...ts,...se->...te", w * drop, v), lse

        wide = lambda xs: tuple(jnp.asarray(ref.f64(x)) for x in xs)  # noqa: E731
        want, d_want = jax.jit(lambda a, t: jax.jvp(want_f, a, t))(wide((q, k, v)), wide(tangents))
    np.testing.assert_allclose(ref.f64(out), np.asarray(want[0]), **ref.tol(jnp.float32))
    ref.assert_grad_close(d_out, np.asarray(d_want[0]), jnp.float32)
    seen = np.isfinite(np.asarray(want[1]))
    np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, np.asarray(want[1]), 0), **ref.tol(jnp.float32))
    ref.assert_grad_close(np.where(seen, d_lse, 0), np.where(seen, np.asarray(d_want[1]), 0), jnp.float32)

    def outer(impl, **extra):
        def loss(q, k, v):
            dq, dk, dv = jax.grad(
                lambda *a: jnp.sum(jnp.sin(jattn.attention(*a, implementation=impl, **kw, **extra))), argnums=(0, 1, 2)
            )(q, k, v)
            return jnp.sum(dq**2) + jnp.sum(dk**2) + jnp.sum(jnp.sin(dv))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for a, w in zip(outer("pallas", block_size=8), outer("dense"), strict=True):
        ref.assert_grad_close(a, np.asarray(w, np.float64), jnp.float32)


def test_dropout_vmapped_equals_a_loop():
    """vmap over q and the dropout key (each index its own draw), and over q alone (one draw): as a loop of calls."""
    n, lq, T, S, D = 3, (2, 2), 9, 11, 8
    q = _rand((n, *lq, T, D), 0, jnp.float32)
    k, v = _rand((*lq, S, D), 1, jnp.float32), _rand((*lq, S, D), 2, jnp.float32)
    keys = jax.random.split(jax.random.key(7), n)

    def f(q, key):
        return jattn.attention(
            q, k, v, mask=masks.causal(), dropout_rate=_RATE, dropout_rng=key, implementation="pallas", block_size=8
        )

    each, one = jax.jit(jax.vmap(f))(q, keys), jax.jit(jax.vmap(f, (0, None)))(q, keys[0])
    call = jax.jit(f)  # one program for the loop's calls
    for mapped, rng in ((each, keys), (one, [keys[0]] * n)):
        for i in range(n):
            np.testing.assert_allclose(mapped[i], call(q[i], rng[i]), **ref.tol(jnp.float32))
    assert not np.allclose(each[1], one[1])


def test_second_order_of_a_vmapped_call_equals_the_dense_paths():
    """grad of grad of vmap: the folded rows' second-order terms map the dense path over the copies vmap folded in."""
    q = _rand((3, 2, 2, 9, 8), 0, jnp.float32)

    def second(impl, **kw):
        def one(q):
            return jnp.sum(jnp.sin(jattn.attention(q, q, q, mask=masks.causal(), implementation=impl, **kw)))

        def loss(q):
            return jnp.sum(jax.grad(lambda q: jnp.sum(jax.vmap(one)(q)))(q) ** 2)

        return jax.jit(jax.grad(loss))(q)

    ref.assert_grad_close(second("pallas", block_size=8), ref.f64(second("dense")), jnp.float32)


def test_second_order_with_a_batched_mask_inside_and_outside_vmap_is_dense():
    """A vmap mapping the mask's arrays, inside the derivatives (its copies folded into the kernel's rows,
    the reference path reading the folded arrays) or over the second-order function, equals the dense path's
    in float64 (each one program; the ids closed over, as constants)."""
    q = _rand((3, 2, 2, 9, 8), 0, jnp.float32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 2, size=(3, 2, 9)))

    def one(impl, q, ids):
        kw = dict(block_size=8) if impl == "pallas" else {}
        mask = masks.causal() & masks.segment_ids(ids, ids)
        return jnp.sum(jnp.sin(jattn.attention(q, q, q, mask=mask, implementation=impl, **kw)))

    def outside(impl, q):
        return jax.vmap(jax.grad(lambda q, ids: jnp.sum(jax.grad(one, argnums=1)(impl, q, ids) ** 2)))(q, ids)

    def inside(impl, q):
        def loss(q):
            return jnp.sum(jax.grad(lambda q: jnp.sum(jax.vmap(lambda q, i: one(impl, q, i))(q, ids)))(q) ** 2)

        return jax.grad(loss)(q)

    for second in (outside, inside):
        got = jax.jit(functools.partial(second, "pallas"))(q)
        with jax.enable_x64(True):
            want = np.asarray(jax.jit(functools.partial(second, "dense"))(jnp.asarray(ref.f64(q))))
        ref.assert_grad_close(got, want, jnp.float32)
