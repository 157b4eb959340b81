"""The fused CPU kernels (jattn/_blockwise/fused_cpu.cc) that blockwise attention runs on CPU for key-interval masks.

Through the public API: which calls take them (the custom calls in the jaxpr), the forward's values, lse
and max logit, its backward and tangents against the float64 reference on odd sizes that cross the
kernels' 256-row and 512-key blocks, NaN propagation and rows without keys, vmap, the calls that keep
XLA's tiles, the same bits on 1, 2 and 5 threads, the other vector layers of the same source (scalar,
AVX2) against this machine's build, and the aarch64 (NEON) build compiled with a cross compiler.
Skipped where the kernels cannot run (no g++, or a CPU with none of their vector layers).
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks, score_mods
from tests import reference as ref

TARGET = "jattn_fused_forward"
ROOT = pathlib.Path(__file__).parent.parent


def _fused(fn, *args) -> bool:
    return TARGET in str(jax.make_jaxpr(fn)(*args))


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def _kernels_run_here() -> bool:
    if jax.default_backend() != "cpu" or shutil.which("g++") is None:
        return False
    q = jnp.zeros((1, 8, 4))
    return _fused(lambda q: jattn.attention(q, q, q, implementation="blockwise"), q)


pytestmark = pytest.mark.skipif(
    not _kernels_run_here(), reason="the fused CPU kernels need a CPU backend, g++ and AVX-512, AVX2 + FMA or NEON"
)


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _close(got, want, dtype):
    got, want = ref.f64(got), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(
        np.where(np.isneginf(got), 0, got), np.where(np.isneginf(want), 0, want), **ref.tol(dtype)
    )


CASES = {  # mask, (T, S), q_offset, kv_offset, dtype, (lead of q, lead of k and v), (D, E)
    "none, odd sizes, E != D": (None, (37, 53), None, 0, jnp.float32, ((2, 3), (2, 3)), (13, 7)),
    "causal, several key and row blocks": (masks.causal(), (300, 1100), None, 0, jnp.float32, ((3,), (3,)), (16, 9)),
    "causal, rows without keys": (masks.causal(), (290, 130), None, 0, jnp.float32, ((2,), (2,)), (8, 8)),
    "window, shared kv head": (masks.sliding_window(5, 3), (150, 150), None, 0, jnp.float32, ((2, 3), (2, 1)), (6, 5)),
    "causal & window, offsets": (
        masks.causal() & masks.sliding_window(40),
        (70, 600),
        530,
        3,
        jnp.float32,
        ((2,), (2,)),
        (8, 8),
    ),
    "padding, an example without queries, T != S": (
        masks.padding(q_lengths=np.array([250, 0]), kv_lengths=np.array([530, 77])),
        (270, 530),
        None,
        0,
        jnp.float32,
        ((2, 3), (2, 3)),
        (8, 5),
    ),
    "packed documents, causal, an id that returns": (
        masks.causal() & masks.segment_ids(np.array([[0] * 70 + [1] * 333 + [2] * 160 + [1] * 37, [5] * 600])),
        (600, 600),
        None,
        0,
        jnp.float32,
        ((2, 1), (2, 1)),
        (8, 8),
    ),
    "packed documents & window & padding, T != S": (
        masks.sliding_window(90, 40)
        & masks.segment_ids(
            np.repeat(np.arange(3), [100, 120, 50])[None], np.repeat(np.arange(3), [200, 300, 30])[None]
        )
        & masks.padding(kv_lengths=np.array([500])),
        (270, 530),
        None,
        0,
        jnp.float32,
        ((1, 2), (1, 2)),
        (6, 7),
    ),
    "bfloat16": (masks.causal(), (130, 130), None, 0, jnp.bfloat16, ((2,), (2,)), (8, 8)),
    "float16": (None, (70, 530), None, 0, jnp.float16, ((2,), (2,)), (8, 8)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_fused_forward_matches_float64(case):
    mask, (T, S), q_offset, kv_offset, dtype, (lq, lk), (D, E) = case
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lk, S, D), 1, dtype), _rand((*lk, S, E), 2, dtype)
    kw = dict(mask=mask, q_offset=q_offset, kv_offset=kv_offset, scale=0.6, implementation="blockwise")

    def call(q, k, v):
        return jattn.attention(q, k, v, return_lse=True, return_max_logit=True, **kw)

    assert _fused(call, q, k, v)
    out, lse, top = jax.jit(call)(q, k, v)
    dense = None if mask is None else np.asarray(mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset))
    want, _, want_lse, want_top = ref.attention(q, k, v, dense, scale=0.6, stats=True)
    assert out.dtype == dtype and lse.dtype == top.dtype == jnp.float32
    _close(out, want, dtype)
    _close(lse, want_lse, jnp.float32)
    _close(top, want_top * np.ones_like(want_lse), jnp.float32)


@functools.cache
def _tangent_reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    """JAX's jvp of the float64 dense reference on case ``name``'s inputs and tangents: ``(d out, d lse)``, once a
    case (both forms of :func:`test_the_fused_tangent_matches_float64` compare with it)."""
    mask, (T, S), q_offset, kv_offset, dtype, (lq, lk), (D, E) = CASES[name]
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lk, S, D), 1, dtype), _rand((*lk, S, E), 2, dtype)
    t = (_rand((*lq, T, D), 3, dtype), _rand((*lk, S, D), 4, dtype), _rand((*lk, S, E), 5, dtype))
    keep = None if mask is None else np.asarray(mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset))
    with jax.enable_x64(True):
        up = tuple(jnp.asarray(ref.f64(x)) for x in (q, k, v, *t))
        _, (d_out, d_lse) = jax.jit(lambda a, t: jax.jvp(lambda q, k, v: ref.dense_jax(q, k, v, keep=keep), a, t))(
            up[:3], up[3:]
        )
        return np.asarray(d_out), np.asarray(d_lse)


@pytest.mark.parametrize("form", ["jvp", "linearize"])
@pytest.mark.parametrize("name", CASES)
def test_the_fused_tangent_matches_float64(name, form):
    """Forward mode where the forward is the kernel's, against JAX's jvp of the float64 dense reference (rows
    without keys: tangent 0; 16-bit inputs): jvp runs the forward and the tangent in one pass (its primal is the
    forward's, bit for bit); linearize's linear map the tangent with the lse known (each kernel's custom call
    in its program)."""
    mask, (T, S), q_offset, kv_offset, dtype, (lq, lk), (D, E) = CASES[name]
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lk, S, D), 1, dtype), _rand((*lk, S, E), 2, dtype)
    t = (_rand((*lq, T, D), 3, dtype), _rand((*lk, S, D), 4, dtype), _rand((*lk, S, E), 5, dtype))
    kw = dict(mask=mask, q_offset=q_offset, kv_offset=kv_offset, implementation="blockwise", return_lse=True)

    def f(q, k, v):
        return jattn.attention(q, k, v, **kw)

    if form == "jvp":
        jvp = jax.jit(lambda q, k, v, *t: jax.jvp(f, (q, k, v), t))
        assert "custom_call @jattn_fused_forward_tangent" in jvp.lower(q, k, v, *t).as_text()
        primal, (d_out, d_lse) = jvp(q, k, v, *t)
        for got, want in zip(primal, jax.jit(f)(q, k, v), strict=True):
            np.testing.assert_array_equal(got, want)
    else:
        primal, linear = jax.linearize(f, q, k, v)
        linear = jax.jit(linear)  # the linear map as one program
        assert "custom_call @jattn_fused_tangent(" in linear.lower(*t).as_text()
        d_out, d_lse = linear(*t)
    lse = np.asarray(primal[1])
    want_out, want_lse = _tangent_reference(name)
    assert d_out.dtype == dtype and d_lse.dtype == jnp.float32
    ref.assert_grad_close(d_out, want_out, dtype)
    ref.assert_grad_close(d_lse, np.where(np.isneginf(lse), 0, want_lse), dtype)
    assert np.all(np.asarray(d_lse)[np.isneginf(lse)] == 0) and np.all(np.asarray(d_out)[np.isneginf(lse)] == 0)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_fused_backward_matches_float64(case):
    """Reverse mode where the forward is the kernel's: the fused backward (its custom call in grad's program)
    against JAX's gradient of the float64 dense reference, the lse's cotangent included (rows without keys: 0)."""
    mask, (T, S), q_offset, kv_offset, dtype, (lq, lk), (D, E) = case
    q, k, v = _rand((*lq, T, D), 0, dtype), _rand((*lk, S, D), 1, dtype), _rand((*lk, S, E), 2, dtype)
    d_out, d_lse = _rand((*lq, T, E), 3), _rand((*lq, T), 4)
    kw = dict(mask=mask, q_offset=q_offset, kv_offset=kv_offset, implementation="blockwise", return_lse=True)

    def loss(f):
        def scalar(q, k, v):
            out, lse = f(q, k, v)
            lse = jnp.where(jnp.isfinite(lse), lse, jnp.zeros_like(lse))
            wide = jnp.float64 if out.dtype == jnp.float64 else jnp.float32  # float64: the reference
            return jnp.sum(out.astype(wide) * d_out.astype(wide)) + jnp.sum(lse.astype(wide) * d_lse.astype(wide))

        return jax.grad(scalar, argnums=(0, 1, 2))

    ours = loss(lambda q, k, v: jattn.attention(q, k, v, **kw))
    assert "custom_call @jattn_fused_backward" in jax.jit(ours).lower(q, k, v).as_text()
    keep = None if mask is None else np.asarray(mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset))
    got = jax.jit(ours)(q, k, v)
    with jax.enable_x64(True):
        want = jax.jit(loss(lambda q, k, v: ref.dense_jax(q, k, v, keep=keep)))(
            *(jnp.asarray(ref.f64(x)) for x in (q, k, v))
        )
    for g, w, x in zip(got, want, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
        ref.assert_grad_close(g, w, dtype)


def test_nan_propagates_and_rows_without_keys_are_zero():
    """A NaN in q spoils its row; one in k the rows that see that key; rows with no key give 0, lse and max -inf."""
    T, S = 300, 90
    q, k, v = np.array(_rand((2, T, 16), 0)), np.array(_rand((2, S, 16), 1)), _rand((2, S, 16), 2)
    q[0, 250, 3] = np.nan
    k[1, 40, 0] = np.nan

    def call(q, k, v):
        return jattn.attention(
            q, k, v, mask=masks.causal(), return_lse=True, return_max_logit=True, implementation="blockwise"
        )

    assert _fused(call, q, k, v)
    out, lse, top = map(np.asarray, call(q, k, v))
    first = T - S  # bottom-right alignment: row t sees keys <= t - (T - S)
    primal, tangent = jax.jvp(call, (q, k, v), (q, k, v))  # jvp's one pass: the forward's values, NaN where it has NaN
    for got, want in zip(primal, (out, lse, top), strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.all(tangent[0][:, :first] == 0) and np.all(tangent[1][:, :first] == 0)
    sees_nan_key = np.arange(T) - first >= 40
    np.testing.assert_array_equal(np.isnan(out[0]).any(-1), np.arange(T) == 250)
    np.testing.assert_array_equal(np.isnan(out[1]).any(-1), sees_nan_key)
    for x in (lse, top):
        np.testing.assert_array_equal(np.isnan(x), np.stack([np.arange(T) == 250, sees_nan_key]))
    assert np.all(out[:, :first] == 0) and np.all(np.isneginf(lse[:, :first])) and np.all(np.isneginf(top[:, :first]))
    dense = np.asarray(masks.causal().dense(T, S))
    want, _, want_lse = ref.attention(q[0, first:250], k[0], v[0], dense[first:250])
    np.testing.assert_allclose(out[0, first:250], want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(lse[0, first:250], want_lse, **ref.tol(jnp.float32))


def test_vmap_folds_into_the_fused_call():
    q, k, v = _rand((3, 2, 140, 8), 0), _rand((3, 2, 530, 8), 1), _rand((3, 2, 530, 8), 2)

    def call(q, k, v):
        return jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise")

    assert _fused(jax.vmap(call), q, k, v)
    looped = jnp.stack([call(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_allclose(jax.jit(jax.vmap(call))(q, k, v), looped, rtol=1e-6, atol=1e-6)


def test_packed_documents_fold_under_vmap_and_export_keeps_their_mask():
    """Segment ids mapped by vmap fold into the kernels' rows (values and gradients as a loop); jax.export of grad
    (XLA's tiles there: the mask's arrays go with it) gives jit's values and carries no custom call."""
    T = 140
    q, k, v = _rand((3, 2, T, 8), 0), _rand((3, 2, T, 8), 1), _rand((3, 2, T, 8), 2)
    docs = [np.repeat(np.arange(4), [30, 50, 40, 20]), np.repeat([7, 3, 7], [60, 40, 40]), np.zeros(T, int)]
    seg = jnp.asarray(np.stack(docs), jnp.int32)

    def call(q, k, v, seg):
        return jattn.attention(q, k, v, mask=masks.causal() & masks.segment_ids(seg[None]), implementation="blockwise")

    def grad(q, k, v, seg):
        return jax.grad(lambda q, k, v: jnp.sum(call(q, k, v, seg) * v), argnums=(0, 1, 2))(q, k, v)

    assert _fused(jax.vmap(call), q, k, v, seg)
    for f in (call, grad):
        looped = [jax.jit(f)(q[i], k[i], v[i], seg[i]) for i in range(3)]  # one program for the loop's calls
        mapped = jax.jit(jax.vmap(f))(q, k, v, seg)
        want = jax.tree.map(lambda *xs: jnp.stack(xs), *looped)
        for a, b in zip(jax.tree.leaves(mapped), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, **ref.tol(jnp.float32))  # jax 0.11.2 folds them 2e-6 apart
    args = (q[1], k[1], v[1], seg[1])
    exported = jax.export.export(jax.jit(grad))(*args)
    assert "custom_call @jattn_fused" not in exported.mlir_module()
    for a, b in zip(exported.call(*args), jax.jit(grad)(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_heads_read_k_and_v_unrepeated():
    """q (B, K, G, T, D) with k, v (B, K, 1, S, ·): the kernels take k and v with B·K rows (no copy per query head),
    forward, gradient (dk, dv summed over each group's heads by the kernel), vmap and a second-order product agree
    with the dense path."""
    B, K, G, T, S = 2, 3, 4, 130, 290
    q, k, v = _rand((B, K, G, T, 8), 0), _rand((B, K, 1, S, 8), 1), _rand((B, K, 1, S, 5), 2)
    w = _rand((B, K, G, T, 5), 3)

    def attend(implementation):
        def f(q, k, v):
            return jattn.attention(q, k, v, mask=masks.causal(), implementation=implementation)

        return f

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * w)

    fused, dense = attend("blockwise"), attend("dense")
    program = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    calls = [line for line in program.splitlines() if "custom_call @jattn_fused" in line]
    assert calls and all(f"tensor<{B * K}x" in line and f"tensor<{B * K * G}x" in line for line in calls)
    t = (_rand(q.shape, 4), _rand(k.shape, 5), _rand(v.shape, 6))

    @jax.jit
    def dense_path(q, k, v, t):  # the dense path's forward, gradient and second-order product: one program
        grad = jax.grad(loss(dense), argnums=(0, 1, 2))
        return dense(q, k, v), grad(q, k, v), jax.jvp(grad, (q, k, v), t)[1]

    want_out, want_grads, want_hvp = dense_path(q, k, v, t)
    np.testing.assert_allclose(jax.jit(fused)(q, k, v), want_out, **ref.tol(jnp.float32))
    grads = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, want_grads, strict=True):
        ref.assert_grad_close(got, want, jnp.float32)
    mapped = jax.jit(jax.vmap(jax.grad(loss(fused), argnums=(0, 1, 2))))(q[None], k[None], v[None])
    for got, want in zip(mapped, grads, strict=True):
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    hvp = jax.jit(lambda q, k, v, t: jax.jvp(jax.grad(loss(fused), argnums=(0, 1, 2)), (q, k, v), t)[1])(q, k, v, t)
    for got, want in zip(hvp, want_hvp, strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


def test_document_ids_compare_whole_under_x64():
    """int64 ids that agree in their low 32 bits are still different documents (the kernels compare int32 keys
    derived from the ids, not the ids cut to int32)."""
    with jax.enable_x64(True):
        T = 300
        q, k, v = _rand((1, 2, T, 8), 0), _rand((1, 2, T, 8), 1), _rand((1, 2, T, 8), 2)
        ids = jnp.asarray(np.where(np.arange(T) < 150, 0, 2**32)[None], jnp.int64)
        for mask in (masks.segment_ids(ids), masks.segment_ids(ids[:, ::-1])):  # in order; not (the sorting path)
            call = lambda q, k, v, mask=mask: jattn.attention(q, k, v, mask=mask, implementation="blockwise")  # noqa: E731
            assert _fused(call, q, k, v)
            keep = np.asarray(mask.dense(T, T))
            want = ref.attention(q, k, v, keep)[0]
            np.testing.assert_allclose(jax.jit(call)(q, k, v), want, **ref.tol(jnp.float32))


def test_the_default_path_takes_it_from_auto_blockwise_sizes():
    q = _rand((1, 1, 1024, 8), 0)
    call = lambda q: jattn.attention(q, q, q, mask=masks.causal())  # noqa: E731
    assert jattn.choose_implementation(q, q, q, mask=masks.causal()) == "blockwise"
    assert _fused(call, q)


KEEP_XLA = {
    "float64": (dict(), jnp.float64),
    "explicit block_size": (dict(block_size=(64, 64)), jnp.float32),
    "bias": (dict(bias=jnp.zeros((70, 90))), jnp.float32),
    "score_mod": (dict(score_mod=score_mods.softcap(30.0)), jnp.float32),
    "sinks": (dict(sinks=jnp.zeros(())), jnp.float32),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), jnp.float32),
    "precision": (dict(precision="highest"), jnp.float32),
    "global tokens": (dict(mask=masks.global_tokens([3])), jnp.float32),
    "array mask": (dict(mask=jnp.ones((70, 90), bool)), jnp.float32),
    "prefix_lm": (dict(mask=masks.prefix_lm(20)), jnp.float32),
    "segment_ids | causal": (
        dict(mask=masks.segment_ids(jnp.zeros((2, 70), jnp.int32), jnp.zeros((2, 90), jnp.int32)) | masks.causal()),
        jnp.float32,
    ),
}


@pytest.mark.parametrize("case", KEEP_XLA.values(), ids=KEEP_XLA.keys())
def test_what_the_kernel_does_not_serve_keeps_xla_tiles(case):
    """Each of these calls, without its one argument, takes the kernel (the tests above); with it, XLA's tiles."""
    kw, dtype = case
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v = _rand((2, 70, 8), 0, dtype), _rand((2, 90, 8), 1, dtype), _rand((2, 90, 8), 2, dtype)
        call = lambda q, k, v: jattn.attention(q, k, v, implementation="blockwise", **kw)  # noqa: E731
        assert not _fused(call, q, k, v)


def test_jattn_fused_cpu_0_switches_it_off(monkeypatch):
    """Read at trace time (a new function here: JAX caches the trace of the old one)."""
    q = _rand((2, 70, 8), 0)
    assert _fused(lambda q: jattn.attention(q, q, q, implementation="blockwise"), q)
    monkeypatch.setenv("JATTN_FUSED_CPU", "0")
    assert not _fused(lambda q: jattn.attention(q, q, q, implementation="blockwise"), q)


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    """Each task is computed whole by one thread: 1, 2 or 5 threads give the same bits (forward, jvp, grad)."""
    import jattn._platform as platform_facts

    q, k, v = _rand((3, 2, 600, 8), 0), _rand((3, 2, 700, 8), 1), _rand((3, 2, 700, 8), 2)
    outs = []

    def call(q, k, v):  # traced anew each time round: the thread count is read at trace time
        return jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise")

    for threads in (1, 2, 5):
        monkeypatch.setattr(platform_facts, "cpu_threads", lambda threads=threads: threads)
        assert _fused(call, q, k, v)
        grads = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v) * q), argnums=(0, 1, 2))(q, k, v)
        jvp = jax.jvp(call, (q, k, v), (v[..., :600, :], k, v))  # jvp's one pass
        outs.append([call(q, k, v), *jvp, *grads])
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


@functools.cache  # this process's build: computed once for every other layer's comparison
def _layer_case() -> list[np.ndarray]:
    """Forward (out, lse), jvp's tangents and grad of a causal sliding-window call crossing every block, as numpy."""
    T, S = 300, 530
    q, k, v = _rand((2, 3, T, 13), 0), _rand((2, 3, S, 13), 1), _rand((2, 3, S, 7), 2)
    t = (_rand((2, 3, T, 13), 3), _rand((2, 3, S, 13), 4), _rand((2, 3, S, 7), 5))
    kw = dict(mask=masks.causal() & masks.sliding_window(200), implementation="blockwise", return_lse=True)

    def f(q, k, v):
        return jattn.attention(q, k, v, **kw)

    def loss(q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(out * t[0][..., :7]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, jnp.zeros_like(lse)))

    primal, tangent = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(q, k, v, *t)
    return [np.asarray(x) for x in (*primal, *tangent, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))]


@pytest.mark.parametrize("layer", ["scalar", "avx2"])
def test_every_vector_layer_gives_this_builds_values(layer, tmp_path):
    """The same source built for another vector layer (JATTN_FUSED_ISA: plain C++, the reference build; AVX2 + FMA,
    what an AVX2-only CPU runs, also on an AVX-512 one) in a subprocess: forward, jvp and grad agree with this
    process's build within float32's tolerance."""
    if layer == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    code = f"""import logging, numpy as np
logging.basicConfig(level=logging.INFO)
from tests.test_fused_cpu import _layer_case
np.savez({str(tmp_path / "theirs.npz")!r}, *_layer_case())"""
    env = {**os.environ, "JATTN_FUSED_ISA": layer}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"fused CPU kernels, {layer} layer" in done.stderr  # built and run for that layer
    with np.load(tmp_path / "theirs.npz") as theirs:
        for i, ours in enumerate(_layer_case()):
            got, want = theirs[f"arr_{i}"], ours
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
            ref.assert_grad_close(np.where(np.isneginf(got), 0, got), np.where(np.isneginf(want), 0, want), jnp.float32)


def test_the_neon_layer_compiles_for_aarch64(tmp_path):
    """The source cross-compiled for aarch64 Linux (zig's clang, from the ziglang wheel): it builds, and the vector
    layer it picks is NEON (the layer's name and NEON fused multiply-adds on vector registers in the assembly)."""
    pytest.importorskip("ziglang", reason="the cross compiler comes with the dev extra's ziglang")
    source = ROOT / "jattn" / "_blockwise" / "fused_cpu.cc"
    asm = tmp_path / "fused_cpu_aarch64.s"
    flags = ["-target", "aarch64-linux-gnu", "-O3", "-ffp-contract=off", "-std=c++17", "-fPIC"]
    command = [sys.executable, "-m", "ziglang", "c++", *flags, f"-I{jax.ffi.include_dir()}", "-S", str(source)]
    done = subprocess.run([*command, "-o", str(asm)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = asm.read_text(errors="replace")
    assert '"neon"' in text and "fmla\tv" in text
