"""jattn's GPU kernel on Pallas' Mosaic GPU backend (Hopper sm_90), in Mosaic GPU's interpret mode and lowered for CUDA.

JAX deprecated the Pallas Triton backend (0.11+); the Mosaic GPU kernels (:mod:`jattn._gpu.mosaic_kernels`:
TMA copies into shared memory, ``wgmma`` products, 64 by 64 tiles) read the Triton kernel's operands (tile
kinds and bounds, the mask's arrays, sinks). Values, the log-sum-exp and the max logit against the float64
references of tests/reference.py, through ``jattn.attention(..., implementation="pallas")``: every mask kind
the kernel reads per tile (causal, a sliding window with static offsets, segment ids with padding), grouped
heads with distinct sizes (B != N != G != T != S, T and S not multiples of 64 so EMPTY tiles are skipped and
PARTIAL ones masked), head dims 64, 128 and padded ones (40, 24), sinks, bfloat16 and float16. What it does
not take is refused by name. Interpreting needs jax 0.12 (jax 0.10's Mosaic GPU interpreter has no register
layouts): those tests skip on older JAX; the lowering tests run on both.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._paths.pallas as pallas_path
import jattn._platform as platform_facts
from jattn import masks, score_mods
from jattn._checks import KernelRefusalError
from jattn._gpu import gpu_attention, mosaic_support
from tests import reference as ref
from tests.cuda_lowering import cuda_text

INTERPRETS = jax.__version_info__ >= (0, 12)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETS, reason=f"Mosaic GPU's interpreter runs jattn's kernel from jax 0.12 (here {jax.__version__})"
)


@pytest.fixture(autouse=True)
def mosaic_gpu(monkeypatch):
    """The GPU kernel on its Mosaic GPU backend.

    Until the automatic choice by compute capability (sm_90 / sm_100: Mosaic GPU) is wired into
    jattn._paths.pallas, the path's entry is the face's gpu_attention with backend="mosaic_gpu".
    """
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend="mosaic_gpu"))


def _rand(shape, seed, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


_T, _S = 130, 150
_IDS_Q = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [50, 45, 35], axis=1)  # (B=2, T): documents
_IDS_KV = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [60, 50, 40], axis=1)  # (B=2, S)

CASES = {
    # name: (mask, kw, q lead, kv lead, D, E, dtype, scale)
    "causal-gqa-bf16": (masks.causal(), {}, (2, 3, 2), (2, 3, 1), 64, 64, jnp.bfloat16, 0.2),
    "window-offsets-f16-depth-128": (
        masks.sliding_window(40) & masks.causal(),
        dict(q_offset=30, kv_offset=10),
        (3, 2),
        (3, 2),
        128,
        128,
        jnp.float16,
        None,
    ),
    "segments-padding-causal-gqa-depth-40": (
        masks.segment_ids(_IDS_Q, _IDS_KV) & masks.padding(kv_lengths=np.array([140, 0])) & masks.causal(),
        {},
        (2, 3),
        (2, 1),
        40,
        24,
        jnp.float16,
        None,
    ),
}


def _dense(mask, kw, lq):
    """The mask as an explicit boolean array against q's leading dims (per example: (B, 1, ..., T, S))."""
    dense = np.asarray(mask.dense(_T, _S, **kw))
    return dense.reshape(dense.shape[0], *(1,) * (len(lq) - 1), _T, _S) if dense.ndim == 4 else dense


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_values_lse_and_max_logit_equal_the_reference(case):
    """Out, the log-sum-exp and the max logit against float64 NumPy (GQA: k, v read by row, never repeated)."""
    mask, kw, lq, lkv, D, E, dtype, scale = CASES[case]
    q, k, v = _rand((*lq, _T, D), 0, dtype), _rand((*lkv, _S, D), 1, dtype), _rand((*lkv, _S, E), 2, dtype)

    def f(q, k, v):
        return jattn.attention(
            q, k, v, mask=mask, scale=scale, implementation="pallas", return_lse=True, return_max_logit=True, **kw
        )

    out, lse, top = jax.jit(f)(q, k, v)
    want, _, want_lse, want_top = ref.attention(
        q, k, v, _dense(mask, kw, lq), None, scale, q_offset=kw.get("q_offset"), stats=True
    )
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **ref.tol(dtype))
    np.testing.assert_allclose(np.asarray(top), want_top, **ref.tol(dtype))
    assert np.isneginf(want_lse).any() == (
        "segments" in case
    )  # a row with no key (kv length 0): -inf, as the reference


@needs_interpreter
def test_sinks_join_every_row():
    """Sinks (one per head) in every row's denominator: out, lse, dq, dk, dv and d sinks against float64 NumPy."""
    q, k, v = (
        _rand((2, 3, _T, 64), 0, jnp.bfloat16),
        _rand((2, 3, _S, 64), 1, jnp.bfloat16),
        _rand((2, 3, _S, 64), 2, jnp.bfloat16),
    )
    sinks = _rand((3,), 4, jnp.float32) + 2.0  # large enough to move the weights
    g = np.random.default_rng(3).normal(size=(2, 3, _T, 64))

    def loss(q, k, v, sinks):
        out, lse = jattn.attention(q, k, v, sinks=sinks, implementation="pallas", return_lse=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), (out, lse)

    ((_, (out, lse)), grads) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    want, _, want_lse = ref.attention(q, k, v, sinks=sinks)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **ref.tol(jnp.bfloat16))
    wants = ref.attention_grads(q, k, v, g, sinks=sinks)
    for got, w in zip(grads, (*wants[:3], wants[4]), strict=True):
        ref.assert_grad_close(got, w, jnp.bfloat16)


@needs_interpreter
def test_softcap_values_and_gradients():
    """A soft cap in the kernel (tanh of whole tiles): out, dq, dk, dv against float64 NumPy, a sliding window."""
    q, k, v = (
        _rand((2, 3, _T, 64), 0, jnp.float16) * 3,
        _rand((2, 3, _S, 64), 1, jnp.float16),
        _rand((2, 3, _S, 64), 2, jnp.float16),
    )
    g = np.random.default_rng(3).normal(size=(2, 3, _T, 64))
    mask = masks.sliding_window(60)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, score_mod=score_mods.softcap(2.5), implementation="pallas")
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    dense = np.asarray(mask.dense(_T, _S))
    want, _, _ = ref.attention(q, k, v, dense, score_mod=lambda s, *_: 2.5 * np.tanh(s / 2.5))
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float16))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, softcap=2.5)[:3], strict=True):
        ref.assert_grad_close(got, w, jnp.float16)


@needs_interpreter
def test_alibi_values_and_gradients_in_its_slopes():
    """ALiBi (a slope per head, read per row): out, dq, dk, dv and d slopes against float64 JAX (dense, a bias)."""
    q, k, v = (
        _rand((2, 3, 2, _T, 64), 0, jnp.bfloat16),
        _rand((2, 3, 1, _S, 64), 1, jnp.bfloat16),
        _rand((2, 3, 1, _S, 64), 2, jnp.bfloat16),
    )
    slopes = jnp.asarray([0.05, 0.1, 0.2, 0.3, 0.5, 0.8], jnp.float32)  # (K G,) heads
    g = np.random.default_rng(3).normal(size=(2, 3, 2, _T, 64))
    keep = np.asarray(masks.causal().dense(_T, _S, q_offset=0))  # query t at position t: the distances below

    def loss(f, q, k, v, slopes):
        return jnp.sum(f(q, k, v, slopes).astype(ref.wide()) * jnp.asarray(g, ref.wide()))

    def kernel(q, k, v, slopes):
        alibi = score_mods.alibi(slopes)
        return jattn.attention(q, k, v, mask=masks.causal(), q_offset=0, score_mod=alibi, implementation="pallas")

    def dense(q, k, v, slopes):
        distance = jnp.asarray(np.abs(np.arange(_T)[:, None] - np.arange(_S)[None, :]), slopes.dtype)
        return ref.dense_jax(q, k, v, keep=keep, bias=-slopes.reshape(1, 3, 2, 1, 1) * distance[None, None, None])[0]

    got = jax.jit(jax.value_and_grad(functools.partial(loss, kernel), argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    with jax.enable_x64(True):
        wide = tuple(jnp.asarray(ref.f64(x)) for x in (q, k, v, slopes))
        want = jax.jit(jax.value_and_grad(functools.partial(loss, dense), argnums=(0, 1, 2, 3)))(*wide)
        out = dense(*wide)
    np.testing.assert_allclose(ref.f64(kernel(q, k, v, slopes)), np.asarray(out), **ref.tol(jnp.bfloat16))
    for a, w in zip(got[1], want[1], strict=True):
        ref.assert_grad_close(a, np.asarray(w), jnp.bfloat16)


@needs_interpreter
@pytest.mark.parametrize("backend", ["mosaic_gpu", "mosaic_gpu_tcgen05"])
def test_no_data_race_in_shared_memory(monkeypatch, backend):
    """Mosaic GPU's interpreter checking every shared-memory access (TMA, products, loads) for races: none.

    Forward, dq, dk/dv, the one-pass and the two-pass tangent, with segment ids (their windows reloaded per tile),
    ALiBi and dropout; the interpreter raises at the first race.
    """
    monkeypatch.setattr(mosaic_support, "DETECT_RACES", True)
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend=backend))
    T = 130 if backend == "mosaic_gpu" else 260  # three query blocks either way
    q, k, v = (
        _rand((1, 2, 2, T, 64), 0, jnp.bfloat16),
        _rand((1, 2, 1, T, 64), 1, jnp.bfloat16),
        _rand((1, 2, 1, T, 64), 2, jnp.bfloat16),
    )
    ids = np.repeat(np.array([[0, 1]]), [T // 2, T - T // 2], axis=1)
    kw = dict(
        mask=masks.causal() & masks.segment_ids(ids, ids),
        score_mod=score_mods.alibi(jnp.ones(4)),
        dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
    )
    f = functools.partial(jattn.attention, implementation="pallas", **kw)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))(q, k, v)
    one_pass = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), (q, k, v))
    two_pass = jax.jit(lambda a, t: jax.linearize(f, *a)[1](*t))((q, k, v), (q, k, v))
    for x in jax.tree.leaves((grads, one_pass, two_pass)):
        assert np.isfinite(ref.f64(x)).all()


@needs_interpreter
@pytest.mark.parametrize(("backend", "block"), [("mosaic_gpu", 64), ("mosaic_gpu_tcgen05", 128)])
def test_the_forward_copies_ahead_past_empty_tiles_inside_its_bounds(monkeypatch, backend, block):
    """A document that resumes after another (ids 0, 1, 0): the last query block's key tiles are non-empty,
    EMPTY, EMPTY, EMPTY, then its diagonal. The forward copies each block's k and v a step ahead and skips
    EMPTY ones (neither copied nor awaited): out and lse against float64 NumPy, under the race detector."""
    monkeypatch.setattr(mosaic_support, "DETECT_RACES", True)
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend=backend))
    T = 5 * block
    ids = np.repeat(np.array([[0, 1, 0]]), [block, 3 * block, block], axis=1)
    mask = masks.causal() & masks.segment_ids(ids, ids)
    dense = np.asarray(mask.dense(T, T))
    last = dense[0, 0, -block:].reshape(block, 5, block).any(axis=(0, 2))  # (B, 1, T, S): per example
    assert last.tolist() == [True, False, False, False, True]  # EMPTY inside the bounds
    q, k, v = (_rand((1, 3, T, 64), n, jnp.bfloat16) for n in range(3))
    out, lse = jax.jit(functools.partial(jattn.attention, mask=mask, return_lse=True, implementation="pallas"))(q, k, v)
    want, _, want_lse = ref.attention(q, k, v, dense)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **ref.tol(jnp.bfloat16))


@needs_interpreter
def test_kernels_interpreted_at_once_equal_each_alone():
    """Two threads calling the kernel at once (as XLA runs independent kernels of one program, dq and dk/dv, side by
    side): each result equals the call alone. JAX's interpreter keeps its shared memory in one global that the
    kernel ending first clears; without jattn's lock 7 of these 8 calls failed."""
    qs = [_rand((1, 2, 130, 64), seed, jnp.bfloat16) for seed in (0, 1)]
    f = jax.jit(lambda q: jattn.attention(q, q, q, implementation="pallas"))
    alone = [np.asarray(f(q), np.float32) for q in qs]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(f, qs[n % 2]) for n in range(8)]
        for n, call in enumerate(calls):
            np.testing.assert_array_equal(np.asarray(call.result(), np.float32), alone[n % 2])


def test_an_unknown_backend_is_a_value_error_naming_it(monkeypatch):
    """gpu_attention's backend: 'triton' or a Mosaic GPU target; anything else a ValueError naming the argument."""
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend="mosaic"))
    q = _rand((2, 3, 70, 64), 0, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"backend must be 'triton' or one of .*'mosaic_gpu'.*got 'mosaic'"):
        jattn.attention(q, q, q, implementation="pallas")


@needs_interpreter
def test_grad_of_grad_equals_the_dense_path():
    """Second order: the kernels' derivatives differentiated through the reference path, as float64 dense's."""
    q, k, v = (
        _rand((2, 3, 70, 64), 0, jnp.float16),
        _rand((2, 3, 90, 64), 1, jnp.float16),
        _rand((2, 3, 90, 64), 2, jnp.float16),
    )

    def outer(implementation, q, k, v):
        def inner(*args):
            out = jattn.attention(*args, mask=masks.causal(), implementation=implementation)
            return jnp.sum(jnp.sin(out.astype(ref.wide())))

        def loss(q, k, v):
            dq, dk, dv = (d.astype(ref.wide()) for d in jax.grad(inner, argnums=(0, 1, 2))(q, k, v))
            return jnp.sum(dq**2) + jnp.sum(dk**2) + jnp.sum(jnp.sin(dv))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got = outer("pallas", q, k, v)
    with jax.enable_x64(True):
        want = outer("dense", *(jnp.asarray(ref.f64(x)) for x in (q, k, v)))
    for a, w in zip(got, want, strict=True):
        ref.assert_grad_close(a, np.asarray(w), jnp.float16)


_RATE = 0.3


def _drop_factor(lq, lkv, key, T=_T, S=_S, **kw):
    """The dropout factor Z ``(*lead, T, S)`` of a call (q = k = 0: weights 1 / S; v = I: weight s in out[..., s])."""
    q, k = jnp.zeros((*lq, T, 64), jnp.float16), jnp.zeros((*lkv, S, 64), jnp.float16)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float16), (*lkv, S, S))
    out = jattn.attention(q, k, v, dropout_rate=_RATE, dropout_rng=key, **kw)
    return np.asarray(out, np.float64) * S


@needs_interpreter
def test_dropout_drops_what_the_dense_path_drops_and_its_gradients():
    """The kernel's keep bits are the dense path's (grouped rows); out = (P ∘ Z) v, dq, dk, dv vs float64 NumPy."""
    lq, lkv, key = (2, 3, 2), (2, 3, 1), jax.random.key(11)
    want = _drop_factor(lq, lkv, key, implementation="dense")
    got = _drop_factor(lq, lkv, key, implementation="pallas")
    np.testing.assert_array_equal(got != 0, want != 0)
    assert 0.5 < np.mean(want != 0) < 0.9  # a real draw (keep_prob 0.7)
    q, k, v = (
        _rand((*lq, _T, 64), 0, jnp.float16),
        _rand((*lkv, _S, 64), 1, jnp.float16),
        _rand((*lkv, _S, 64), 2, jnp.float16),
    )
    g = np.random.default_rng(3).normal(size=(*lq, _T, 64))
    mask = masks.causal()
    drop = np.where(want != 0, 1 / (1 - _RATE), 0.0)

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, dropout_rate=_RATE, dropout_rng=key, implementation="pallas")
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    keep = np.asarray(mask.dense(_T, _S))
    _, w, _ = ref.attention(q, k, v, keep)
    np.testing.assert_allclose(ref.f64(out), np.matmul(w * drop, ref.f64(v)), **ref.tol(jnp.float16))
    for a, w in zip(grads, ref.attention_grads(q, k, v, g, keep, drop=drop)[:3], strict=True):
        ref.assert_grad_close(a, w, jnp.float16)


REFUSED = {
    # name: (call keywords, dtype, the words the refusal names)
    "float32": ({}, jnp.float32, "bfloat16 and float16, got float32: wgmma multiplies float32 as tf32"),
    "blocks": (dict(block_size=32), jnp.bfloat16, r"blocks \(64, 64\) only \(wgmma"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_kernel_cannot_take_is_refused_by_name(case):
    """float32 and other blocks: a KernelRefusalError naming the argument, before any kernel."""
    kw, dtype, words = REFUSED[case]
    q = _rand((2, 3, 70, 64), 0, dtype)
    with pytest.raises(KernelRefusalError, match=words):
        jattn.attention(q, q, q, implementation="pallas", **kw)


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_the_reference(case):
    """dq, dk and dv (the dq and dk/dv kernels; k, v unrepeated under GQA: their gradients sum the group)."""
    mask, kw, lq, lkv, D, E, dtype, scale = CASES[case]
    q, k, v = _rand((*lq, _T, D), 0, dtype), _rand((*lkv, _S, D), 1, dtype), _rand((*lkv, _S, E), 2, dtype)
    g = np.random.default_rng(3).normal(size=(*np.broadcast_shapes(lq, lkv), _T, E))

    def loss(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, scale=scale, implementation="pallas", **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    wants = ref.attention_grads(q, k, v, g, _dense(mask, kw, lq), None, scale)[:3]
    for got, want in zip(grads, wants, strict=True):
        assert got.shape == want.shape and got.dtype == dtype
        ref.assert_grad_close(got, want, dtype)


def _jvp_reference(mask, kw, lq, scale, args, tangents):
    """``((out, lse), (d out, d lse))``: jvp of float64 dense JAX (:func:`tests.reference.dense_jax`)."""
    D = args[0].shape[-1]
    with jax.enable_x64(True):
        wide = (scale or 1 / np.sqrt(D)) * np.sqrt(D)  # dense_jax scales by 1/sqrt(D)
        a = (jnp.asarray(ref.f64(args[0])) * wide, *(jnp.asarray(ref.f64(x)) for x in args[1:]))
        t = (jnp.asarray(ref.f64(tangents[0])) * wide, *(jnp.asarray(ref.f64(x)) for x in tangents[1:]))
        dense = _dense(mask, kw, lq)
        return jax.jit(lambda a, t: jax.jvp(lambda q, k, v: ref.dense_jax(q, k, v, keep=dense), a, t))(a, t)


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_jvp_and_linearize_equal_the_reference(case):
    """Forward mode: jvp (the forward and tangent in one kernel) and linearize (the tangent kernel from lse)."""
    mask, kw, lq, lkv, D, E, dtype, scale = CASES[case]
    args = (_rand((*lq, _T, D), 0, dtype), _rand((*lkv, _S, D), 1, dtype), _rand((*lkv, _S, E), 2, dtype))
    tangents = tuple(_rand(x.shape, 10 + n, dtype) for n, x in enumerate(args))

    def f(q, k, v):
        return jattn.attention(q, k, v, mask=mask, scale=scale, return_lse=True, implementation="pallas", **kw)

    one_pass = jax.jit(lambda a, t: jax.jvp(f, a, t))(args, tangents)
    two_pass = jax.jit(lambda a, t: jax.linearize(f, *a)[1](*t))(args, tangents)
    (want, want_lse), (d_want, d_want_lse) = _jvp_reference(mask, kw, lq, scale, args, tangents)
    seen = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(ref.f64(one_pass[0][0]), np.asarray(want), **ref.tol(dtype))
    for d_out, d_lse in (one_pass[1], two_pass):
        assert d_out.dtype == dtype and d_out.shape == want.shape and d_lse.dtype == jnp.float32
        ref.assert_grad_close(d_out, np.asarray(d_want), dtype)
        ref.assert_grad_close(np.where(seen, d_lse, 0), np.where(seen, np.asarray(d_want_lse), 0), dtype)


@pytest.mark.skipif(INTERPRETS, reason="jax 0.12+ interprets the Mosaic GPU kernel")
def test_interpreting_on_old_jax_is_refused_by_name():
    """jax 0.10: interpreting (no register layouts there) and the tcgen05 kernel (layouts it cannot lower): refused."""
    q = _rand((2, 3, 70, 64), 0, jnp.bfloat16)
    with pytest.raises(KernelRefusalError, match=r"interpreted on CPU from jax 0\.12"):
        jattn.attention(q, q, q, implementation="pallas")
    with pytest.MonkeyPatch.context() as m:  # Blackwell's tcgen05 kernel on a GPU: refused on old JAX, then Triton
        m.setattr(jax, "default_backend", lambda: "gpu")
        m.setattr(platform_facts, "compute_capability", lambda: 100)
        t5 = score_mods.relative_position_bias(jnp.ones((32, 3)))  # a gather: Triton refuses it too
        with pytest.raises(KernelRefusalError, match=r"tcgen05 kernel \(sm_100\) needs jax 0\.12.*triton: .*gather"):
            jax.jit(lambda q: jattn.attention(q, q, q, score_mod=t5, implementation="pallas")).trace(q)


LOWERED = {
    "window-softcap-dropout": dict(
        mask=masks.sliding_window(40),
        score_mod=score_mods.softcap(20.0),
        dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
    ),
    "alibi-causal": dict(mask=masks.causal(), score_mod=score_mods.alibi(jnp.linspace(0.1, 1.0, 6))),
    "causal-gqa-sinks": dict(mask=masks.causal(), sinks=jnp.ones((6,), jnp.float32)),
    "segments-padding": dict(
        mask=masks.segment_ids(_IDS_Q, _IDS_KV) & masks.padding(q_lengths=np.array([130, 100])),
    ),
}


@pytest.mark.parametrize("case", list(LOWERED))
def test_forward_grad_and_jvp_lower_to_mosaic_gpu_for_hopper(monkeypatch, case):
    """Lowered for sm_90, no GPU: Mosaic GPU calls (forward; forward, dq, dk/dv; jvp's one), no Triton, no (T, S)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # lowered, not interpreted
    q, k = jnp.zeros((2, 6, _T, 64), jnp.bfloat16), jnp.zeros((2, 6, _S, 64), jnp.bfloat16)
    kw = LOWERED[case]
    f = lambda q, k: jattn.attention(q, k, k, implementation="pallas", **kw)  # noqa: E731
    grad = jax.grad(lambda q, k: jnp.sum(f(q, k).astype(jnp.float32)), argnums=(0, 1))
    jvp = lambda q, k: jax.jvp(f, (q, k), (q, k))  # noqa: E731
    for fn, kernels in ((f, 1), (grad, 3), (jvp, 1)):
        text = cuda_text(fn, q, k, arch="sm_90")
        assert text.count("@mosaic_gpu") == kernels and "triton" not in text.lower()
        assert f"{_T}x{_S}x" not in text and "192x192x" not in text


def test_a_score_mod_mosaic_gpu_cannot_lower_is_refused_by_name_and_the_automatic_choice_passes_it_on(monkeypatch):
    """T5's bias reads a table per score (a gather): on sm_90 the refusal names Mosaic GPU (then Triton, which
    refuses it too), and implementation=None lowers with neither kernel; ALiBi still lowers to Mosaic GPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k = jnp.zeros((2, 6, _T, 64), jnp.bfloat16), jnp.zeros((2, 6, _S, 64), jnp.bfloat16)
    t5 = score_mods.relative_position_bias(jnp.ones((32, 6)))
    words = r"mosaic_gpu: .*reads .*gather.*which Mosaic GPU cannot lower.*triton: .*which Triton cannot lower"
    with pytest.raises(KernelRefusalError, match=words):
        cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=t5, implementation="pallas"), q, k, arch="sm_90")
    text = cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=t5), q, k, arch="sm_90")
    assert "@mosaic_gpu" not in text and "triton" not in text.lower()
    alibi = score_mods.alibi(jnp.linspace(0.1, 1.0, 6))
    assert (
        cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=alibi), q, k, arch="sm_90").count("@mosaic_gpu") == 1
    )


# Blackwell (sm_100): tcgen05 products into tensor memory, 128 by 128 tiles. T = S = 300: three blocks each; the
# window and the documents leave EMPTY tiles above and below the diagonal, PARTIAL and FULL ones between.
_BW = 300
_BW_IDS = np.repeat(np.array([[0, 1], [0, 0]]), [170, 130], axis=1)  # (B=2, T): two documents, or one
_BW_MASK = masks.causal() & masks.sliding_window(100) & masks.segment_ids(_BW_IDS, _BW_IDS)


@pytest.fixture
def blackwell(monkeypatch):
    """The kernels' tcgen05 target (the automatic choice by compute capability: sm_100 once wired)."""
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend="mosaic_gpu_tcgen05"))


@needs_interpreter
def test_blackwell_values_and_gradients_equal_the_reference(blackwell):
    """tcgen05: out, lse, dq, dk, dv against float64 NumPy (grouped heads, window, documents), bfloat16."""
    lq, lkv = (2, 3, 2), (2, 3, 1)
    q, k, v = (
        _rand((*lq, _BW, 64), 0, jnp.bfloat16),
        _rand((*lkv, _BW, 64), 1, jnp.bfloat16),
        _rand((*lkv, _BW, 64), 2, jnp.bfloat16),
    )
    g = np.random.default_rng(3).normal(size=(*lq, _BW, 64))

    def loss(q, k, v):
        out, lse = jattn.attention(q, k, v, mask=_BW_MASK, return_lse=True, implementation="pallas")
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    dense = np.asarray(_BW_MASK.dense(_BW, _BW)).reshape(2, 1, 1, _BW, _BW)
    want, _, want_lse = ref.attention(q, k, v, dense)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **ref.tol(jnp.bfloat16))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense)[:3], strict=True):
        ref.assert_grad_close(got, w, jnp.bfloat16)


@needs_interpreter
def test_blackwell_jvp_with_softcap_and_dropout(blackwell):
    """tcgen05, forward mode with a soft cap and dropout: as the Hopper kernels' (wgmma), which the tests above check."""
    q, k, v = (_rand((2, 3, _BW, 64), n, jnp.float16) for n in range(3))
    tangents = tuple(_rand(x.shape, 10 + n, jnp.float16) for n, x in enumerate((q, k, v)))
    kw = dict(mask=_BW_MASK, score_mod=score_mods.softcap(3.0), dropout_rate=0.2, dropout_rng=jax.random.key(1))

    def f(q, k, v):
        return jattn.attention(q, k, v, return_lse=True, implementation="pallas", **kw)

    got = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), tangents)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend="mosaic_gpu"))
        want = jax.jit(lambda a, t: jax.jvp(f, a, t))((q, k, v), tangents)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        ref.assert_grad_close(a, ref.f64(w), jnp.float16)


@needs_interpreter
def test_blackwell_gradients_and_tangents_with_every_feature(blackwell):
    """tcgen05 tiles a 64-column chunk at a time: out, lse, dq, dk, dv, d slopes, d sinks and the linearized tangent
    with ALiBi composed with a soft cap, sinks and dropout (grouped heads, a window, documents), against float64 JAX."""
    lq, lkv, key, cap = (2, 3, 2), (2, 3, 1), jax.random.key(5), 4.0
    q, k, v = (_rand((*lq, _BW, 64), 0, jnp.bfloat16), *(_rand((*lkv, _BW, 64), n, jnp.bfloat16) for n in (1, 2)))
    slopes = jnp.asarray([0.01, 0.02, 0.05, 0.1, 0.2, 0.3], jnp.float32)  # (K G,) heads
    sinks = _rand((3, 2), 4, jnp.float32) + 1.0
    g = np.random.default_rng(3).normal(size=(*lq, _BW, 64))
    keep = np.asarray(_BW_MASK.dense(_BW, _BW)).reshape(2, 1, 1, _BW, _BW)
    drop = np.where(_drop_factor(lq, lkv, key, _BW, _BW, implementation="dense") != 0, 1 / (1 - _RATE), 0.0)
    distance = np.abs(np.arange(_BW)[:, None] - np.arange(_BW)[None, :]).reshape(1, 1, 1, _BW, _BW)

    def kernel(q, k, v, slopes, sinks):
        mod = score_mods.compose(score_mods.alibi(slopes), score_mods.softcap(cap))
        kw = dict(mask=_BW_MASK, score_mod=mod, sinks=sinks, dropout_rate=_RATE, dropout_rng=key)
        return jattn.attention(q, k, v, **kw, return_lse=True, implementation="pallas")

    def dense(q, k, v, slopes, sinks):
        bias = -slopes.reshape(1, 3, 2, 1, 1) * jnp.asarray(distance, slopes.dtype)
        return ref.dense_jax(q, k, v, keep=keep, bias=bias, sinks=sinks, softcap=cap, drop=drop)

    def loss(f, *args):
        return jnp.sum(f(*args)[0].astype(ref.wide()) * jnp.asarray(g, ref.wide()))

    def both(f, *args):  # (value, gradients in every input) and the tangent of (out, lse) along q, k, v, slopes
        tangent = jax.linearize(lambda *x: f(*x, sinks), *args[:4])[1](*args[:4])
        return jax.value_and_grad(functools.partial(loss, f), argnums=(0, 1, 2, 3, 4))(*args), tangent

    args = (q, k, v, slopes, sinks)
    (_, grads), tangent = jax.jit(functools.partial(both, kernel))(*args)
    with jax.enable_x64(True):
        wide = tuple(jnp.asarray(ref.f64(x)) for x in args)
        (_, want_grads), want_tangent = jax.jit(functools.partial(both, dense))(*wide)
        want_out, want_lse = dense(*wide)
    out, lse = kernel(*args)
    np.testing.assert_allclose(ref.f64(out), np.asarray(want_out), **ref.tol(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **ref.tol(jnp.bfloat16))
    for a, w in zip((*grads, *tangent), (*want_grads, *want_tangent), strict=True):
        ref.assert_grad_close(a, np.asarray(w), jnp.bfloat16)


@pytest.mark.skipif(not INTERPRETS, reason=f"the tcgen05 kernel lowers from jax 0.12 (here {jax.__version__})")
def test_blackwell_lowers_to_mosaic_gpu_for_b200(monkeypatch, blackwell):
    """Lowered for an abstract B200 (sm_100): forward one Mosaic GPU call, grad three, jvp one; no Triton."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((2, 6, _BW, 64), jnp.bfloat16)
    f = lambda q, k: jattn.attention(q, k, k, mask=_BW_MASK, score_mod=score_mods.softcap(5.0), implementation="pallas")  # noqa: E731
    grad = jax.grad(lambda q, k: jnp.sum(f(q, k).astype(jnp.float32)), argnums=(0, 1))
    jvp = lambda q, k: jax.jvp(f, (q, k), (q, k))  # noqa: E731
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA B200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    for fn, kernels in ((f, 1), (grad, 3), (jvp, 1)):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(q, q).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("@mosaic_gpu") == kernels and "triton" not in text.lower()


SHARED = [("mosaic_gpu", "sm_90"), pytest.param("mosaic_gpu_tcgen05", "sm_100", marks=pytest.mark.skipif(
    not INTERPRETS, reason=f"the tcgen05 kernel lowers from jax 0.12 (here {jax.__version__})"))]  # fmt: skip


#: backend: (the widest (D, E) pairs it admits, the narrowest it refuses); a kernel's tiles grow with D and E.
#: Hopper takes every pair (each kernel's outputs staged in the loop's tiles once the loop is done).
EDGES = {
    "mosaic_gpu": ([(256, 256)], []),
    "mosaic_gpu_tcgen05": ([(128, 128), (64, 256)], [(128, 256), (256, 64)]),
}


@pytest.mark.parametrize(("backend", "arch"), SHARED)
def test_every_kernel_fits_shared_memory_within_the_table_and_not_beyond(monkeypatch, backend, arch):
    """Mosaic GPU's lowering checks a kernel's shared memory against a block's 227 KiB (and raises past it): at the
    widest depths ``SHARED_WIDTH`` admits, the forward, dq, dk/dv, jvp and tangent kernels all lower; at the
    narrowest it refuses, the kernels are refused by name (the Triton kernel takes the call), and admitted anyway
    one of them would not lower. Shared memory grows with D and E, so the edges stand for every pair."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend=backend))
    admitted, refused = EDGES[backend]

    ids = np.repeat(np.array([[0, 1]]), [120, 80], axis=1)  # documents: their ids' windows take shared memory too
    kw = dict(mask=masks.causal() & masks.segment_ids(ids, ids), score_mod=score_mods.alibi(jnp.ones(2)))

    def programs(D, E):  # the features that add shared memory: segment-id windows, a score mod's row values, sinks
        q, v = jnp.zeros((1, 2, 200, D), jnp.bfloat16), jnp.zeros((1, 2, 200, E), jnp.bfloat16)
        sinks = jnp.zeros((2,), jnp.float32)
        f = lambda q, k, v: jattn.attention(q, k, v, **kw, sinks=sinks, implementation="pallas")  # noqa: E731
        grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        jvp = lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))  # noqa: E731
        lin = lambda q, k, v: jax.linearize(f, q, k, v)[1](q, k, v)  # noqa: E731
        return [(fn, (q, q, v)) for fn in (f, grad, jvp, lin)]

    for D, E in admitted:
        for (fn, args), kernels in zip(programs(D, E), (1, 3, 1, 2), strict=True):
            assert cuda_text(fn, *args, arch=arch).count("@mosaic_gpu") == kernels, (D, E, fn)
    for D, E in refused:
        with pytest.raises(KernelRefusalError, match=r"2 D \+ E up to .*227 KiB of shared memory"):
            mosaic_support.refuse_mosaic(backend, jnp.bfloat16, D, E, interpret=False, blocks=None)
        if platform_facts.has_pallas_triton():
            fn, args = programs(D, E)[0]
            text = cuda_text(fn, *args, arch=arch)
            assert "@mosaic_gpu" not in text and "triton" in text.lower()
    monkeypatch.setitem(mosaic_support.SHARED_WIDTH, backend, 10**6)  # the table too wide: Mosaic GPU's check raises
    for D, E in refused:
        failed = []
        for fn, args in programs(D, E):
            try:
                cuda_text(fn, *args, arch=arch)
            except ValueError as e:
                failed.append("exceeds available shared memory" in str(e))
        assert failed and all(failed), (D, E)


#: backend, arch, the edge's D = E, and how many segment_ids() fit its largest kernel there (one more would not):
#: Hopper's dq (k and v in two buffers), Blackwell's tangent.
WINDOWS = [("mosaic_gpu", "sm_90", 256, 15), pytest.param("mosaic_gpu_tcgen05", "sm_100", 128, 9, marks=pytest.mark.skipif(
    not INTERPRETS, reason=f"the tcgen05 kernel lowers from jax 0.12 (here {jax.__version__})"))]  # fmt: skip


@pytest.mark.parametrize(("backend", "arch", "D", "fit"), WINDOWS)
def test_segment_id_windows_past_the_edge_room_are_refused_and_would_overflow(monkeypatch, backend, arch, D, fit):
    """At the edge of SHARED_WIDTH (D = E), with ALiBi (a floating row value) and sinks, the kernels take ``fit``
    segment_ids() (each id window a KiB of shared memory: Mosaic GPU aligns every tile to 1 KiB) and lower (the
    gradient's three, linearize's two); one more is refused by name (Triton takes the call), and admitted it
    takes the largest kernel past 227 KiB."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pallas_path, "gpu_attention", functools.partial(gpu_attention, backend=backend))
    ids = np.repeat(np.array([[0, 1]]), [120, 80], axis=1)
    q = jnp.zeros((1, 2, 200, D), jnp.bfloat16)

    def programs(n):  # new functions each call: jit's trace cache would keep the first choice of kernel
        mask = functools.reduce(lambda m, c: m & masks.segment_ids(ids + c, ids + c), range(n), masks.causal())
        kw = dict(mask=mask, score_mod=score_mods.alibi(jnp.ones(2)), sinks=jnp.zeros(2), implementation="pallas")
        f = lambda q: jattn.attention(q, q, q, **kw)  # noqa: E731
        grad = jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32)))
        return {grad: 3, (lambda q: jax.linearize(f, q)[1](q)): 2}

    with pytest.raises(KernelRefusalError, match=rf"fewer segment_ids\(\) in the mask \(got {fit + 1}\)"):
        mosaic_support.refuse_windows(backend, D, D, 2 * (fit + 1))
    mosaic_support.refuse_windows(backend, D, D, 2 * fit)
    mosaic_support.refuse_windows(backend, D // 2, D, 2 * fit + 8)  # 64 columns below the edge: 8 KiB more at least
    for fn, kernels in programs(fit).items():
        assert cuda_text(fn, q, arch=arch).count("@mosaic_gpu") == kernels
    if platform_facts.has_pallas_triton():
        assert all("@mosaic_gpu" not in cuda_text(fn, q, arch=arch) for fn in programs(fit + 1))
    monkeypatch.setitem(mosaic_support.EDGE_ROOM, backend, 10**6)
    failed = []
    for fn in programs(fit + 1):
        try:
            cuda_text(fn, q, arch=arch)
        except ValueError as e:
            failed.append("exceeds available shared memory" in str(e))
    assert failed and all(failed)
