"""The series' variants in the one core: GQA, cross-attention, linear attention, receptive
fields, and KV-cache decoding equal to the full causal pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import jattn
import jattn.linen
import jattn.nnx
from jattn import masks
from tests import reference as ref


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# -- grouped-query attention ------------------------------------------------------------------


def test_gqa_is_broadcasting_and_kv_grads_are_group_sums():
    B, K, G, T, S, D = 2, 3, 4, 7, 11, 5
    q, k, v = _rand((B, K, G, T, D), 0), _rand((B, K, 1, S, D), 1), _rand((B, K, 1, S, D), 2)
    rep = lambda x: jnp.repeat(x, G, axis=2)  # noqa: E731  multi-head attention with k/v repeated

    def loss(k, v):
        return jnp.sum(jnp.tanh(jattn.attention(q, k, v, mask=masks.causal())))

    @jax.jit
    def run(q, k, v):
        grouped, repeated = jattn.attention(q, k, v), jattn.attention(q, rep(k), rep(v))
        return grouped, repeated, jax.grad(loss, argnums=(0, 1))(k, v), jax.grad(loss, argnums=(0, 1))(rep(k), rep(v))

    grouped, repeated, (dk, dv), (dk_rep, dv_rep) = run(q, k, v)
    np.testing.assert_allclose(grouped, repeated, **ref.tol(jnp.float32))
    np.testing.assert_allclose(dk, dk_rep.sum(2, keepdims=True), **ref.tol(jnp.float32))
    np.testing.assert_allclose(dv, dv_rep.sum(2, keepdims=True), **ref.tol(jnp.float32))


# -- cross-attention --------------------------------------------------------------------------


def test_cross_attention_nnx_linen_reference_and_context_padding():
    B, T, S, d, c = 2, 5, 9, 12, 7
    x, ctx = _rand((B, T, d), 0), _rand((B, S, c), 1)
    context_mask = jnp.arange(S)[None] < jnp.array([[6], [0]])  # example 1 has no valid context
    m = jattn.nnx.CrossAttention(d, c, num_heads=3, num_kv_heads=1, out_proj=False, rngs=nnx.Rngs(0))
    lin = jattn.linen.CrossAttention(d, num_heads=3, num_kv_heads=1, out_proj=False, context_features=c)
    params = ref.linen_params(m)
    assert jax.tree.map(jnp.shape, lin.init(jax.random.key(0), x, ctx)["params"]) == jax.tree.map(jnp.shape, params)

    @nnx.jit
    def run(m, params, x, ctx):
        out = m(x, ctx, context_mask=context_mask)
        grad = jax.grad(lambda c: jnp.sum(m(x, c, context_mask=context_mask) ** 2))(ctx)
        return out, lin.apply({"params": params}, x, ctx, context_mask=context_mask), grad

    out, out_linen, g = run(m, params, x, ctx)
    np.testing.assert_allclose(out, out_linen, atol=1e-6)
    p = {n: np.asarray(params[n]["kernel"], np.float64) for n in params}
    heads = lambda a, h: a.reshape(B, a.shape[1], h, -1).transpose(0, 2, 1, 3)  # noqa: E731
    want, _, _ = ref.attention(
        heads(np.asarray(x) @ p["wq"], 3),
        heads(np.asarray(ctx) @ p["wk"], 1),
        heads(np.asarray(ctx) @ p["wv"], 1),
        mask=np.asarray(context_mask)[:, None, None, :],
    )
    np.testing.assert_allclose(out, want.transpose(0, 2, 1, 3).reshape(B, T, -1), **ref.tol(jnp.float32))
    assert np.all(np.asarray(out[1]) == 0.0)
    assert np.all(np.asarray(g[0, 6:]) == 0.0) and np.all(np.asarray(g[1]) == 0.0)
    with pytest.raises(ValueError, match=r"context must have shape \(\.\.\., length >= 1, 7\), got \(2, 9, 6\)"):
        m(x, ctx[..., :6])


# -- linear attention -------------------------------------------------------------------------


def _quadratic_linear(q, k, v, phi, causal, eps=1e-6, kv_mask=None):
    fq, fk = phi(ref.f64(q)), phi(ref.f64(k))
    a = fq @ np.swapaxes(fk, -1, -2)
    if causal:
        a = a * np.tril(np.ones(a.shape[-2:]))
    if kv_mask is not None:
        a = a * kv_mask[..., None, :]
    return (a @ ref.f64(v)) / (a.sum(-1, keepdims=True) + eps)


PHI = {"elu": lambda x: np.where(x > 0, x + 1, np.exp(x)), "relu": lambda x: np.maximum(x, 0)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_linear_attention_equals_its_quadratic_form(causal, feature_map, chunk_size):
    with jax.enable_x64(True):
        q, k = _rand((2, 3, 13, 5), 0, jnp.float64), _rand((2, 1, 13, 5), 1, jnp.float64)
        v = _rand((2, 1, 13, 6), 2, jnp.float64)
        kv_mask = np.arange(13)[None, None] < np.array([13, 9])[:, None, None]  # (B, 1, S)
        out = jax.jit(
            lambda q, k, v: jattn.linear_attention(
                q, k, v, feature_map=feature_map, causal=causal, chunk_size=chunk_size, kv_mask=kv_mask
            )
        )(q, k, v)
        want = _quadratic_linear(q, k, v, PHI[feature_map], causal, kv_mask=kv_mask)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
        f = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, causal=causal, chunk_size=chunk_size))
        check_grads(f, (q, k, v), order=1, modes=["rev"])


def test_linear_attention_state_continues_and_user_feature_map():
    q, k, v = _rand((2, 20, 4), 0), _rand((2, 20, 4), 1), _rand((2, 20, 3), 2)
    full = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, causal=True, chunk_size=8))(q, k, v)
    prompt = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, causal=True, return_state=True))
    step = jax.jit(
        lambda q, k, v, state: jattn.linear_attention(q, k, v, causal=True, initial_state=state, return_state=True)
    )
    a, state = prompt(q[:, :7], k[:, :7], v[:, :7])
    outs = [a]
    for t in range(7, 20):  # one token at a time from the recurrent state
        o, state = step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], state)
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **ref.tol(jnp.float32))
    square = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, feature_map=jnp.square))(q, k, v)
    np.testing.assert_allclose(square, _quadratic_linear(q, k, v, np.square, False), rtol=1e-4, atol=1e-5)


def test_linear_attention_guard_on_vanishing_feature_sums():
    q = -jnp.abs(_rand((6, 4), 0)) - 1e-3  # relu features of q are exactly zero
    k, v = _rand((6, 4), 1), _rand((6, 3), 2)
    out = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, feature_map="relu"))(q, k, v)
    assert np.all(np.asarray(out) == 0.0)
    g = jax.jit(jax.grad(lambda k: jnp.sum(jattn.linear_attention(q + 1e-3, k * 1e-20, v, feature_map="relu"))))(k)
    assert np.all(np.isfinite(g))
    with pytest.raises(ValueError, match="causal linear attention needs T == S"):
        jattn.linear_attention(q, k[:5], v[:5], causal=True)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        jattn.linear_attention(q, k, v, feature_map="softplus2")


def test_linear_kind_in_modules():
    x = _rand((2, 9, 12), 0)
    m = jattn.nnx.SelfAttention(12, num_heads=2, kind="linear", rngs=nnx.Rngs(0))
    lin = jattn.linen.SelfAttention(12, num_heads=2, kind="linear")
    params = ref.linen_params(m)
    out, out_linen = nnx.jit(lambda m, p, x: (m(x, masks.causal()), lin.apply({"params": p}, x, masks.causal())))(
        m, params, x
    )
    np.testing.assert_allclose(out, out_linen, atol=1e-6)
    qh = (x @ params["wq"]["kernel"]).reshape(2, 9, 2, 6).transpose(0, 2, 1, 3)
    kh = (x @ params["wk"]["kernel"]).reshape(2, 9, 2, 6).transpose(0, 2, 1, 3)
    vh = (x @ params["wv"]["kernel"]).reshape(2, 9, 2, 6).transpose(0, 2, 1, 3)
    heads = _quadratic_linear(qh, kh, vh, PHI["elu"], True).transpose(0, 2, 1, 3).reshape(2, 9, 12)
    np.testing.assert_allclose(out, heads @ np.asarray(params["wo"]["kernel"], np.float64), **ref.tol(jnp.float32))
    with pytest.raises(ValueError, match=r"kind='linear' takes mask=None or masks\.causal\(\)"):
        m(x, masks.sliding_window(2))


# -- receptive field --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "kind"),
    [(masks.causal(), "softmax"), (masks.sliding_window(2), "softmax"), (masks.causal(), "linear")],
)
def test_receptive_field_is_exactly_the_mask(mask, kind):
    T, d = 8, 6
    m = jattn.nnx.SelfAttention(d, num_heads=2, kind=kind, rngs=nnx.Rngs(0))
    x = _rand((1, T, d), 1)
    jac = nnx.jit(lambda m, x: jax.jacobian(lambda x: m(x, mask)[0])(x))(m, x)[:, :, 0]  # (T, d, T, d)
    reach = np.abs(np.asarray(jac)).sum(axis=(1, 3)) > 0
    np.testing.assert_array_equal(reach, np.asarray(mask.dense(T, T)))


# -- decoding with a cache --------------------------------------------------------------------

DECODE = [
    (dict(num_heads=2), masks.causal(), {}),
    (dict(num_heads=4, num_kv_heads=2), masks.causal(), {}),
    (dict(num_heads=2), masks.sliding_window(3), dict(window=3)),
    # A decoder's Longformer mask is causal: global tokens see (and are seen by) all the past.
    (
        dict(num_heads=2),
        masks.causal() & (masks.sliding_window(3) | masks.global_tokens([0, 1])),
        dict(window=3, pinned=(0, 1)),
    ),
    (dict(num_heads=2, kind="linear"), masks.causal(), {}),
]


@pytest.mark.parametrize(("options", "mask", "cache"), DECODE)
@pytest.mark.parametrize(
    ("steps", "jit"), [((5, 1, 1, 1, 1, 1, 1), False), ((3, 2, 4, 1, 3), True)], ids=["eager", "jit"]
)
def test_decoding_equals_the_full_causal_pass(options, mask, cache, steps, jit):
    T, d = sum(steps), 12
    m = jattn.nnx.SelfAttention(d, rngs=nnx.Rngs(0), **options)
    x = _rand((2, T, d), 1)
    full = nnx.jit(lambda m, x: m(x, mask))(m, x)  # the reference: one program
    m.init_cache(2, T, **cache)
    step = lambda m, x: m(x, mask, decode=True)  # noqa: E731
    if jit:  # the module called both ways; under nnx.jit one compile a call shape, not one an operation
        step = nnx.jit(step)
    outs, t = [], 0
    for n in steps:  # a prompt, then one or more tokens per call
        outs.append(step(m, x[:, t : t + n]))
        t += n
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **ref.tol(jnp.float32))
    if cache.get("window"):
        assert m.cache["k"].shape[1] == cache["window"] + len(cache.get("pinned", ()))


@pytest.mark.parametrize(("options", "cache"), [(dict(num_heads=2), {}), (dict(kind="linear"), {})])
def test_ragged_batch_decodes_each_example_like_alone(options, cache):
    d, prompts, T = 12, [3, 6], 9
    m = jattn.nnx.SelfAttention(d, rngs=nnx.Rngs(0), **options)
    x = _rand((2, T, d), 2)
    m.init_cache(2, T)
    step = nnx.jit(lambda m, x, lengths=None: m(x, masks.causal(), decode=True, lengths=lengths))
    first = step(m, x[:, :6], jnp.array(prompts))  # padded prompt
    got = [[first[0, :3]], [first[1, :6]]]
    for i in range(3):  # each example continues from its own position
        tok = jnp.stack([x[0, 3 + i], x[1, 6 + i]])[:, None]
        out = step(m, tok)
        got[0].append(out[0])
        got[1].append(out[1])
    alone = nnx.jit(lambda m, x: m(x, masks.causal())[0])
    for b, length in enumerate(prompts):
        np.testing.assert_allclose(
            jnp.concatenate(got[b]), alone(m, x[b : b + 1, : length + 3]), **ref.tol(jnp.float32)
        )
