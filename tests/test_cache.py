"""Issue #14 item 3: the modules' cache in NNX and Linen (one helper), rope, QK norm, batch dims, sow.

Every comparison is against an independent reference: the full causal pass (a different code path
from the cache), a float64 NumPy rotary embedding, Flax's own ``nnx.MultiHeadAttention`` for the QK
norm, the flattened batch for leading dims, or the returned weights for the sown ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.linen
import jattn.nnx
from jattn import masks
from tests import reference as ref

D = 12  # d_model
F32 = ref.tol(jnp.float32)


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _params(m) -> dict:
    """An NNX module's weights as Linen ``params`` (the same names)."""
    out = {}
    for name in ("wq", "wk", "wv", "wo", "query_ln", "key_ln"):
        layer = getattr(m, name)
        if layer is None:
            continue
        if name.endswith("_ln"):
            out[name] = {"scale": layer.scale[...]}
        else:
            out[name] = {"kernel": layer.kernel[...]} | ({} if layer.bias is None else {"bias": layer.bias[...]})
    return out | {name: getattr(m, name)[...] for name in getattr(m, "gate_names", ())}  # a recurrent kind's gates


def _nnx(seed=0, **options):
    """An NNX module with random QK-norm scales (so a swapped or missing norm shows)."""
    m = jattn.nnx.SelfAttention(D, rngs=nnx.Rngs(seed), **options)
    if m.query_ln is not None:
        m.query_ln.scale[...] = 1 + 0.5 * _rand(m.query_ln.scale.shape, 10 + seed)
        m.key_ln.scale[...] = 1 + 0.5 * _rand(m.key_ln.scale.shape, 20 + seed)
    return m


# -- rope ---------------------------------------------------------------------------------------


def test_rope_matches_float64_reference_and_keeps_relative_scores():
    rope = jax.jit(jattn.rope, static_argnames="base")
    score = jax.jit(lambda q, k, pq, pk: jnp.sum(jattn.rope(q, pq) * jattn.rope(k, pk), -1))
    with jax.enable_x64(True):
        x = _rand((2, 5, 3, 6), 0, jnp.float64)  # (B, L, N, D)
        pos = jax.random.randint(jax.random.key(1), (2, 5, 1), 0, 3000)  # (B, L, 1): per example and row
        np.testing.assert_allclose(rope(x, pos, base=500.0), ref.rope(x, pos, 500.0), **ref.tol(jnp.float64))
        # the score of a rotated query and key depends on the positions only through their difference
        q, k = _rand((7, 8), 2, jnp.float64), _rand((7, 8), 3, jnp.float64)
        pq, pk = jnp.arange(7) * 3, jnp.arange(7)[::-1] * 5
        s1, s2 = score(q, k, pq, pk), score(q, k, pq + 1234, pk + 1234)
        assert not np.allclose(s1, score(q, k, pq, pk + 1), rtol=1e-6)  # the positions do count
        np.testing.assert_allclose(s1, s2, rtol=1e-9, atol=1e-9)
    x = _rand((4, 10), 4)  # float32, small positions, (L,) positions shared by every row
    np.testing.assert_allclose(rope(x, jnp.arange(4)), ref.rope(x, np.arange(4)), **F32)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: jattn.rope(jnp.ones((3, 5)), jnp.arange(3)), ValueError, r"rope x must have an even .* \(3, 5\)"),
        (lambda: jattn.rope(jnp.ones((3, 4)), jnp.ones(3)), TypeError, "rope positions must be an integer array"),
        (lambda: jattn.rope(jnp.ones((3, 4)), jnp.arange(5)), ValueError, r"rope positions of shape \(5,\)"),
        (lambda: jattn.rope(jnp.ones((3, 4)), jnp.arange(3), base=0.0), ValueError, "rope base must be"),
        (lambda: jattn.rope(jnp.ones((3, 4), jnp.int32), jnp.arange(3)), TypeError, "rope x must be floating"),
    ],
    ids=["odd_depth", "float_positions", "positions_shape", "base_zero", "integer_x"],
)
def test_rope_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_module_rope_and_qk_norm_full_pass_match_float64_reference():
    """norm -> rope at 0..T-1 per head -> causal attention -> wo, all in float64 NumPy."""
    N, T = 3, 7
    m = _nnx(num_heads=N, rope=True, rope_base=100.0, normalize_qk=True)
    x = _rand((2, T, D), 1)
    p = {n: {k: ref.f64(v) for k, v in d.items()} for n, d in _params(m).items()}

    def heads(a, name):  # (B, T, N*D) -> per-head LayerNorm (no bias, eps 1e-6) -> (B, N, T, D)
        a = a.reshape(2, T, N, -1)
        a = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-6) * p[name]["scale"]
        return ref.rope(a, np.arange(T)[None, :, None], 100.0).transpose(0, 2, 1, 3)

    xs = ref.f64(x)
    q, k = heads(xs @ p["wq"]["kernel"], "query_ln"), heads(xs @ p["wk"]["kernel"], "key_ln")
    v = (xs @ p["wv"]["kernel"]).reshape(2, T, N, -1).transpose(0, 2, 1, 3)
    o, _, _ = ref.attention(q, k, v, mask=np.tril(np.ones((T, T), bool)))
    want = o.transpose(0, 2, 1, 3).reshape(2, T, D) @ p["wo"]["kernel"]
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x, masks.causal()))(m, x), want, **F32)


def test_normalize_qk_matches_flax_multihead_attention():
    N, T = 3, 7
    m = _nnx(num_heads=N, use_bias=True, normalize_qk=True)
    f = nnx.MultiHeadAttention(
        num_heads=N, in_features=D, qkv_features=D, out_features=D, normalize_qk=True, decode=False, rngs=nnx.Rngs(1)
    )
    for ours, theirs in (("wq", "query"), ("wk", "key"), ("wv", "value")):
        getattr(f, theirs).kernel[...] = getattr(m, ours).kernel[...].reshape(D, N, D // N)
        getattr(f, theirs).bias[...] = getattr(m, ours).bias[...].reshape(N, D // N)
    f.out.kernel[...] = m.wo.kernel[...].reshape(N, D // N, D)
    f.out.bias[...] = m.wo.bias[...]
    f.query_ln.scale[...], f.key_ln.scale[...] = m.query_ln.scale[...], m.key_ln.scale[...]
    x = _rand((2, T, D), 2)
    mask = jax.random.bernoulli(jax.random.key(3), 0.6, (2, T, T)) | jnp.eye(T, dtype=bool)[None]  # no empty row
    ours, theirs = nnx.jit(lambda m, f, x, mask: (m(x, mask), f(x, mask=mask[:, None])))(m, f, x, mask)
    np.testing.assert_allclose(ours, theirs, **F32)


# -- the cache: Linen == full causal pass == NNX -------------------------------------------------

LONGFORMER = masks.causal() & (masks.sliding_window(3) | masks.global_tokens([0, 2]))
KINDS = [
    pytest.param(
        dict(num_heads=4, num_kv_heads=2, qkv_features=16, rope=True, normalize_qk=True),
        masks.causal(),
        {},
        id="full_rope",
    ),
    pytest.param(dict(num_heads=2, rope=True), masks.sliding_window(3), dict(window=3), id="window_rope"),
    pytest.param(dict(num_heads=2, rope=True), LONGFORMER, dict(window=3, pinned=(0, 2)), id="pinned_rope"),
    pytest.param(dict(num_heads=2, kind="linear", rope=True), masks.causal(), {}, id="linear_rope"),
    pytest.param(dict(num_heads=2, kind="kda", rope=True), masks.causal(), {}, id="kda_rope"),
]


@pytest.mark.parametrize(("options", "mask", "layout"), KINDS)
def test_linen_decoding_equals_full_pass_and_nnx(options, mask, layout):
    """Each step's Linen output equals NNX's, and the steps together the full causal pass (NNX's and Linen's)."""
    steps, B = (5, 1, 1), 2
    T = sum(steps)
    m = _nnx(**options)
    lin = jattn.linen.SelfAttention(D, **options)
    params = _params(m)
    x = _rand((B, T, D), 1)
    full, full_nnx = nnx.jit(lambda m, p, x: (lin.apply({"params": p}, x, mask), m(x, mask)))(m, params, x)
    np.testing.assert_allclose(full, full_nnx, **F32)
    cache = lin.init(jax.random.key(0), B, T, method="init_cache", **layout)["cache"]
    m.init_cache(B, T, **layout)

    @nnx.jit  # one program a step shape for both modules
    def step(m, v, x):
        out, state = lin.apply(v, x, mask, decode=True, mutable=["cache"])
        return out, state["cache"], m(x, mask, decode=True)

    got, t = [], 0
    for n in steps:
        out, cache, out_nnx = step(m, {"params": params, "cache": cache}, x[:, t : t + n])
        np.testing.assert_allclose(out, out_nnx, **F32)
        got.append(out)
        t += n
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, **F32)
    if layout.get("window"):
        assert cache["k"].shape[1] == layout["window"] + len(layout.get("pinned", ()))


@pytest.mark.parametrize(
    ("mask", "layout", "row"),
    [
        pytest.param(
            masks.causal() & (masks.sliding_window(2) | masks.global_tokens([4])),
            dict(window=2, pinned=(4,)),
            4,
            id="global_query",
        ),
        pytest.param(masks.causal() & masks.sliding_window(3), dict(window=2), 3, id="wider_window"),
        pytest.param(
            masks.causal() & (masks.sliding_window(2) | masks.global_tokens([1])), dict(window=2), 4, id="unpinned_key"
        ),
    ],
)
def test_a_ring_that_dropped_keys_the_mask_sees_refuses(mask, layout, row):
    """Eager decoding raises naming the first such query; under jit its output is NaN, earlier ones the full pass's."""
    m, x = _nnx(num_heads=2), _rand((1, 6, D), 1)
    full = nnx.jit(lambda m, x: m(x, mask))(m, x)
    m.init_cache(1, 6, **layout)
    for t in range(row):
        np.testing.assert_allclose(m(x[:, t : t + 1], mask, decode=True), full[:, t : t + 1], **F32)
    with pytest.raises(ValueError, match=f"query at position {row} .* has dropped"):
        m(x[:, row : row + 1], mask, decode=True)
    m.init_cache(1, 6, **layout)
    step = nnx.jit(lambda m, x: m(x, mask, decode=True))
    got = jnp.concatenate([step(m, x[:, t : t + 1]) for t in range(6)], 1)
    np.testing.assert_allclose(got[:, :row], full[:, :row], **F32)
    assert np.all(np.isnan(np.asarray(got[:, row])))


def test_linen_ragged_prefill_decodes_each_example_like_alone():
    """A padded prompt of lengths (2, 5), then two tokens each: each example's outputs equal its full causal pass alone."""
    options = dict(num_heads=2, rope=True)
    prompts, T = [2, 5], 7
    lin = jattn.linen.SelfAttention(D, decode=True, **options)  # the field is the call's default
    params = _params(_nnx(**options))
    x = _rand((2, T, D), 2)
    variables = {"params": params} | lin.init(jax.random.key(0), 2, T, method="init_cache")
    step = jax.jit(lambda v, x, lengths=None: lin.apply(v, x, lengths=lengths, mutable=["cache"]))
    first, state = step(variables, x[:, :5], jnp.array(prompts))
    got = [[first[0, :2]], [first[1, :5]]]
    for i in range(2):  # each example continues from its own position
        tok = jnp.stack([x[0, 2 + i], x[1, 5 + i]])[:, None]
        out, state = step({"params": params} | state, tok)
        got[0].append(out[0])
        got[1].append(out[1])
    alone = jax.jit(lambda p, x: lin.apply({"params": p}, x, masks.causal(), decode=False)[0])
    for b, length in enumerate(prompts):
        np.testing.assert_allclose(jnp.concatenate(got[b]), alone(params, x[b : b + 1, : length + 2]), **F32)


def test_decoding_with_leading_batch_dims_equals_full_pass():
    m = _nnx(num_heads=2, rope=True)
    x = _rand((2, 3, 7, D), 3)  # batch dims (2, 3)
    full = nnx.jit(lambda m, x: m(x, masks.causal()))(m, x)
    m.init_cache(6, 7)
    step = nnx.jit(lambda m, x, lengths=None: m(x, decode=True, lengths=lengths))
    a = step(m, x[..., :5, :], jnp.full((2, 3), 5))
    b = step(m, x[..., 5:, :])
    np.testing.assert_allclose(jnp.concatenate([a, b], -2), full, **F32)


# -- batch dims, unbatched input, sow: NNX == Linen ------------------------------------------------


def test_leading_batch_dims_and_unbatched_input_nnx_equals_linen():
    """Batch dims (3, 2) and an unbatched call equal the flattened batch's rows, in NNX and Linen, self and cross."""
    T = 7
    m = _nnx(num_heads=2, normalize_qk=True, rope=True)
    lin = jattn.linen.SelfAttention(D, num_heads=2, normalize_qk=True, rope=True)
    cross = jattn.nnx.CrossAttention(D, 5, num_heads=2, normalize_qk=True, rngs=nnx.Rngs(1))
    lin_cross = jattn.linen.CrossAttention(D, num_heads=2, normalize_qk=True, context_features=5)
    x = _rand((3, 2, T, D), 4)  # batch dims (3, 2)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (3, 1, 2, T, T))  # (*batch, N, T, S), axis 1 broadcast
    ctx, valid = _rand((3, 2, 4, 5), 6), jax.random.bernoulli(jax.random.key(7), 0.7, (3, 2, 4))

    @nnx.jit  # every call of the test in one program
    def run(m, cross, params, cross_params, x, mask, ctx, valid):
        flat_mask = jnp.broadcast_to(mask, (3, 2, 2, T, T)).reshape(6, 2, T, T)
        per_example = mask[:, :, 0]  # (*batch, T, S): the same for every head
        flat_example = jnp.broadcast_to(per_example, (3, 2, T, T)).reshape(6, T, T)
        return dict(
            out=m(x, mask, return_weights=True),
            flat=m(x.reshape(6, T, D), flat_mask, return_weights=True),
            one=m(x[2, 1], mask[2, 0], return_weights=True),  # unbatched: (T, F), mask (N, T, S)
            lin=lin.apply({"params": params}, x, mask),
            lin_one=lin.apply({"params": params}, x[2, 1], mask[2, 0]),
            example=m(x, per_example),
            flat_example=m(x.reshape(6, T, D), flat_example),
            cross=cross(x, ctx, context_mask=valid),
            flat_cross=cross(x.reshape(6, T, D), ctx.reshape(6, 4, 5), context_mask=valid.reshape(6, 4)),
            lin_cross=lin_cross.apply({"params": cross_params}, x, ctx, context_mask=valid),
        )

    r = run(m, cross, _params(m), _params(cross), x, mask, ctx, valid)
    out, w = r["out"]
    assert out.shape == (3, 2, T, D) and w.shape == (3, 2, 2, T, T)
    np.testing.assert_allclose(out.reshape(6, T, D), r["flat"][0], **F32)
    np.testing.assert_allclose(w.reshape(6, 2, T, T), r["flat"][1], **F32)
    np.testing.assert_allclose(r["one"][0], out[2, 1], **F32)
    np.testing.assert_allclose(r["one"][1], w[2, 1], **F32)
    np.testing.assert_allclose(r["lin"], out, **F32)
    np.testing.assert_allclose(r["lin_one"], r["one"][0], **F32)
    np.testing.assert_allclose(r["example"], r["flat_example"].reshape(out.shape), **F32)
    got = r["cross"]
    assert got.shape == (3, 2, T, D)
    np.testing.assert_allclose(got, r["flat_cross"].reshape(got.shape), **F32)
    np.testing.assert_allclose(r["lin_cross"], got, **F32)


def test_sow_weights_nnx_intermediate_and_linen_intermediates():
    m = _nnx(num_heads=2, rope=True)
    lin = jattn.linen.SelfAttention(D, num_heads=2, rope=True)
    x = _rand((2, 3, 7, D), 8)

    @nnx.jit
    def run(m, params, x):
        sown = nnx.capture(m, nnx.Intermediate)(x, masks.causal(), sow_weights=True)
        linen = lin.apply({"params": params}, x, masks.causal(), sow_weights=True, mutable=["intermediates"])
        return m(x, masks.causal(), return_weights=True), sown, linen

    (out, want), (got, inter), (lin_out, state) = run(m, _params(m), x)
    (sown,) = inter["attention_weights"].get_value()
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(sown, want)
    (lin_sown,) = state["intermediates"]["attention_weights"]
    np.testing.assert_allclose(lin_out, out, **F32)
    np.testing.assert_allclose(lin_sown, want, **F32)


def test_linen_call_time_dropout_rng():
    """``dropout_rng`` is the key of the core's dropout and takes precedence over the rngs collection."""
    lin = jattn.linen.SelfAttention(D, dropout_rate=0.4)
    x = _rand((2, 7, D), 9)
    params = _params(_nnx())  # the same parameters as lin's (one head, no output projection)
    key = jax.random.key(3)

    @jax.jit
    def run(params, x):
        q, k, v = (x @ params[n]["kernel"] for n in ("wq", "wk", "wv"))
        heads = lambda a: a[:, None, None]  # noqa: E731  (B, T, D) -> (B, K=1, G=1, T, D)
        return (
            lin.apply({"params": params}, x, dropout_rng=key),
            jattn.attention(heads(q), heads(k), heads(v), dropout_rate=0.4, dropout_rng=key)[:, 0, 0],
            lin.apply({"params": params}, x, dropout_rng=key, rngs={"dropout": jax.random.key(5)}),
            lin.apply({"params": params}, x, dropout_rng=jax.random.key(4)),
        )

    got, want, with_rngs, other_key = run(params, x)
    np.testing.assert_allclose(got, want, **F32)
    np.testing.assert_array_equal(with_rngs, got)
    assert not np.allclose(other_key, got)


# -- bad input -------------------------------------------------------------------------------------

X = _rand((2, 3, D), 0)
BAD = [
    ("rope_odd_depth", dict(num_heads=4, rope=True), ValueError, r"rope=True needs an even head depth D .* D=3"),
    ("rope_base_zero", dict(rope=True, rope_base=0.0), ValueError, r"rope_base must be a finite number in \(0.0"),
    ("rope_not_bool", dict(rope=1), TypeError, "rope must be a bool"),
    ("normalize_qk_not_bool", dict(normalize_qk="yes"), TypeError, "normalize_qk must be a bool"),
    ("decode_not_bool", dict(decode=None), TypeError, "decode must be a bool"),
    ("score_mod_not_callable", dict(score_mod=2.0), TypeError, r"score_mod must be a callable .* got 2.0"),
    ("sinks_not_bool", dict(sinks=1), TypeError, "sinks must be a bool"),
    (
        "linear_sinks",
        dict(kind="linear", sinks=True),
        ValueError,
        r"score_mod and sinks need kind='softmax'; got sinks=True",
    ),
]


@pytest.mark.parametrize(("options", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_options_are_named_in_nnx_and_linen(options, error, match):
    with pytest.raises(error, match=match):
        jattn.nnx.SelfAttention(D, rngs=nnx.Rngs(0), **options)
    with pytest.raises(error, match=match):
        jattn.linen.SelfAttention(D, **options).init(jax.random.key(0), X)


def test_bad_calls_are_named():
    m = _nnx(num_heads=2)
    lin = jattn.linen.SelfAttention(D, num_heads=2)
    params = {"params": _params(m)}
    with pytest.raises(TypeError, match="sow_weights must be a bool"):
        m(X, sow_weights=1)
    with pytest.raises(TypeError, match="sow_weights must be a bool"):
        lin.apply(params, X, sow_weights=1)
    with pytest.raises(ValueError, match="decode=True needs a cache"):
        lin.apply(params, X, decode=True)
    x = _rand((3, 2, 4, D), 1)
    with pytest.raises(ValueError, match=r"\(B, T, S\) = \(3, 2, 4, 4\) .*got shape \(2, 3, 4, 4\)"):
        m(x, jnp.ones((2, 3, 4, 4), bool))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., length >= 1, 12\), got \(4,\)"):
        m(jnp.ones((4,)))
    m.init_cache(6, 8)
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(3, 2\), got \(6,\)"):
        m(x, decode=True, lengths=jnp.full((6,), 2))
    with pytest.raises(ValueError, match=r"cache was made for batch_size=6"):
        m(x[:1], decode=True)


# -- score_mod and sinks when decoding: absolute positions, any slot order ---------------------------


def _absolute_mod(slopes):
    """ALiBi plus a term of the key's absolute position (so grid positions in place of real ones show)."""
    alibi = jattn.score_mods.alibi(slopes)
    return lambda s, b, h, i, j: alibi(s, b, h, i, j) + 0.5 * jnp.cos(j.astype(s.dtype))


FLEX_KINDS = [
    pytest.param(masks.causal(), {}, None, id="full"),
    pytest.param(LONGFORMER, dict(window=3, pinned=(0, 2)), "blockwise", id="pinned_ring_blockwise"),
]


@pytest.mark.parametrize(("mask", "layout", "impl"), FLEX_KINDS)
def test_decoding_with_score_mod_and_sinks_equals_full_pass(mask, layout, impl):
    """Outputs and weights of each step equal the full pass's: the mod sees each slot's absolute position."""
    steps, B = (4, 1, 1), 2
    T = sum(steps)
    options = dict(
        num_heads=4, num_kv_heads=2, qkv_features=16, rope=True, sinks=True, implementation=impl, block_size=(2, 3),
        score_mod=_absolute_mod(jattn.score_mods.alibi_slopes(4)),
    )  # fmt: skip
    m = _nnx(**options)
    m.sinks[...] = _rand((4,), 7)
    lin = jattn.linen.SelfAttention(D, **options)
    params = _params(m) | {"sinks": m.sinks[...]}
    x = _rand((B, T, D), 8)
    plain = jattn.linen.SelfAttention(D, **(options | dict(score_mod=None, sinks=False)))
    full, full_w, without = jax.jit(
        lambda p, x: (
            *lin.apply({"params": p}, x, mask, return_weights=True),
            plain.apply({"params": _params(m)}, x, mask),
        )
    )(params, x)
    full_w = np.asarray(full_w)  # (B, N, T, T)
    assert not np.allclose(without, full, atol=1e-3)  # both options count
    cache = lin.init(jax.random.key(0), B, T, method="init_cache", **layout)["cache"]
    m.init_cache(B, T, **layout)

    @nnx.jit  # one program a step shape for both modules
    def step(m, v, x):
        out, state = lin.apply(v, x, mask, decode=True, mutable=["cache"])
        return out, state["cache"], m(x, mask, decode=True, return_weights=True)

    got, t = [], 0
    for n in steps:
        slots = np.asarray(cache["pos"])  # (B, C): the position each slot holds before this step (-1: empty)
        out, cache, (out_nnx, w) = step(m, {"params": params, "cache": cache}, x[:, t : t + n])
        w = np.asarray(w)  # (B, N, n, C + n)
        np.testing.assert_allclose(out_nnx, out, **F32)
        for b, c in np.ndindex(slots.shape):
            want = full_w[b, :, t : t + n, slots[b, c]] if slots[b, c] >= 0 else np.zeros((4, n))
            np.testing.assert_allclose(w[b, :, :, c], want, **F32)
        np.testing.assert_allclose(w[..., slots.shape[1] :], full_w[:, :, t : t + n, t : t + n], **F32)
        got.append(out)
        t += n
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, **F32)
