"""Score modifications, attention sinks and the max-logit statistic against the float64 reference
that materialises the modified scores: forward, lse, max logit and gradients (to q, k, v, captured
tables and slopes, sinks), on the dense and blockwise paths; fully masked rows; T5 buckets."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks, score_mods
from tests import reference as ref

B, N, T, S, D, E = 2, 3, 7, 11, 5, 4
BLOCKS = (4, 3)
IMPLS = ("dense", "blockwise")
NB, MAXD = 8, 9  # T5 buckets at these small lengths: exact ones and log-spaced ones both occur


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _call(impl, q, k, v, **kw):
    if impl == "blockwise":
        kw.setdefault("block_size", BLOCKS)
    return jattn.attention(q, k, v, implementation=impl, **kw)


# -- NumPy float64 versions of the ready-made modifications, written from their definitions --------


def np_t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """T5's _relative_position_bucket (Mesh TensorFlow / Hugging Face), element by element, its log in float32."""
    out = np.zeros(np.shape(rel), np.int64)
    for idx in np.ndindex(*np.shape(rel)):
        n, nb, bucket = int(rel[idx]), num_buckets, 0
        if bidirectional:
            nb //= 2
            bucket += nb if n > 0 else 0
            n = abs(n)
        else:
            n = max(-n, 0)
        exact = nb // 2
        if n < exact:
            bucket += n
        else:
            x = np.log(np.float32(n) / np.float32(exact)) / np.float32(math.log(max_distance / exact))
            bucket += min(exact + int(x * np.float32(nb - exact)), nb - 1)
        out[idx] = bucket
    return out


def np_softcap(cap):
    return lambda s, b, h, qp, kp: cap * np.tanh(s / cap)


def np_alibi(slopes):
    slopes = np.asarray(slopes, np.float64)
    return lambda s, b, h, qp, kp: s - slopes[h] * np.abs(qp - kp)


def np_relpos(table, bidirectional):
    table = np.asarray(table, np.float64)
    return lambda s, b, h, qp, kp: (
        s + table[np_t5_bucket(np.broadcast_to(kp - qp, s.shape[-2:]), NB, MAXD, bidirectional), h]
    )


def _mods():
    """(name, jattn mod, NumPy mod) with the arrays they capture; every one uses a different argument."""
    slopes = np.asarray(score_mods.alibi_slopes(N)) * 3
    table = np.asarray(_rand((NB, N), 40))
    per_batch = np.asarray([0.7, -0.4], np.float32)
    return [  # softcap and alibi are tested in "composed"
        ("t5", score_mods.relative_position_bias(table, NB, MAXD, True), np_relpos(table, True)),
        ("t5-causal", score_mods.relative_position_bias(table, NB, MAXD, False), np_relpos(table, False)),
        (
            "composed",
            score_mods.compose(score_mods.alibi(slopes), score_mods.softcap(1.5)),
            lambda *a: np_softcap(1.5)(np_alibi(slopes)(*a), *a[1:]),
        ),
        (
            "batch-and-head",
            lambda s, b, h, qp, kp: (
                s * (1.0 + jnp.asarray(per_batch)[b]) + 0.1 * h.astype(s.dtype) - 0.05 * (qp % 3).astype(s.dtype)
            ),
            lambda s, b, h, qp, kp: s * (1.0 + per_batch[b]) + 0.1 * h - 0.05 * (qp % 3),
        ),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(4), ids=[m[0] for m in _mods()])
def test_score_mods_match_the_reference(impl, case):
    """out, lse and max logit with every modification, a causal mask placed by q_offset and sinks."""
    _, mod, np_mod = _mods()[case]
    q, k, v = _rand((B, N, T, D), 1), _rand((B, N, S, D), 2), _rand((B, N, S, E), 3)
    sinks = np.asarray([0.3, -1.2, 1.1], np.float32)
    kw = dict(mask=masks.causal(), q_offset=2, score_mod=mod, sinks=sinks, return_lse=True, return_max_logit=True)
    out, lse, top = jax.jit(lambda q, k, v: _call(impl, q, k, v, **kw))(q, k, v)
    dense = np.asarray(masks.causal().dense(T, S, q_offset=2))
    want, _, want_lse, want_top = ref.attention(q, k, v, dense, score_mod=np_mod, sinks=sinks, q_offset=2, stats=True)
    tol = ref.tol(jnp.float32)
    np.testing.assert_allclose(ref.f64(out), want, **tol)
    np.testing.assert_allclose(ref.f64(lse), want_lse, **tol)
    np.testing.assert_allclose(ref.f64(top), want_top, **tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_is_flattened_over_the_grouped_layout(impl):
    """q (B, K, G, T, D) against k, v (B, K, 1, S, D): head = k·G + g, batch the first axis."""
    K, G = 2, 3
    q, k, v = _rand((B, K, G, T, D), 4), _rand((B, K, 1, S, D), 5), _rand((B, K, 1, S, E), 6)
    w = np.arange(1, K * G + 1, dtype=np.float32) / 4

    def mod(s, b, h, qp, kp):
        return s * jnp.asarray(w)[h] + b.astype(s.dtype)

    out = jax.jit(lambda q, k, v: _call(impl, q, k, v, score_mod=mod))(q, k, v)
    want = ref.attention(q, k, v, score_mod=lambda s, b, h, qp, kp: s * w[h] + b)[0]
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_max_logit_without_modification(impl):
    """The max logit is over the kept scaled scores; -inf on a fully masked row."""
    q, k, v = _rand((N, T, D), 7), _rand((N, S, D), 8), _rand((N, S, E), 9)
    mask = np.array(jax.random.bernoulli(jax.random.key(10), 0.5, (N, T, S)))
    mask[1, 2] = False
    _, top = jax.jit(lambda q, k, v: _call(impl, q, k, v, mask=mask, return_max_logit=True))(q, k, v)
    _, _, _, want_top = ref.attention(q, k, v, mask, stats=True)
    assert np.isneginf(np.asarray(top)[1, 2])
    np.testing.assert_allclose(ref.f64(top), want_top, **ref.tol(jnp.float32))


def _numeric_grad(f, x, eps=1e-6):
    """Central differences of the NumPy float64 function ``f`` at every entry of ``x``."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        g[idx] = (f(hi) - f(lo)) / (2 * eps)
    return g


def _grad_case():
    """float64 inputs, captured table and slopes, sinks, the cotangent and a sliding window."""
    q, k, v = (_rand(s, i, jnp.float64) for i, s in ((11, (B, N, T, D)), (12, (B, N, S, D)), (13, (B, N, S, E))))
    table, slopes = _rand((NB, N), 14, jnp.float64), jnp.asarray([0.5, 0.25, 0.125], jnp.float64)
    sinks = jnp.asarray([0.2, -0.7, 0.9], jnp.float64)
    return q, k, v, table, slopes, sinks, np.asarray(_rand((B, N, T, E), 15, jnp.float64)), masks.sliding_window(4, 2)


@pytest.fixture(scope="module")
def fd_grads():
    """Central differences of the NumPy reference's loss in the table, the slopes and the sinks."""
    with jax.enable_x64(True):
        q, k, v, table, slopes, sinks, dout, mask = _grad_case()
        dense = np.asarray(mask.dense(T, S))

    def np_loss(table_=table, slopes_=slopes, sinks_=sinks):
        def mod(*a):
            return np_alibi(slopes_)(np_relpos(table_, True)(*a), *a[1:])

        return np.sum(ref.attention(q, k, v, dense, score_mod=mod, sinks=sinks_)[0] * dout)

    return (
        _numeric_grad(lambda x: np_loss(table_=x), table),
        _numeric_grad(lambda x: np_loss(slopes_=x), slopes),
        _numeric_grad(lambda x: np_loss(sinks_=x), sinks),
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_to_captured_arrays_and_sinks(impl, fd_grads):
    """float64: d table, d slopes, d sinks against central differences of the NumPy reference."""
    with jax.enable_x64(True):
        q, k, v, table, slopes, sinks, dout, mask = _grad_case()

        def loss(table, slopes, sinks):
            mod = score_mods.compose(score_mods.relative_position_bias(table, NB, MAXD), score_mods.alibi(slopes))
            return jnp.sum(_call(impl, q, k, v, mask=mask, score_mod=mod, sinks=sinks) * dout)

        got = jax.jit(jax.grad(loss, (0, 1, 2)))(table, slopes, sinks)  # traced here, under float64
        for g, want in zip(got, fd_grads, strict=True):
            np.testing.assert_allclose(ref.f64(g), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_sink_gradients_match_the_hand_backward(impl):
    """float32: d q, d k, d v and d sinks (sinks (N,) against (B, N)) against the reference's hand backward."""
    q, k, v = _rand((B, N, T, D), 16), _rand((B, N, S, D), 17), _rand((B, N, S, E), 18)
    sinks, dout = _rand((N,), 19) * 2, _rand((B, N, T, E), 20)
    mask = masks.causal()
    got = jax.jit(jax.grad(lambda *a: jnp.sum(_call(impl, *a[:3], mask=mask, sinks=a[3]) * dout), (0, 1, 2, 3)))(
        q, k, v, sinks
    )
    want = ref.attention_grads(q, k, v, dout, np.asarray(mask.dense(T, S)), sinks=sinks)
    for g, w in zip(got, (*want[:3], want[4]), strict=True):
        ref.assert_grad_close(g, w, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_stay_zero_with_sinks_and_mods(impl):
    """An empty row gives exactly 0 output and zero gradients (to q, table, sinks); its lse is its
    sink (the denominator is e^sink alone), its max logit -inf."""
    q, k, v = _rand((B, N, T, D), 21), _rand((B, N, S, D), 22), _rand((B, N, S, E), 23)
    table, sinks = _rand((NB, N), 24), _rand((N,), 25)
    mask = np.array(jax.random.bernoulli(jax.random.key(26), 0.6, (B, 1, T, S)))
    empty = np.zeros((T,), bool)
    empty[[1, 5]] = True
    mask[:, :, empty] = False

    def run(q, table, sinks, **kw):
        mod = score_mods.compose(score_mods.relative_position_bias(table, NB, MAXD), score_mods.softcap(2.0))
        return _call(impl, q, k, v, mask=mask, score_mod=mod, sinks=sinks, **kw)

    pick = jnp.asarray(empty)[:, None]

    @jax.jit
    def outputs_and_grads(q, table, sinks):
        empty_rows = lambda *a: jnp.sum(jnp.where(pick, run(*a), 0.0) ** 2 + jnp.where(pick, run(*a), 0.0))  # noqa: E731
        return (
            run(q, table, sinks, return_lse=True, return_max_logit=True),
            jax.grad(empty_rows, (0, 1, 2))(q, table, sinks),
            jax.grad(lambda q: jnp.sum(run(q, table, sinks)))(q),
        )

    (out, lse, top), grads, dq = outputs_and_grads(q, table, sinks)
    assert np.all(np.asarray(out)[:, :, empty] == 0)
    np.testing.assert_array_equal(np.asarray(lse)[:, :, empty], np.broadcast_to(np.asarray(sinks)[:, None], (B, N, 2)))
    assert np.all(np.isneginf(np.asarray(top)[:, :, empty]))
    for g in grads:
        assert np.all(np.asarray(g) == 0)
    assert np.all(np.asarray(dq)[:, :, empty] == 0)


def test_blockwise_equals_dense_under_vmap_with_a_captured_table():
    """vmap over a batch of tables (each gets its own gradient) matches dense, per element."""
    q, k, v = _rand((N, T, D), 27), _rand((N, S, D), 28), _rand((N, S, E), 29)
    tables = _rand((3, NB, N), 30)

    def loss(table, impl):
        mod = score_mods.relative_position_bias(table, NB, MAXD, False)
        return jnp.sum(_call(impl, q, k, v, mask=masks.causal(), score_mod=mod) ** 2)

    grads = {impl: jax.jit(jax.vmap(jax.grad(lambda t, impl=impl: loss(t, impl))))(tables) for impl in IMPLS}
    np.testing.assert_allclose(grads["blockwise"], grads["dense"], rtol=2e-5, atol=2e-6)


def test_t5_buckets_are_t5s():
    """jattn.score_mods.t5_buckets equals T5's bucketing over a range past max_distance, both directions."""
    rel = np.arange(-300, 301)
    for nb, md, bi in ((32, 128, True), (32, 128, False), (NB, MAXD, True), (10, 40, False)):
        got = np.asarray(score_mods.t5_buckets(jnp.asarray(rel), nb, md, bi))
        np.testing.assert_array_equal(got, np_t5_bucket(rel, nb, md, bi))


def test_alibi_slopes_are_the_papers():
    """Powers of 2 give 2^(-8i/N); 6 heads interleave the slopes of 4 and 8 heads (ALiBi reference code)."""
    np.testing.assert_allclose(score_mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9), rtol=1e-7)
    want6 = np.concatenate([2.0 ** (-2.0 * np.arange(1, 5)), 2.0 ** -np.array([1.0, 3.0])])
    np.testing.assert_allclose(score_mods.alibi_slopes(6), want6, rtol=1e-7)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(sinks=np.zeros((4,), np.float32)), ValueError, r"sinks of shape \(4,\) does not broadcast"),
        (dict(sinks=np.zeros((3,), np.int32)), TypeError, "sinks must be floating"),
        (dict(score_mod=3.0), TypeError, "score_mod must be a callable"),
    ],
)
def test_bad_sinks_and_score_mod(kw, error, match):
    q = jnp.zeros((B, N, T, D))
    for impl in IMPLS:
        with pytest.raises(error, match=match):
            jattn.attention(q, q, q, implementation=impl, **kw)


def test_ready_made_mods_check_their_arguments():
    with pytest.raises(ValueError, match=r"table must be a floating \(num_buckets, N\) = \(8, N\)"):
        score_mods.relative_position_bias(np.zeros((7, 3), np.float32), 8, 16)
    with pytest.raises(ValueError, match="slopes must be a floating"):
        score_mods.alibi(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="cap"):
        score_mods.softcap(0.0)


# -- an additive bias on the blockwise path ----------------------------------------------------------


@pytest.mark.parametrize("bias_shape", [(B, N, T, S), (N, T, 1)])
def test_blockwise_bias_matches_the_hand_backward(bias_shape):
    """out, lse and d q, d k, d v, d bias (reduced to the bias's own shape) against the float64 reference."""
    q, k, v = _rand((B, N, T, D), 31), _rand((B, N, S, D), 32), _rand((B, N, S, E), 33)
    bias, dout = _rand(bias_shape, 34) * 2, _rand((B, N, T, E), 35)
    mask = masks.causal()

    @jax.jit
    def outputs_and_grads(q, k, v, bias):
        loss = lambda *a: jnp.sum(_call("blockwise", *a[:3], bias=a[3], mask=mask) * dout)  # noqa: E731
        return _call("blockwise", q, k, v, bias=bias, mask=mask, return_lse=True), jax.grad(loss, (0, 1, 2, 3))(
            q, k, v, bias
        )

    (out, lse), got = outputs_and_grads(q, k, v, bias)
    dense = np.asarray(mask.dense(T, S))
    want, _, want_lse = ref.attention(q, k, v, dense, np.asarray(bias))
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(ref.f64(lse), want_lse, **ref.tol(jnp.float32))
    for g, w in zip(got, ref.attention_grads(q, k, v, dout, dense, np.asarray(bias)), strict=True):
        assert g.shape == np.shape(w)
        ref.assert_grad_close(g, w, jnp.float32)


def test_blockwise_bias_with_mods_sinks_and_empty_rows():
    """Bias, a modification and sinks together equal the dense path; -inf bias rows and masked rows give
    exactly 0 and zero gradients to the bias."""
    q, k, v = _rand((B, N, T, D), 36), _rand((B, N, S, D), 37), _rand((B, N, S, E), 38)
    bias = np.array(_rand((N, T, S), 39))
    bias[:, 3] = -np.inf  # a row emptied by the bias
    mask = np.ones((T, S), bool)
    mask[5] = False  # a row emptied by the mask
    slopes = np.asarray([0.5, 0.2, 0.1], np.float32)  # (softcap would turn the -inf row finite: it acts after the bias)
    kw = dict(mask=mask, score_mod=score_mods.alibi(slopes), sinks=np.asarray([0.1, 0.2, -0.3], np.float32))

    def run(impl, q, bias):
        return _call(impl, q, k, v, bias=bias, **kw)

    @jax.jit
    def outputs_and_grads(q, bias):
        return {
            impl: (run(impl, q, bias), jax.grad(lambda q, b, impl=impl: jnp.sum(run(impl, q, b) ** 2), (0, 1))(q, bias))
            for impl in IMPLS
        }

    got = outputs_and_grads(q, jnp.asarray(bias))
    np.testing.assert_allclose(got["blockwise"][0], got["dense"][0], **ref.tol(jnp.float32))
    for impl in IMPLS:
        out, (dq, db) = got[impl]
        assert np.all(np.asarray(out)[:, :, [3, 5]] == 0)
        assert np.all(np.asarray(dq)[:, :, [3, 5]] == 0) and np.all(np.asarray(db)[:, [3, 5]] == 0)


def test_blockwise_bias_memory_is_the_bias_and_its_gradient(monkeypatch):
    """Compiled forward + backward with a (T, S) bias shared by N heads: the scratch beyond the unbiased
    call is at most a few copies of the bias, far below the N·T·S scores the dense path holds. Both on
    XLA's tiles (a bias keeps them; the fused CPU kernels' scratch is outside XLA's count)."""
    monkeypatch.setenv("JATTN_FUSED_CPU", "0")
    n, t = 4, 1024

    def temp(impl, bias):
        spec, bs = jax.ShapeDtypeStruct((1, n, t, 64), jnp.float32), jax.ShapeDtypeStruct((t, t), jnp.float32)

        def loss(q, k, v, b):
            return jnp.sum(jattn.attention(q, k, v, bias=b if bias else None, mask=masks.causal(), implementation=impl))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(spec, spec, spec, bs).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    bias_bytes, scores_bytes = t * t * 4, n * t * t * 4
    extra = temp("blockwise", True) - temp("blockwise", False)
    # 2.46 biases with XLA:CPU's YNNPACK fusions, 3.33 with the flag jattn sets against their miscompile
    # (docs: transformations): XLA's own fusions keep one more (4, 512, 512) tile of the backward live
    assert extra <= 3.5 * bias_bytes
    assert temp("dense", True) >= scores_bytes  # the check can fail: dense holds the scores


def test_blockwise_bias_under_vmap_equals_dense():
    """vmap over biases (each its own gradient) and over q with one shared bias: blockwise == dense."""
    q, k, v = _rand((3, N, T, D), 40), _rand((N, S, D), 41), _rand((N, S, E), 42)
    biases = _rand((3, T, S), 43)

    def grads(impl):
        def loss(q, b):
            return jnp.sum(_call(impl, q, k, v, bias=b, mask=masks.causal()) ** 2)

        return jax.jit(
            lambda q, biases: (
                jax.vmap(jax.grad(loss, (0, 1)))(q, biases),
                jax.vmap(jax.grad(loss, (0, 1)), (0, None))(q, biases[0]),
            )
        )(q, biases)

    for got, want in zip(jax.tree.leaves(grads("blockwise")), jax.tree.leaves(grads("dense")), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
