"""The core against the float64 reference, and its contract: masks, dtypes, transforms, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jattn
from tests import reference as ref

DTYPES = [jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16]


@st.composite
def problems(draw, dtypes=DTYPES):
    """Random attention problems: odd sizes, broadcasting leading dims, masks with empty rows, bias."""
    dtype = draw(st.sampled_from(dtypes))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    t, s, d, e = (draw(st.integers(1, 9)) for _ in range(4))

    def dims():  # each operand keeps a leading dim or broadcasts it from 1, or drops leading dims
        kept = [n if draw(st.booleans()) else 1 for n in lead]
        return kept[draw(st.integers(0, len(kept))) :]

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.normal(size=(*dims(), t, d))
    k = rng.normal(size=(*dims(), s, d))
    v = rng.normal(size=(*dims(), s, e))
    mask = bias = None
    if draw(st.booleans()):
        mask = rng.random((*dims(), t, s)) < draw(st.sampled_from([0.3, 0.7, 1.0]))
        if draw(st.booleans()):
            mask[..., rng.integers(t), :] = False  # a fully masked row
    if draw(st.booleans()):
        bias = rng.normal(size=(*dims(), t, s))
    scale = draw(st.sampled_from([None, 0.3]))
    return dtype, q, k, v, mask, bias, scale


def as_dtype(dtype, *xs):
    return [None if x is None else jnp.asarray(x, dtype) for x in xs]


@pytest.mark.long
@given(problems())
def test_matches_float64_reference(problem):
    dtype, q, k, v, mask, bias, scale = problem

    @jax.jit  # one program an example: the output, its lse and the weights
    def run(q, k, v, b):
        out, lse = jattn.attention(q, k, v, mask=mask, bias=b, scale=scale, return_lse=True)
        return out, lse, jattn.attention_weights(q, k, mask=mask, bias=b, scale=scale)

    with jax.enable_x64(dtype == jnp.float64):  # traced here, under float64 where the problem is
        q, k, v, b = as_dtype(dtype, q, k, v, bias)
        out, lse, got_w = run(q, k, v, b)
        want, weights, want_lse = ref.attention(q, k, v, mask, None if b is None else ref.f64(b), scale)
        assert out.dtype == dtype and out.shape == want.shape
        np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
        np.testing.assert_allclose(
            ref.f64(lse), want_lse, **ref.tol(jnp.float64 if dtype == jnp.float64 else jnp.float32)
        )
        np.testing.assert_allclose(
            ref.f64(got_w), weights, **ref.tol(jnp.float64 if dtype == jnp.float64 else jnp.float32)
        )


@pytest.mark.long
@settings(max_examples=10)
@given(problems(dtypes=[jnp.float64]))
def test_gradients_float64(problem):
    _, q, k, v, mask, bias, scale = problem
    with jax.enable_x64(True):
        b = jnp.zeros((1, 1)) if bias is None else jnp.asarray(bias)

        @jax.jit
        def f(q, k, v, b):
            return jattn.attention(q, k, v, mask=mask, bias=b, scale=scale)

        check_grads(f, (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), b), order=2, modes=["rev"])


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_agrees_with_jax_nn(num_kv_heads, masked):
    # jax.nn uses (B, T, N, D); jattn (..., T, D) with GQA as (B, K, G, T, D) vs (B, K, 1, S, D).
    B, T, S, N, D = 2, 7, 13, 4, 5
    q, k, v = _rand((B, T, N, D), 0), _rand((B, S, num_kv_heads, D), 1), _rand((B, S, num_kv_heads, D), 2)
    bias = _rand((B, N, T, S), 3)
    mask = jax.random.bernoulli(jax.random.key(4), 0.7, (B, N, T, S)).at[..., 0].set(True) if masked else None
    G = N // num_kv_heads

    def heads(x, groups):  # (B, L, N, D) -> (B, K, groups, L, D)
        return x.reshape(B, x.shape[1], -1, groups, D).transpose(0, 2, 3, 1, 4)

    def split(m):  # (B, N, T, S) -> (B, K, G, T, S)
        return m.reshape(B, num_kv_heads, G, T, S)

    @jax.jit
    def run(q, k, v, bias, mask):
        want = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)  # (B, T, N, D)
        got = jattn.attention(
            heads(q, G), heads(k, 1), heads(v, 1), bias=split(bias), mask=None if mask is None else split(mask)
        )
        return got.transpose(0, 3, 1, 2, 4).reshape(B, T, N, D), want

    got, want = run(q, k, v, bias, mask)
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))


def test_jit_equals_eager_and_remat():
    q, k, v = _rand((3, 7, 5), 0), _rand((3, 13, 5), 1), _rand((3, 13, 4), 2)
    mask = jax.random.bernoulli(jax.random.key(3), 0.5, (7, 13))
    eager = jattn.attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(jax.jit(lambda *a: jattn.attention(*a, mask=mask))(q, k, v), eager)

    def loss(q, k, v, fn):
        return jnp.sum(jnp.sin(fn(q, k, v, mask=mask)))

    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, jattn.attention)
    g_remat = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, jax.checkpoint(jattn.attention))
    for a, b in zip(g, g_remat, strict=True):
        np.testing.assert_allclose(a, b, **ref.tol(jnp.float32))


def test_vmap_equals_python_loop():
    q, k, v = _rand((4, 3, 7, 5), 0), _rand((4, 3, 13, 5), 1), _rand((4, 3, 13, 6), 2)
    bias = _rand((4, 7, 13), 3)
    one = jax.jit(lambda q, k, v, b: jattn.attention(q, k, v, bias=b))
    loop = jnp.stack([one(q[i], k[i], v[i], bias[i]) for i in range(4)])
    np.testing.assert_allclose(jax.jit(jax.vmap(one))(q, k, v, bias), loop, **ref.tol(jnp.float32))


def test_fully_masked_rows_give_zero_and_zero_gradient():
    q, k, v = _rand((2, 7, 5), 0), _rand((2, 13, 5), 1), _rand((2, 13, 4), 2)
    bias = _rand((2, 7, 13), 3)
    mask = np.ones((2, 7, 13), bool)
    mask[:, 3] = False  # query row 3 sees nothing
    mask[:, :, 5] = False  # key 5 is seen by nobody

    def loss(q, k, v, b):
        return jnp.sum(jnp.cos(jattn.attention(q, k, v, mask=mask, bias=b)))

    @jax.jit
    def run(q, k, v, bias):
        minus_inf = jnp.where(jnp.asarray(mask), 0.0, -jnp.inf)
        return (
            jattn.attention(q, k, v, mask=mask, bias=bias, return_lse=True),
            jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias),
            jattn.attention(q, k, v, bias=bias + minus_inf),  # no mask: a -inf bias over a whole row
        )

    (out, lse), (dq, dk, dv, db), biased = run(q, k, v, bias)
    assert np.all(np.asarray(out[:, 3]) == 0.0) and np.all(np.isneginf(lse[:, 3]))
    assert np.all(np.isfinite(out))
    assert np.all(np.asarray(dq[:, 3]) == 0.0)
    assert np.all(np.asarray(dk[:, 5]) == 0.0) and np.all(np.asarray(dv[:, 5]) == 0.0)
    assert np.all(np.asarray(db)[~mask] == 0.0) and np.all(np.asarray(db)[mask] != 0.0)
    # -inf bias over a whole row is the same defined case.
    np.testing.assert_array_equal(biased, out)


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla"])
@pytest.mark.parametrize("case", ["none", "causal offset", "padding with an empty row", "window, bias", "sinks"])
def test_the_lse_is_differentiable_and_the_max_logit_is_a_monitor(impl, case):
    """The lse's cotangent reaches q, k, bias and sinks as the float64 reference's; the max logit's reaches nothing.

    The lse's cotangent is nonzero on rows with no key too (lse -inf: no gradient, or the sink's).
    The call is jitted with the padding lengths as its argument and differentiated outside the
    jit, where a backward that closed over the forward's traced values would fail.
    """
    if impl == "xla" and case == "sinks":
        pytest.skip("jax.nn takes no sinks (the support table's refusal)")
    q, k, v = _rand((2, 3, 7, 5), 0), _rand((2, 3, 11, 5), 1), _rand((2, 3, 11, 5 if impl == "xla" else 4), 2)
    kw = {
        "none": {},
        "causal offset": dict(mask=jattn.masks.causal(), q_offset=1),
        "padding with an empty row": dict(lengths=jnp.array([0, 6])),
        "window, bias": dict(mask=jattn.masks.sliding_window(2, 1), bias=_rand((3, 7, 11), 3)),
        "sinks": dict(mask=jattn.masks.causal(), sinks=jnp.array([0.5, -1.0, 2.0])),
    }[case]
    bias, sinks, lengths = kw.pop("bias", None), kw.pop("sinks", None), kw.pop("lengths", None)
    if lengths is not None:
        kw["mask"] = jattn.masks.padding(kv_lengths=lengths)
    extra = {} if impl != "blockwise" else dict(block_size=(4, 3))

    @jax.jit
    def call(q, k, v, bias, sinks, lengths):
        mask = {} if lengths is None else dict(mask=jattn.masks.padding(kv_lengths=lengths))
        return jattn.attention(
            q, k, v, bias=bias, sinks=sinks, return_lse=True, return_max_logit=impl != "xla",
            implementation=impl, **(kw | mask), **extra,
        )  # fmt: skip

    outs, pull = jax.vjp(lambda q, k, v, bias, sinks: call(q, k, v, bias, sinks, lengths), q, k, v, bias, sinks)
    dout, dlse = _rand(outs[0].shape, 4), _rand(outs[1].shape, 5)
    zero = [jnp.zeros_like(x) for x in outs]
    dense = None if "mask" not in kw else kw["mask"].dense(7, 11, q_offset=kw.get("q_offset"))
    dense = None if dense is None else np.asarray(dense).reshape((2, 1, 7, 11) if dense.ndim == 4 else dense.shape)
    want_out = ref.attention_grads(q, k, v, dout, dense, bias, sinks=sinks)
    want_lse = ref.lse_grads(q, k, dlse, dense, bias, sinks=sinks)
    got = pull((dout, dlse, *zero[2:]))
    for i, j in enumerate((0, 1, 3, 4)):  # q, k, bias, sinks (None where the call has none)
        if got[j] is not None:
            ref.assert_grad_close(got[j], want_out[j] + want_lse[i], jnp.float32)
    ref.assert_grad_close(got[2], want_out[2], jnp.float32)  # v: the lse does not depend on it
    if impl != "xla":  # the max logit's cotangent alone: no gradient anywhere
        for g in pull((*zero[:2], _rand(outs[2].shape, 6))):
            assert g is None or not np.any(np.asarray(g))


def test_nan_in_unmasked_input_propagates_and_masked_logits_do_not_leak():
    q, k, v = _rand((7, 5), 0), _rand((13, 5), 1), _rand((13, 4), 2)
    attend = jax.jit(jattn.attention)
    assert np.all(np.isnan(attend(q.at[2, 0].set(jnp.nan), k, v)[2]))
    assert np.all(np.isnan(attend(q, k.at[4, 1].set(jnp.nan), v)))
    assert np.all(np.isnan(attend(q, k, v.at[4, 1].set(jnp.nan))[:, 1]))
    mask = jnp.ones((7, 13), bool).at[:, 4].set(False)
    bias = jnp.zeros((7, 13)).at[:, 4].set(jnp.nan)
    out = attend(q, k, v, mask=mask, bias=bias)
    want, _, _ = ref.attention(q, k, v, mask=np.asarray(mask))
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_low_precision_accumulates_in_float32(dtype):
    # Logits of about 1e5..1e6 overflow float16 and lose all precision in bfloat16 arithmetic.
    q = _rand((7, 16), 0, dtype) * 60
    k = _rand((13, 16), 1, dtype) * 60
    v = _rand((13, 4), 2, dtype)
    out, lse = jax.jit(lambda q, k, v: jattn.attention(q, k, v, scale=8.0, return_lse=True))(q, k, v)
    want, _, want_lse = ref.attention(q, k, v, scale=8.0)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert np.max(np.abs(want_lse)) > 7e4
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_dropout_is_unbiased_and_needs_a_key():
    q, k, v = _rand((7, 5), 0), _rand((13, 5), 1), _rand((13, 4), 2)
    keys = jax.random.split(jax.random.key(9), 4000)
    outs, exact = jax.jit(
        lambda keys: (
            jax.vmap(lambda r: jattn.attention(q, k, v, dropout_rate=0.3, dropout_rng=r))(keys),
            jattn.attention(q, k, v),
        )
    )(keys)
    assert np.max(np.abs(outs.std(0))) > 0.05  # it does drop
    np.testing.assert_allclose(outs.mean(0), exact, atol=4 * float(outs.std(0).max()) / np.sqrt(4000))
    with pytest.raises(ValueError, match="dropout_rng"):
        jattn.attention(q, k, v, dropout_rate=0.3)
    with pytest.raises(ValueError, match="dropout_rate"):
        jattn.attention(q, k, v, dropout_rate=1.0, dropout_rng=keys[0])


BAD = [
    # (kwargs changes, exception, message fragment)
    (dict(q=np.ones(5, np.float32)), ValueError, r"q must have at least 2 dimensions.*\(5,\)"),
    (dict(k=np.ones((13, 6), np.float32)), ValueError, r"same depth D.*\(7, 5\).*\(13, 6\)"),
    (dict(v=np.ones((12, 4), np.float32)), ValueError, r"same length S.*\(13, 5\).*\(12, 4\)"),
    (dict(q=np.ones((2, 7, 5), np.float32), k=np.ones((3, 13, 5), np.float32)), ValueError, r"do not broadcast"),
    (dict(v=np.ones((13, 4), np.float16)), TypeError, r"share one dtype.*v=float16"),
    (dict(q=np.ones((7, 5), np.int32)), TypeError, r"q must be bfloat16.*int32"),
    (dict(mask=np.ones((7, 13), np.int32)), TypeError, r"mask must be boolean.*int32.*\(7, 13\)"),
    (dict(mask=np.ones((7, 12), bool)), ValueError, r"mask of shape \(7, 12\) does not broadcast.*7, 13\)"),
    (dict(bias=np.ones((8, 13), np.float32)), ValueError, r"bias of shape \(8, 13\) does not broadcast"),
    (dict(bias=np.ones((7, 13), np.int32)), TypeError, r"bias must be floating.*int32"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD)
def test_bad_input_raises_naming_argument_and_shapes(change, error, match):
    args = dict(q=np.ones((7, 5), np.float32), k=np.ones((13, 5), np.float32), v=np.ones((13, 4), np.float32))
    args |= change
    with pytest.raises(error, match=match):
        jattn.attention(**args)
