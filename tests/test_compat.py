"""jattn.dot_product_attention against jax.nn.dot_product_attention (xla), argument by argument.

Sizes are odd and distinct (B=2, T=7, S=11, N=6, K=3, H=5) so that a swapped axis fails loudly.
Where jax.nn differs by contract (rows with nothing to attend to) the float64 reference decides.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

B, T, S, N, K, H = 2, 7, 11, 6, 3, 5
PATHS = [None, "dense", "blockwise", "xla"]


def qkv(t=T, s=S, n=N, k=K, h=H, dtype=jnp.float32, seed=0, batch=True):
    r = np.random.default_rng(seed)
    lead = (B,) if batch else ()
    q = r.normal(size=(*lead, t, n, h))
    kk = r.normal(size=(*lead, s, k, h))
    v = r.normal(size=(*lead, s, k, h))
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def random_mask(shape, seed=1):
    m = np.random.default_rng(seed).random(shape) < 0.6
    m[..., 0] = True  # every row keeps a key: jax.nn and jattn agree only there
    return jnp.asarray(m)


def check(kwargs, paths=PATHS, t=T, s=S, n=N, k=K, batch=True, dtype=jnp.float32):
    """jattn on each path equals jax.nn (xla); all of them traced into one program."""
    q, kk, v = qkv(t, s, n, k, batch=batch, dtype=dtype)

    @jax.jit
    def run(q, kk, v):
        with jax.numpy_dtype_promotion("standard"):  # jax.nn promotes bfloat16 against float32 implicitly
            want = jax.nn.dot_product_attention(q, kk, v, implementation="xla", **kwargs)
        return want, [jattn.dot_product_attention(q, kk, v, implementation=path, **kwargs) for path in paths]

    want, outs = run(q, kk, v)
    for path, got in zip(paths, outs, strict=True):
        assert got.shape == q.shape and got.dtype == q.dtype, path
        np.testing.assert_allclose(ref.f64(got), ref.f64(want), **ref.tol(dtype), err_msg=str(path))


@pytest.mark.parametrize("batch", [True, False], ids=["4d", "3d"])
@pytest.mark.parametrize(("n", "k"), [(6, 3), (3, 3), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_layouts_and_heads(batch, n, k):
    check({}, n=n, k=k, batch=batch)


@pytest.mark.parametrize("t", [T, S, 13], ids=["T<S", "T==S", "T>S"])
def test_causal_is_top_left(t):
    check(dict(is_causal=True), t=t)


@pytest.mark.parametrize("window", [2, (3, 1), (2, 4), (5, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t", [T, 13], ids=["T<S", "T>S"])
def test_local_window(window, causal, t):
    check(dict(local_window_size=window, is_causal=causal), t=t)  # every row keeps a key (left >= T - S)


def test_local_window_right_only():
    check(dict(local_window_size=(0, 4)))


@pytest.mark.parametrize("shape", [(B, N, T, S), (1, N, T, S), (B, 1, T, S), (N, T, S), (T, S), (B, N, 1, S)])
def test_mask_broadcasting(shape):
    check(dict(mask=random_mask(shape)))


@pytest.mark.parametrize("shape", [(B, N, T, S), (1, N, 1, S), (B, 1, T, S), (T, S)])
def test_bias_broadcasting(shape):
    bias = jnp.asarray(np.random.default_rng(2).normal(size=shape), jnp.float32)
    check(dict(bias=bias), paths=[None, "dense", "blockwise", "xla"])
    with pytest.raises(ValueError, match="bias"):
        jattn.dot_product_attention(*qkv(), bias=bias, implementation="pallas")


def test_sequence_lengths():
    lengths = dict(query_seq_lengths=jnp.array([3, 7], jnp.int32), key_value_seq_lengths=jnp.array([11, 4], jnp.int32))
    check(lengths)
    check(dict(query_seq_lengths=jnp.array([5, 1], jnp.int32)))
    check(dict(key_value_seq_lengths=jnp.array([2, 9], jnp.int32), is_causal=True, mask=random_mask((B, 1, T, S))))


def test_sequence_lengths_unbatched():
    check(dict(key_value_seq_lengths=jnp.array([6], jnp.int32)), batch=False)


def test_scale_and_bfloat16():
    check(dict(scale=0.37, is_causal=True))
    lengths = jnp.array([9, 5], jnp.int32)
    check(dict(is_causal=True, key_value_seq_lengths=lengths), paths=[None, "dense", "blockwise"], dtype=jnp.bfloat16)


@pytest.mark.parametrize("path", PATHS)
def test_return_residual(path):
    q, k, v = qkv()
    kw = dict(is_causal=True, local_window_size=(4, 0), key_value_seq_lengths=jnp.array([11, 6], jnp.int32))

    @jax.jit
    def run(q, k, v):
        return (
            jattn.dot_product_attention(q, k, v, implementation=path, return_residual=True, **kw),
            jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True, **kw),
            jattn.dot_product_attention(q[0], k[0], v[0], implementation=path, return_residual=True)[1],
            jax.nn.dot_product_attention(q[0], k[0], v[0], implementation="xla", return_residual=True)[1],
        )

    (out, res), (want_out, want_res), res3, want3 = run(q, k, v)
    assert res.shape == want_res.shape == (B, T, N) and res.dtype == want_res.dtype
    np.testing.assert_allclose(out, want_out, **ref.tol(jnp.float32))
    np.testing.assert_allclose(res, want_res, **ref.tol(jnp.float32))
    assert res3.shape == (T, N)
    np.testing.assert_allclose(res3, want3, **ref.tol(jnp.float32))


@pytest.mark.parametrize("path", [None, "dense", "xla"])
def test_gradients(path):
    q, k, v = qkv()
    bias = jnp.asarray(np.random.default_rng(3).normal(size=(1, N, T, S)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, N, H)), jnp.float32)
    kw = dict(is_causal=True, query_seq_lengths=jnp.array([7, 4], jnp.int32), mask=random_mask((B, N, T, S)))

    def loss(fn, impl):
        return lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias, implementation=impl, **kw) * w)

    got, want = jax.jit(
        lambda *a: (
            jax.grad(loss(jattn.dot_product_attention, path), argnums=(0, 1, 2, 3))(*a),
            jax.grad(loss(jax.nn.dot_product_attention, "xla"), argnums=(0, 1, 2, 3))(*a),
        )
    )(q, k, v, bias)
    for name, g, e in zip(["q", "k", "v", "bias"], got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-4, err_msg=name)


def test_gradients_blockwise_window():
    q, k, v = qkv()
    kw = dict(local_window_size=(2, 3), key_value_seq_lengths=jnp.array([11, 8], jnp.int32))

    def loss(fn, impl):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, implementation=impl, **kw)))

    got, want = jax.jit(
        lambda *a: (
            jax.grad(loss(jattn.dot_product_attention, "blockwise"), argnums=(0, 1, 2))(*a),
            jax.grad(loss(jax.nn.dot_product_attention, "xla"), argnums=(0, 1, 2))(*a),
        )
    )(q, k, v)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_fully_masked_rows_are_zero_against_float64(path):
    """jax.nn averages v over a row with no key; jattn's contract is 0 and a residual of -inf."""
    q, k, v = qkv()
    mask = np.array(random_mask((B, N, T, S)))
    mask[1, 2, 3] = False  # one (example, head, query) row with no key at all
    lengths = jnp.array([0, 11], jnp.int32)  # example 0 has no keys
    out, res = jax.jit(
        lambda q, k, v: jattn.dot_product_attention(
            q, k, v, mask=jnp.asarray(mask), key_value_seq_lengths=lengths, implementation=path, return_residual=True
        )
    )(q, k, v)
    full = mask & (np.arange(S) < np.asarray(lengths)[:, None, None, None])
    g = N // K
    kr, vr = np.repeat(ref.f64(k), g, axis=2), np.repeat(ref.f64(v), g, axis=2)
    want, _, lse = ref.attention(
        ref.f64(q).transpose(0, 2, 1, 3), kr.transpose(0, 2, 1, 3), vr.transpose(0, 2, 1, 3), mask=full
    )
    np.testing.assert_allclose(ref.f64(out), want.transpose(0, 2, 1, 3), **ref.tol(jnp.float32))
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(out)[1, 3, 2] == 0)
    np.testing.assert_array_equal(np.isneginf(np.asarray(res)), np.isneginf(lse.transpose(0, 2, 1)))
    finite = np.isfinite(lse.transpose(0, 2, 1))
    np.testing.assert_allclose(np.asarray(res)[finite], lse.transpose(0, 2, 1)[finite], **ref.tol(jnp.float32))


def test_skips_padded_tiles_on_the_blockwise_path():
    """Top-left causal and lengths stay a predicate and array masks: no (T, S) scores in the jaxpr."""
    t = s = 1024
    q = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, s, 1, 8), jnp.float32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    jaxpr = jax.make_jaxpr(
        lambda q, k, n: jattn.dot_product_attention(q, k, k, is_causal=True, key_value_seq_lengths=n)
    )(q, k, lengths)
    shapes = [tuple(v.aval.shape) for v in _all_vars(jaxpr.jaxpr)]
    assert not any(len(x) >= 2 and x[-2:] == (t, s) for x in shapes)


def _all_vars(jaxpr):
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_vars(inner)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(key=jnp.zeros((B, S, 4, H)), value=jnp.zeros((B, S, 4, H))), ValueError, "multiple of the key/value"),
        (dict(key=jnp.zeros((B, S, K, 4))), ValueError, r"one B, S, K and H"),
        (dict(value=jnp.zeros((B, S + 1, K, H))), ValueError, r"value \(2, 12, 3, 5\)"),
        (dict(query=jnp.zeros((T, N, H))), ValueError, "all be"),
        (dict(mask=jnp.ones((B, N, T, S), jnp.int32)), TypeError, "mask must be boolean"),
        (dict(mask=jnp.ones((B, 4, T, S), bool)), ValueError, r"mask of shape \(2, 4, 7, 11\)"),
        (dict(bias=jnp.ones((3, N, T, S))), ValueError, r"bias of shape \(3, 6, 7, 11\) does not broadcast"),
        (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"query_seq_lengths must have shape \(B,\)"),
        (dict(key_value_seq_lengths=jnp.ones((B,))), TypeError, "key_value_seq_lengths must be an integer array"),
        (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
        (dict(local_window_size=-1), ValueError, "local_window_size left"),
        (dict(implementation="flash"), ValueError, "implementation must be"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    q, k, v = qkv()
    args = dict(query=q, key=k, value=v) | kwargs
    with pytest.raises(error, match=match):
        jattn.dot_product_attention(**args)
