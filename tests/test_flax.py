"""jattn.flax.attention_fn inside Flax's own modules equals Flax's default attention_fn.

Same parameters, same inputs, same dropout key: NNX ``MultiHeadAttention`` and Linen
``MultiHeadDotProductAttention`` with jattn's attention_fn against the same module with Flax's
default, with and without masks, in training (dropout, sown weights) and in decoding.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.flax
from tests import reference as ref

B, T, S, F = 2, 7, 11, 10
TOL = ref.tol(jnp.float32)


def inputs(t=T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, t, F)), jnp.float32)


def pad_mask(t=T, s=S):
    """A float (B, 1, T, S) mask as Flax builds them, every query keeping a key."""
    keys = jnp.arange(s)[None, :] < jnp.array([[s], [4]])  # example 1 has 4 keys
    return nnx.make_attention_mask(jnp.ones((B, t), bool), keys)


def nnx_pair(**kw):
    def make(fn):
        return nnx.MultiHeadAttention(
            num_heads=6,
            num_kv_heads=3,
            in_features=F,
            qkv_features=30,
            attention_fn=fn,
            rngs=nnx.Rngs(0, dropout=1),
            **kw,
        )

    return make(nnx.dot_product_attention), make(jattn.flax.attention_fn)


@pytest.mark.parametrize(
    "case", ["plain", "causal_mask", "is_causal", "cross_padding"], ids=lambda c: c.replace("_", "-")
)
def test_nnx_equals_flax_default(case):
    flax_mha, jattn_mha = nnx_pair()
    x, kv = inputs(), inputs(S, seed=1)
    args = dict(
        plain=((x,), {}),
        causal_mask=((x,), dict(mask=nnx.make_causal_mask(x[..., 0]))),
        is_causal=((x,), dict(is_causal=True)),
        cross_padding=((x, kv), dict(mask=pad_mask())),
    )[case]
    want, got = nnx.jit(lambda f, j, a: (f(*a, decode=False, **args[1]), j(*a, decode=False, **args[1])))(
        flax_mha, jattn_mha, args[0]
    )
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_nnx_dropout_and_sown_weights_equal_flax(broadcast_dropout):
    flax_mha, jattn_mha = nnx_pair(dropout_rate=0.3, broadcast_dropout=broadcast_dropout)
    x = inputs()
    mask = nnx.make_causal_mask(x[..., 0])
    kw = dict(mask=mask, decode=False, deterministic=False, sow_weights=True)

    @nnx.jit
    def run(f, j, x):
        off = dict(mask=mask, decode=False, deterministic=True)
        captured = nnx.capture(f, nnx.Intermediate)(x, **kw), nnx.capture(j, nnx.Intermediate)(x, **kw)
        return captured, f(x, **off), j(x, **off)

    ((want, w_flax), (got, w_jattn)), free_flax, free_jattn = run(flax_mha, jattn_mha, x)
    np.testing.assert_allclose(got, want, **TOL)
    (w_flax,), (w_jattn,) = w_flax["attention_weights"].get_value(), w_jattn["attention_weights"].get_value()
    assert w_jattn.shape == w_flax.shape == (B, 6, T, T)
    np.testing.assert_allclose(w_jattn, w_flax, **TOL)
    # deterministic: no dropout, same output again
    np.testing.assert_allclose(free_jattn, free_flax, **TOL)


def test_nnx_decoding_equals_flax_and_the_full_pass():
    flax_mha, jattn_mha = nnx_pair()
    x = inputs()
    full = nnx.jit(lambda m, x: m(x, decode=False, is_causal=True))(flax_mha, x)
    for m in (flax_mha, jattn_mha):
        m.init_cache(x.shape)
    step = nnx.jit(lambda f, j, x: (f(x, decode=True), j(x, decode=True)))  # both modules, one program
    for t in range(T):
        want, got = step(flax_mha, jattn_mha, x[:, t : t + 1])
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_allclose(got, full[:, t : t + 1], **TOL)


def linen_pair(**kw):
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=15, **kw)
    jattn_mha = nn.MultiHeadDotProductAttention(
        num_heads=3, qkv_features=15, attention_fn=jattn.flax.attention_fn, **kw
    )
    return flax_mha, jattn_mha


@pytest.mark.parametrize("case", ["plain", "causal_mask", "cross_padding"], ids=lambda c: c.replace("_", "-"))
def test_linen_equals_flax_default(case):
    flax_mha, jattn_mha = linen_pair()
    x, kv = inputs(), inputs(S, seed=1)
    args, kw = dict(
        plain=((x,), {}),
        causal_mask=((x,), dict(mask=nn.make_causal_mask(x[..., 0]))),
        cross_padding=((x, kv), dict(mask=pad_mask())),
    )[case]
    params = jax.jit(flax_mha.init)(jax.random.key(0), *args)
    got, want = jax.jit(lambda p, a: (jattn_mha.apply(p, *a, **kw), flax_mha.apply(p, *a, **kw)))(params, args)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_linen_dropout_and_sown_weights_equal_flax(broadcast_dropout):
    flax_mha, jattn_mha = linen_pair(dropout_rate=0.3, broadcast_dropout=broadcast_dropout)
    x = inputs()
    mask = nn.make_causal_mask(x[..., 0])
    params = jax.jit(lambda key, x: flax_mha.init(key, x, deterministic=True))(jax.random.key(0), x)
    kw = dict(
        mask=mask, deterministic=False, sow_weights=True, rngs={"dropout": jax.random.key(5)}, mutable=["intermediates"]
    )
    (want, w_flax), (got, w_jattn) = jax.jit(lambda p, x: (flax_mha.apply(p, x, **kw), jattn_mha.apply(p, x, **kw)))(
        params, x
    )
    np.testing.assert_allclose(got, want, **TOL)
    (wf,), (wj,) = w_flax["intermediates"]["attention_weights"], w_jattn["intermediates"]["attention_weights"]
    assert wj.shape == wf.shape == (B, 3, T, T)
    np.testing.assert_allclose(wj, wf, **TOL)


def test_linen_decoding_equals_flax_and_the_full_pass():
    flax_mha, _ = linen_pair()
    x = inputs()
    params = jax.jit(flax_mha.init)(jax.random.key(0), x)
    full = jax.jit(lambda p, x: flax_mha.apply(p, x, mask=nn.make_causal_mask(x[..., 0])))(params, x)
    dec_flax, dec_jattn = linen_pair(decode=True)
    cache = jax.jit(dec_flax.init)(jax.random.key(0), x)["cache"]

    @jax.jit  # both modules' steps, one program
    def step(params, caches, x):
        outs = [
            m.apply({**params, "cache": c}, x, mutable=["cache"])
            for m, c in zip((dec_flax, dec_jattn), caches, strict=True)
        ]
        return [y for y, _ in outs], [mut["cache"] for _, mut in outs]

    caches = [cache, cache]
    for t in range(T):
        outs, caches = step(params, caches, x[:, t : t + 1])
        np.testing.assert_allclose(outs[1], outs[0], **TOL)
        np.testing.assert_allclose(outs[1], full[:, t : t + 1], **TOL)


def test_function_with_bias_gqa_and_top_left_causal_equals_flax():
    """The function alone: bias, GQA, Flax's is_causal (top-left) with T != S, extra batch dims."""
    r = np.random.default_rng(3)
    q = jnp.asarray(r.normal(size=(2, B, T, 6, 5)), jnp.float32)
    k = jnp.asarray(r.normal(size=(2, B, S, 3, 5)), jnp.float32)
    v = jnp.asarray(r.normal(size=(2, B, S, 3, 5)), jnp.float32)
    bias = jnp.asarray(r.normal(size=(2, B, 6, T, S)), jnp.float32)  # Flax flattens batch dims: give them all
    mask = jnp.broadcast_to(pad_mask(), (2, B, 1, T, S))
    cases = (dict(bias=bias), dict(is_causal=True), dict(bias=bias, is_causal=True, mask=mask))
    outs = jax.jit(
        lambda q, k, v: [
            (jattn.flax.attention_fn(q, k, v, **kw), nnx.dot_product_attention(q, k, v, **kw)) for kw in cases
        ]
    )(q, k, v)
    for kw, (got, want) in zip(cases, outs, strict=True):
        np.testing.assert_allclose(got, want, **TOL, err_msg=str(kw.keys()))


def test_dtype_and_unbatched():
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.normal(size=(T, 3, 5)), jnp.float32) for _ in range(3))
    out, want = jax.jit(
        lambda q, k, v: (
            jattn.flax.attention_fn(q, k, v, dtype=jnp.bfloat16),
            nn.dot_product_attention(q, k, v, force_fp32_for_softmax=True),
        )
    )(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == (T, 3, 5)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.bfloat16))


def _all_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_shapes(inner)


def test_mask_predicate_keeps_the_blockwise_path():
    """A jattn.masks predicate through nnx.MultiHeadAttention: no (T, S) scores anywhere in the jaxpr."""
    t = 2048  # the automatic tiles are smaller than T (at T=1024 a causal call may take one 1024² tile)
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, attention_fn=jattn.flax.attention_fn, rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((1, t, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x: mha(x, mask=jattn.masks.causal(), decode=False))(x)
    assert not any(len(s) >= 2 and s[-2:] == (t, t) for s in _all_shapes(jaxpr.jaxpr))
    q = jnp.zeros((1, 2, 1, t, 4))
    assert jattn.choose_implementation(q, q, q, mask=jattn.masks.causal()) == "blockwise"
    # the check can fail: the dense path does materialise them
    qs = jax.ShapeDtypeStruct((1, t, 2, 4), jnp.float32)
    dense = jax.make_jaxpr(
        lambda q: jattn.flax.attention_fn(q, q, q, mask=jattn.masks.causal(), implementation="dense")
    )(qs)
    assert any(len(s) >= 2 and s[-2:] == (t, t) for s in _all_shapes(dense.jaxpr))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dropout_rate=0.1), "needs a dropout_rng"),
        (dict(qk_attn_weights_einsum=jnp.einsum), "qk_attn_weights_einsum"),
        (dict(mask=jattn.masks.sliding_window(2), is_causal=True), r"T=7 != S=11"),
        (dict(mask=jnp.ones((B, 4, T, S))), r"mask of shape \(2, 4, 7, 11\) does not broadcast"),
        (dict(bias=jnp.ones((3, 1, T, S))), r"bias of shape \(3, 1, 7, 11\)"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    r = np.random.default_rng(5)
    q = jnp.asarray(r.normal(size=(B, T, 6, 5)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, S, 3, 5)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        jattn.flax.attention_fn(q, k, k, **kwargs)
