"""The Flax modules: the article's module by hand, NNX == Linen, composition under transforms."""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.test_util import check_grads

import jattn.linen
import jattn.nnx
from jattn import masks, score_mods
from tests import reference as ref

D_MODEL = 12


def _x(shape=(2, 7, D_MODEL), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def test_default_is_the_article_module_hand_computed():
    m = jattn.nnx.SelfAttention(2, rngs=nnx.Rngs(0))
    assert m.wo is None and m.wq.bias is None and m.wk.bias is None and m.wv.bias is None
    assert m.wq.kernel.shape == m.wk.kernel.shape == m.wv.kernel.shape == (2, 2)
    for layer in (m.wq, m.wk, m.wv):
        layer.kernel[...] = jnp.eye(2)
    x = jnp.array([[[1.0, 0.0], [0.0, 2.0]]])  # Q = K = V = x
    # scores = x xᵀ / √2 = [[1/√2, 0], [0, 4/√2]]
    a, b = 1 / math.sqrt(2), 4 / math.sqrt(2)
    row0 = np.array([math.exp(a), 2 * 1.0]) / (math.exp(a) + 1)  # weights [e^a, 1]/(e^a+1) times V rows
    row1 = np.array([1.0, 2 * math.exp(b)]) / (1 + math.exp(b))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(m, x)[0], np.stack([row0, row1]), rtol=1e-6)


def test_default_matches_article_reference_on_random_weights():
    m = jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(1))
    x = _x()
    want = ref.article_self_attention(
        x, *(np.asarray(getattr(m, n).kernel[...], np.float64) for n in ("wq", "wk", "wv"))
    )
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(m, x), want, **ref.tol(jnp.float32))


CONFIGS = [
    dict(),
    dict(num_heads=4),
    dict(num_heads=6, num_kv_heads=2, qkv_features=18),
    dict(num_heads=3, num_kv_heads=1, use_bias=True, out_features=5),
    dict(num_heads=2, out_proj=False),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_nnx_and_linen_agree_and_match_reference(config):
    x = _x()
    mask = jax.random.bernoulli(jax.random.key(5), 0.6, (2, 1, 7, 7)).at[1, 0, 4].set(False)
    m = jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(0), **config)
    lin = jattn.linen.SelfAttention(D_MODEL, **config)
    init = jax.eval_shape(lin.init, jax.random.key(0), x)["params"]  # the shapes Linen's own init gives
    params = ref.linen_params(m)
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)
    (out, w), (out_l, w_l) = nnx.jit(
        lambda m, p, x, mask: (m(x, mask, return_weights=True), lin.apply({"params": p}, x, mask, return_weights=True))
    )(m, params, x, mask)
    np.testing.assert_allclose(out, out_l, **ref.tol(jnp.float32))
    np.testing.assert_allclose(w, w_l, **ref.tol(jnp.float32))
    # Independent reference: per-head float64 attention with k/v heads repeated for GQA.
    n, kv = config.get("num_heads", 1), config.get("num_kv_heads") or config.get("num_heads", 1)

    def proj(name):
        p = {k: np.asarray(v, np.float64) for k, v in params[name].items()}
        return lambda a: a @ p["kernel"] + p.get("bias", 0.0)

    def heads(a, h):  # (B, L, h*D) -> (B, h, L, D)
        return a.reshape(*a.shape[:2], h, -1).transpose(0, 2, 1, 3)

    xs = np.asarray(x, np.float64)
    q = heads(proj("wq")(xs), n)
    k, v = (np.repeat(heads(proj(nm)(xs), kv), n // kv, axis=1) for nm in ("wk", "wv"))
    o, weights, _ = ref.attention(q, k, v, mask=np.asarray(mask))
    o = o.transpose(0, 2, 1, 3).reshape(2, 7, -1)
    if "wo" in params:
        o = proj("wo")(o)
    np.testing.assert_allclose(out, o, **ref.tol(jnp.float32))
    np.testing.assert_allclose(w, weights, **ref.tol(jnp.float32))
    assert np.all(np.asarray(out[1, 4]) == (0.0 if "wo" not in params else np.asarray(params["wo"].get("bias", 0.0))))


def test_linen_gradients_float64():
    with jax.enable_x64(True):
        x = _x().astype(jnp.float64)
        lin = jattn.linen.SelfAttention(D_MODEL, num_heads=3, use_bias=True, param_dtype=jnp.float64)
        params = jax.jit(lin.init)(jax.random.key(0), x)["params"]
        check_grads(jax.jit(lambda p, x: lin.apply({"params": p}, x)), (params, x), order=1, modes=["rev"])


def test_nnx_jit_vmap_grad():
    m = jattn.nnx.SelfAttention(D_MODEL, num_heads=4, rngs=nnx.Rngs(0))
    x = _x((3, 2, 7, D_MODEL))
    eager = jnp.stack([m(xi) for xi in x])
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(m, x[0]), eager[0], **ref.tol(jnp.float32))
    vmapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, x)
    np.testing.assert_allclose(vmapped, eager, **ref.tol(jnp.float32))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x[0]) ** 2)))(m)
    lin = jattn.linen.SelfAttention(D_MODEL, num_heads=4)
    want = jax.jit(jax.grad(lambda p: jnp.sum(lin.apply({"params": p}, x[0]) ** 2)))(ref.linen_params(m))
    np.testing.assert_allclose(grads.wq.kernel[...], want["wq"]["kernel"], **ref.tol(jnp.float32))
    np.testing.assert_allclose(grads.wo.kernel[...], want["wo"]["kernel"], **ref.tol(jnp.float32))


def test_nnx_scan_over_stacked_layers_equals_loop():
    layers = nnx.vmap(lambda r: jattn.nnx.SelfAttention(D_MODEL, num_heads=2, rngs=r), in_axes=0)(nnx.Rngs(0).split(3))
    x = _x()

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(layer, h):
        return h + layer(h)

    got = run(layers, x)
    h = x
    _, state = nnx.split(layers)
    for i in range(3):
        layer = nnx.merge(nnx.graphdef(layers), jax.tree.map(lambda a, i=i: a[i], state))
        h = h + layer(h)
    np.testing.assert_allclose(got, h, **ref.tol(jnp.float32))


class _Stack(nn.Module):
    """Three residual attention layers via nn.scan, each wrapped in nn.remat."""

    @nn.compact
    def __call__(self, h, _):
        return h + jattn.linen.SelfAttention(D_MODEL, num_heads=2)(h), None


def test_linen_scan_remat_vmap_compose():
    x = _x()
    scanned = nn.scan(nn.remat(_Stack), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()
    params = scanned.init(jax.random.key(0), x, None)["params"]
    got, _ = jax.jit(lambda p, x: scanned.apply({"params": p}, x, None))(params, x)
    single = jattn.linen.SelfAttention(D_MODEL, num_heads=2)
    apply = jax.jit(lambda p, x: single.apply({"params": p}, x))
    h = x
    for i in range(3):
        layer = jax.tree.map(lambda a, i=i: a[i], params["SelfAttention_0"])
        h = h + apply(layer, h)
    np.testing.assert_allclose(got, h, **ref.tol(jnp.float32))
    # nn.vmap over a leading axis with shared parameters equals the plain call per slice.
    vm = nn.vmap(
        jattn.linen.SelfAttention, in_axes=0, out_axes=0, variable_axes={"params": None}, split_rngs={"params": False}
    )(D_MODEL, num_heads=2)
    xs = _x((3, 2, 7, D_MODEL))
    vparams = jax.jit(vm.init)(jax.random.key(1), xs)["params"]
    loop = jnp.stack([apply(vparams, xi) for xi in xs])
    np.testing.assert_allclose(jax.jit(vm.apply)({"params": vparams}, xs), loop, **ref.tol(jnp.float32))


def test_dropout_switch_and_rng():
    x = _x()
    m = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, dropout_rate=0.5, rngs=nnx.Rngs(0, dropout=1))
    plain = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(m(x, deterministic=True), plain(x))
    a, b = m(x), m(x)  # the stream advances: two different dropout draws
    assert not np.allclose(a, b) and not np.allclose(a, plain(x))
    lin = jattn.linen.SelfAttention(D_MODEL, num_heads=2, dropout_rate=0.5)
    params = ref.linen_params(plain)
    np.testing.assert_array_equal(lin.apply({"params": params}, x, deterministic=True), plain(x))
    one = lin.apply({"params": params}, x, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(one, lin.apply({"params": params}, x, rngs={"dropout": jax.random.key(3)}))
    with pytest.raises(flax.errors.InvalidRngError):
        lin.apply({"params": params}, x)  # no dropout rng given


def test_dtype_policy():
    m = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    out = m(_x().astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and m.wq.kernel.dtype == jnp.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_heads=5), r"qkv_features=12 must be a positive multiple of num_heads=5"),
        (dict(num_heads=4, num_kv_heads=3), r"num_kv_heads=3 must be a positive divisor of num_heads=4"),
        (dict(num_heads=0), r"num_heads must be a positive int, got 0"),
        (dict(out_features=5, out_proj=False), r"out_features=5 needs out_proj=True"),
    ],
)
def test_bad_configuration_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(ValueError, match=match):
        jattn.linen.SelfAttention(D_MODEL, **kwargs).init(jax.random.key(0), _x())


def test_bad_call_raises():
    m = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., length >= 1, 12\), got \(2, 7, 11\)"):
        m(_x((2, 7, 11)))
    with pytest.raises(
        ValueError,
        match=r"\(B, N, T, S\) = \(2, 2, 7, 7\) \(each axis may be 1; B: the batch dims of x\), got shape \(2, 3, 7, 7\)",
    ):
        m(_x(), jnp.ones((2, 3, 7, 7), bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        m(_x(), jnp.ones((7, 7)))


def _paths(jaxpr_text: str, T: int, S: int) -> tuple[bool, bool]:
    """(a (T, S) scores array appears, a scan over tiles or the fused CPU forward appears) in a jaxpr's text."""
    return f"{T},{S}]" in jaxpr_text, "scan[" in jaxpr_text or "jattn_fused_forward" in jaxpr_text


@pytest.mark.parametrize("module", ["nnx", "linen"])
def test_modules_hand_mask_predicates_to_the_blockwise_path(module):
    """A predicate reaches the core as it is: the automatic choice tiles long sequences (no (T, S) array)."""
    from jattn import masks

    T = 2048  # T·S >= AUTO_BLOCKWISE_MIN: the automatic choice is blockwise, on tiles below T (T=1024 may be one)
    x = jax.ShapeDtypeStruct((1, T, 8), jnp.float32)
    if module == "nnx":
        m = jattn.nnx.SelfAttention(8, num_heads=2, rngs=nnx.Rngs(0))
        text = str(jax.make_jaxpr(lambda x: m(x, masks.causal()))(x))
        dense = str(jax.make_jaxpr(lambda x: m(x, masks.causal(), implementation="dense"))(x))
    else:
        m = jattn.linen.SelfAttention(8, num_heads=2)
        params = m.init(jax.random.key(0), jnp.ones((1, 4, 8)))
        text = str(jax.make_jaxpr(lambda x: m.apply(params, x, masks.causal()))(x))
        dense = str(jax.make_jaxpr(lambda x: m.apply(params, x, masks.causal(), implementation="dense"))(x))
    assert _paths(text, T, T) == (False, True)
    assert _paths(dense, T, T) == (True, False)


@pytest.mark.parametrize("mask", ["causal", "window", "array"])
def test_module_implementation_and_block_size_keep_the_result(mask):
    """Constructor default, call-time override, NNX == Linen; a context mask joins a predicate."""
    from jattn import masks

    x, ctx = _x((2, 13, D_MODEL)), _x((2, 9, 5), seed=1)
    m = {
        "causal": masks.causal(),
        "window": masks.sliding_window(3),
        "array": np.random.default_rng(0).random((2, 4, 13, 13)) > 0.3,
    }[mask]
    blockwise = jattn.nnx.SelfAttention(
        D_MODEL, num_heads=4, num_kv_heads=2, implementation="blockwise", block_size=4, rngs=nnx.Rngs(0)
    )
    dense = jattn.nnx.SelfAttention(D_MODEL, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
    linen = jattn.linen.SelfAttention(D_MODEL, num_heads=4, num_kv_heads=2, implementation="blockwise", block_size=4)
    cross = jattn.nnx.CrossAttention(D_MODEL, 5, num_heads=4, rngs=nnx.Rngs(0))
    valid = jnp.arange(9)[None] < jnp.array([[4], [9]])  # (B, S)
    pred = m if mask != "array" else masks.causal()

    @nnx.jit  # every call in one program
    def run(blockwise, dense, cross, params, x, ctx):
        return (
            dense(x, m, implementation="dense"),
            blockwise(x, m),
            blockwise(x, m, implementation="dense"),
            dense(x, m, implementation="blockwise", block_size=(3, 5)),
            linen.apply({"params": params}, x, m),
            cross(x, ctx, pred, context_mask=valid, implementation="blockwise", block_size=4),
            cross(x, ctx, pred, context_mask=valid, implementation="dense"),
        )

    want, *same, got, cross_dense = run(blockwise, dense, cross, ref.linen_params(dense), x, ctx)
    for i, out in enumerate(same):
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float32), err_msg=f"call {i}")
    np.testing.assert_allclose(got, cross_dense, **ref.tol(jnp.float32))


def test_module_path_arguments_are_checked():
    with pytest.raises(ValueError, match="implementation must be one of"):
        jattn.nnx.SelfAttention(D_MODEL, implementation="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="block_size"):
        jattn.nnx.SelfAttention(D_MODEL, block_size=0, rngs=nnx.Rngs(0))
    m = jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="implementation must be one of"):
        m(_x(), implementation="flash")


# -- score_mod and sinks (issue #13 item 7): the modules pass them to the core ----------------------

FLEX = dict(num_heads=6, num_kv_heads=2, qkv_features=18)  # N=6, K=2, G=3, D=3
CAP = 2.5


def _flex_mod():
    """ALiBi over the module's six query heads, then a soft cap (the core's ready-made mods)."""
    return score_mods.compose(score_mods.alibi(score_mods.alibi_slopes(6)), score_mods.softcap(CAP))


def _np_flex_mod(s, batch, head, q_pos, kv_pos):
    """The same modification in float64 NumPy, from its definition (head = query head n)."""
    slopes = np.asarray(score_mods.alibi_slopes(6), np.float64)
    s = s - slopes[head] * np.abs(q_pos - kv_pos)
    return CAP * np.tanh(s / CAP)


def _flex_nnx(seed=0, **options):
    """An NNX module with ``FLEX`` heads and random (nonzero) sinks when it has them."""
    m = jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(seed), **FLEX, **options)
    if m.sinks is not None:
        m.sinks[...] = jax.random.normal(jax.random.key(40 + seed), (6,))
    return m


def _flex_params(m) -> dict:
    return ref.linen_params(m) | ({} if m.sinks is None else {"sinks": m.sinks[...]})


def _flex_reference(params: dict, x, mask, score_mod, sinks):
    """Float64: the module by hand (projections, heads split n = k·G + g, GQA by repetition, ``wo``)."""

    def proj(name):
        return np.asarray(x, np.float64) @ np.asarray(params[name]["kernel"], np.float64)

    def heads(a, h):  # (B, L, h*D) -> (B, h, L, D)
        return a.reshape(*a.shape[:2], h, -1).transpose(0, 2, 1, 3)

    q = heads(proj("wq"), 6)
    k, v = (np.repeat(heads(proj(name), 2), 3, axis=1) for name in ("wk", "wv"))  # kv head k serves n = 3k..3k+2
    out, weights, _ = ref.attention(q, k, v, mask=mask, score_mod=score_mod, sinks=sinks)
    out = out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1) @ np.asarray(params["wo"]["kernel"], np.float64)
    return out, weights


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_module_score_mod_and_sinks_match_float64_reference(impl):
    """Softcap∘ALiBi and learned sinks: NNX and Linen equal the module computed by hand in float64."""
    x = _x((2, 7, D_MODEL), seed=3)
    causal = np.tril(np.ones((7, 7), bool))
    m = _flex_nnx(score_mod=_flex_mod(), sinks=True, implementation=impl, block_size=(4, 3))
    params = _flex_params(m)
    want, want_w = _flex_reference(params, x, causal, _np_flex_mod, np.asarray(params["sinks"], np.float64))
    lin = jattn.linen.SelfAttention(
        D_MODEL, score_mod=_flex_mod(), sinks=True, implementation=impl, block_size=(4, 3), **FLEX
    )

    @nnx.jit
    def run(m, params, x):
        nnx_out = m(x, masks.causal(), return_weights=True)
        return (
            nnx_out,
            lin.init(jax.random.key(0), x)["params"],
            lin.apply({"params": params}, x, masks.causal(), return_weights=True),
        )

    (out, w), init, (out_l, w_l) = run(m, params, x)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(w, want_w, **ref.tol(jnp.float32))  # the weights carry the mod and the sinks
    assert np.all(np.asarray(w).sum(-1) < 1)  # a sink takes a share of every row
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)  # sinks (N,), the same name
    np.testing.assert_array_equal(init["sinks"], np.zeros(6))
    np.testing.assert_allclose(out_l, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(w_l, want_w, **ref.tol(jnp.float32))


def test_module_softcap_equals_the_core_called_by_hand_with_its_projections():
    """Each option alone, against jattn.attention on the module's own projections (grouped layout)."""
    x = _x((3, 5, D_MODEL), seed=4)
    for options in (dict(score_mod=score_mods.softcap(0.7)), dict(sinks=True)):

        @nnx.jit
        def run(m, plain, x, options=options):
            q, k, v = m.wq(x), m.wk(x), m.wv(x)
            split = lambda a, g: a.reshape(3, 5, 2, g, 3).transpose(0, 2, 3, 1, 4)  # noqa: E731  (B, K, G, T, D)
            sinks = None if m.sinks is None else m.sinks[...].reshape(2, 3)  # (N,) -> (K, G)
            o = jattn.attention(split(q, 3), split(k, 1), split(v, 1), score_mod=options.get("score_mod"), sinks=sinks)
            return m(x), m.wo(o.transpose(0, 3, 1, 2, 4).reshape(3, 5, 18)), plain(x)

        got, want, without = run(_flex_nnx(**options), _flex_nnx(), x)
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
        assert not np.allclose(got, without, atol=1e-3)  # the option changes the result


def test_module_sinks_get_the_cores_gradient_in_nnx_and_linen():
    x, dout = _x((2, 7, D_MODEL), seed=5), _x((2, 7, D_MODEL), seed=6)
    m = _flex_nnx(sinks=True, score_mod=score_mods.softcap(1.5))
    lin = jattn.linen.SelfAttention(D_MODEL, sinks=True, score_mod=score_mods.softcap(1.5), **FLEX)
    split = lambda a, g: a.reshape(2, 7, 2, g, 3).transpose(0, 2, 3, 1, 4)  # noqa: E731  (B, K, G, T, D)

    @nnx.jit
    def run(m, params):
        q, k, v = m.wq(x), m.wk(x), m.wv(x)

        def core(sinks):  # (N,) sinks through jattn.attention with the module's projections
            o = jattn.attention(
                split(q, 3), split(k, 1), split(v, 1), mask=masks.causal(), score_mod=score_mods.softcap(1.5),
                sinks=sinks.reshape(2, 3),
            )  # fmt: skip
            return jnp.sum(m.wo(o.transpose(0, 3, 1, 2, 4).reshape(2, 7, 18)) * dout)

        return (
            nnx.grad(lambda m: jnp.sum(m(x, masks.causal()) * dout))(m),
            jax.grad(core)(m.sinks[...]),
            jax.grad(lambda p: jnp.sum(lin.apply({"params": p}, x, masks.causal()) * dout))(params),
        )

    grads, want, g = run(m, _flex_params(m))
    assert np.all(np.abs(np.asarray(want)) > 1e-4)  # every head's sink is used
    np.testing.assert_allclose(grads.sinks[...], want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(g["sinks"], want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(g["wq"]["kernel"], grads.wq.kernel[...], **ref.tol(jnp.float32))


def test_cross_attention_score_mod_and_sinks_nnx_equals_linen():
    """Cross-attention: the core's positions (queries at the end of the context), context padding kept out."""
    x, ctx = _x((2, 5, D_MODEL), seed=7), _x((2, 9, 4), seed=8)
    valid = jnp.arange(9)[None] < jnp.array([[6], [9]])  # (B, S)
    options = dict(score_mod=_flex_mod(), sinks=True, **FLEX)
    m = jattn.nnx.CrossAttention(D_MODEL, 4, rngs=nnx.Rngs(0), **options)
    m.sinks[...] = jax.random.normal(jax.random.key(9), (6,))
    lin = jattn.linen.CrossAttention(D_MODEL, context_features=4, **options)
    params = ref.linen_params(m) | {"sinks": m.sinks[...]}
    out, out_l = nnx.jit(
        lambda m, p, x, ctx: (m(x, ctx, context_mask=valid), lin.apply({"params": p}, x, ctx, context_mask=valid))
    )(m, params, x, ctx)
    np.testing.assert_allclose(out_l, out, **ref.tol(jnp.float32))
    # float64 by hand: queries of x, keys and values of the context
    c = np.asarray(ctx, np.float64)
    heads = lambda a, h: a.reshape(*a.shape[:2], h, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q = heads(np.asarray(x, np.float64) @ np.asarray(params["wq"]["kernel"], np.float64), 6)
    k, v = (np.repeat(heads(c @ np.asarray(params[n]["kernel"], np.float64), 2), 3, axis=1) for n in ("wk", "wv"))
    mask = np.asarray(valid)[:, None, None, :]  # (B, 1, 1, S)
    o, _, _ = ref.attention(q, k, v, mask=mask, score_mod=_np_flex_mod, sinks=np.asarray(params["sinks"], np.float64))
    want = o.transpose(0, 2, 1, 3).reshape(2, 5, -1) @ np.asarray(params["wo"]["kernel"], np.float64)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))


def test_module_options_are_declared_once_and_the_modules_take_them_as_declared():
    """NNX constructors and Linen fields carry the declaration's options: names, order, defaults, annotations.

    The declaration (``jattn._modules.options.ModuleOptions``, imported here as the one private
    name this test checks against) documents them; a new option written in one place only fails here.
    """
    import dataclasses
    import inspect

    from jattn._modules import SELF_ATTENTION_ONLY, ModuleOptions

    declared = [(f.name, f.default, f.type) for f in dataclasses.fields(ModuleOptions)]
    cross = [d for d in declared if d[0] not in SELF_ATTENTION_ONLY]
    assert [d[0] for d in declared if d not in cross] == list(SELF_ATTENTION_ONLY)

    def nnx_options(cls, shape):  # (name, default, annotation) of the keyword options, in order
        params = list(inspect.signature(cls.__init__).parameters.values())
        assert [p.name for p in params[: len(shape) + 1]] == ["self", *shape]
        assert [p.name for p in params[-3:]] == ["kernel_init", "bias_init", "rngs"]
        assert all(p.kind is p.KEYWORD_ONLY for p in params[len(shape) + 1 :])
        return [(p.name, p.default, p.annotation) for p in params[len(shape) + 1 : -3]]

    assert nnx_options(jattn.nnx.SelfAttention, ["d_model"]) == declared
    assert nnx_options(jattn.nnx.CrossAttention, ["d_model", "context_features"]) == cross

    def linen_fields(cls):  # the fields but Linen's own parent and name, in order
        return [(f.name, f.default, f.type) for f in dataclasses.fields(cls) if f.name not in ("parent", "name")]

    init = ["kernel_init", "bias_init"]
    for cls, extra in [
        (jattn.linen.SelfAttention, [d for d in declared if d[0] in SELF_ATTENTION_ONLY]),
        (jattn.linen.CrossAttention, [("context_features", 0, "int")]),
    ]:
        fields = linen_fields(cls)
        assert [f[0] for f in fields] == ["d_model", *(d[0] for d in cross), *init, *(d[0] for d in extra)]
        assert [f for f in fields if f[0] not in ("d_model", *init)] == cross + extra
    # init_cache is written out in both too: the same parameters, defaults and annotations
    assert inspect.signature(jattn.nnx.SelfAttention.init_cache) == inspect.signature(
        jattn.linen.SelfAttention.init_cache
    )


# -- issue #43: the options documented in the public docstrings; causal=True ---------------------------

PUBLIC = [jattn.nnx.SelfAttention, jattn.nnx.CrossAttention, jattn.linen.SelfAttention, jattn.linen.CrossAttention]


def _entries(doc: str) -> dict[str, str]:
    """The top-level ``name: text`` entries of a docstring's Args/Attributes (continuation lines joined)."""
    entries, name = {}, None
    for line in doc.split("\n"):
        if line.startswith("  ") and not line.startswith("   ") and ": " in line:
            name, text = line.strip().split(": ", 1)
            entries[name] = text
        elif name is not None and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def _options_taken(cls) -> list[str]:
    """The options a public class takes: NNX's keyword arguments, Linen's fields (inputs and initialisers aside)."""
    import dataclasses
    import inspect

    aside = {"d_model", "context_features", "kernel_init", "bias_init", "rngs", "parent", "name"}
    if issubclass(cls, nn.Module):
        return [f.name for f in dataclasses.fields(cls) if f.name not in aside]
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in aside]


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_public_docstrings_document_every_option_themselves(cls):
    """``help(jattn.nnx.SelfAttention)`` once sent the reader to the private ``ModuleOptions``."""
    import inspect

    doc = inspect.getdoc(cls)
    assert "ModuleOptions" not in doc and "_module_options" not in doc
    entries = _entries(doc)
    taken = _options_taken(cls)
    assert len(taken) >= 19 and [name for name in taken if name not in entries] == []
    twin = {c.__name__: c for c in PUBLIC if c is not cls and c.__name__ == cls.__name__}[cls.__name__]
    other = _entries(inspect.getdoc(twin))  # NNX and Linen say the same of each option, but the switch
    assert [n for n in taken if n != "deterministic" and entries[n] != other[n]] == []


def test_the_mask_argument_says_first_that_none_is_bidirectional():
    import inspect

    mask = _entries(inspect.getdoc(jattn.nnx.SelfAttention.__call__))["mask"]
    assert mask.startswith("None (the default) is bidirectional in a full pass") and "masks.causal()" in mask[:200]
    assert "bidirectional" in inspect.getdoc(jattn.linen.SelfAttention).split("Attributes:")[0]


def test_causal_option_ands_causal_into_every_mask_nnx_and_linen():
    """``causal=True``: a forgotten mask cannot make a decoder look ahead; the default stays Flax's."""
    x = _x((2, 7, D_MODEL), seed=8)  # B=2, T=7; N=6, K=2
    m = _flex_nnx(causal=True)
    params = _flex_params(m)
    t, s = np.arange(7)[:, None], np.arange(7)[None, :]
    keep = np.random.default_rng(1).random((2, 7, 7)) > 0.3  # (B, T, S) per example
    lengths = np.array([7, 4])
    cases = [  # (the call's mask, what it allows (B|1, 1, T, S) before causal() is and-ed in)
        (None, np.ones((1, 1, 7, 7), bool)),
        (keep, keep[:, None]),
        (masks.padding(kv_lengths=lengths), (s < lengths[:, None, None, None])),
        (masks.sliding_window(2, 2), (np.abs(t - s) <= 2)[None, None]),
    ]
    lin = jattn.linen.SelfAttention(D_MODEL, **FLEX, causal=True)

    @nnx.jit  # every full pass in one program
    def run(m, plain, params, x):
        outs = [(m(x, mask), lin.apply({"params": params}, x, mask)) for mask, _ in cases]
        return outs, plain(x), m(x)

    outs, plain_out, no_mask = run(m, _flex_nnx(), params, x)
    for (got, got_linen), (_, allowed) in zip(outs, cases, strict=True):
        want, _ = _flex_reference(params, x, allowed & (s <= t), None, None)
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
        np.testing.assert_allclose(got_linen, want, **ref.tol(jnp.float32))
    bidirectional, _ = _flex_reference(params, x, None, None, None)  # the default: Flax's convention
    np.testing.assert_allclose(plain_out, bidirectional, **ref.tol(jnp.float32))
    assert not np.allclose(bidirectional, no_mask, atol=1e-3)
    # decoding: a chunk of 4 then single tokens, the window and-ed with causal() as in the full pass
    window = masks.sliding_window(2, 2)
    full = nnx.jit(lambda m, x: m(x, window))(m, x)
    m.init_cache(2, 16)
    step = nnx.jit(lambda m, x: m(x, window, decode=True))
    steps = [step(m, x[:, :4])] + [step(m, x[:, i : i + 1]) for i in range(4, 7)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **ref.tol(jnp.float32))


def test_causal_option_of_linear_attention_is_its_causal_mask():
    x = _x((3, 5, D_MODEL), seed=9)
    causal = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, kind="linear", causal=True, rngs=nnx.Rngs(4))
    plain = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, kind="linear", rngs=nnx.Rngs(4))
    got, want, bidirectional = nnx.jit(lambda causal, plain, x: (causal(x), plain(x, masks.causal()), plain(x)))(
        causal, plain, x
    )
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    assert not np.allclose(bidirectional, want, atol=1e-3)


# -- attention_weights with score_mod and sinks (issue #43) -------------------------------------------


@pytest.mark.parametrize("offset", [None, 3])
def test_attention_weights_take_score_mod_and_sinks_as_attention(offset):
    """The weights :func:`jattn.attention` applies, with a score_mod and sinks: rows sum to 1 - the sink's share."""
    b, n, t, s, d = 2, 3, 5, 7, 4
    q, k, v = _x((b, n, t, d), 1), _x((b, n, s, d), 2), _x((b, n, s, 6), 3)
    sinks = jax.random.normal(jax.random.key(4), (n,))
    slopes = np.asarray(score_mods.alibi_slopes(n), np.float64)
    mod = score_mods.compose(score_mods.alibi(score_mods.alibi_slopes(n)), score_mods.softcap(CAP))

    def np_mod(x, batch, head, q_pos, kv_pos):
        return CAP * np.tanh((x - slopes[head] * np.abs(q_pos - kv_pos)) / CAP)

    mask = masks.causal() & masks.padding(q_lengths=np.array([5, 3]))  # example 1: rows 3, 4 see nothing
    kw = dict(mask=mask, score_mod=mod, sinks=sinks, q_offset=offset)
    got, out = jax.jit(
        lambda q, k, v: (jattn.attention_weights(q, k, **kw), jattn.attention(q, k, v, implementation="dense", **kw))
    )(q, k, v)
    dense = np.asarray(mask.dense(t, s, q_offset=offset))  # (B, 1, T, S)
    _, want, _ = ref.attention(q, k, v, mask=dense, score_mod=np_mod, sinks=sinks, q_offset=offset)
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    rows = np.asarray(got).sum(-1)
    assert np.all(rows[0] < 1) and np.all(rows[1, :, :3] < 1) and np.all(rows[1, :, 3:] == 0)
    np.testing.assert_allclose(jnp.einsum("bnts,bnse->bnte", got, v), out, **ref.tol(jnp.float32))


# -- issue #44: the options built from the named parameters ------------------------------------------------

#: A value of each option unlike its default (with what it needs beside it), for a module of d_model=12.
_OPTION_VALUES = {
    "num_heads": (3, {}),
    "num_kv_heads": (1, {"num_heads": 3}),
    "qkv_features": (24, {}),
    "out_features": (6, {}),
    "out_proj": (False, {}),
    "use_bias": (True, {}),
    "kind": ("linear", {}),
    "feature_map": ("relu", {"kind": "linear"}),
    "dropout_rate": (0.25, {}),
    "deterministic": (True, {}),
    "dtype": (jnp.bfloat16, {}),
    "param_dtype": (jnp.bfloat16, {}),
    "precision": ("highest", {}),
    "sequence_axis": ("seq", {}),
    "implementation": ("dense", {}),
    "block_size": (8, {}),
    "normalize_qk": (True, {}),
    "rope": (True, {}),
    "rope_base": (500.0, {"rope": True}),
    "decode": (True, {}),
    "causal": (True, {}),
    "score_mod": (jattn.score_mods.softcap(5.0), {}),
    "sinks": (True, {}),
    "num_householder": (3, {"kind": "deltaproduct"}),
}


@pytest.mark.parametrize("cls", [jattn.nnx.SelfAttention, jattn.nnx.CrossAttention])
def test_every_option_reaches_the_module_by_its_name(cls):
    """Each keyword option of the constructor, set unlike its default, is the module's: none dropped or misrouted."""
    import inspect

    cross = cls is jattn.nnx.CrossAttention
    params = inspect.signature(cls.__init__).parameters
    options = [
        p for p in params if params[p].kind is params[p].KEYWORD_ONLY and p not in ("kernel_init", "bias_init", "rngs")
    ]
    assert sorted(options) == sorted(
        n for n in _OPTION_VALUES if not (cross and n in ("rope", "rope_base", "decode", "causal", "num_householder"))
    )
    shape = (12, 10) if cross else (12,)
    for name in options:
        value, beside = _OPTION_VALUES[name]
        module = cls(*shape, **{name: value, **beside}, rngs=nnx.Rngs(0))
        assert getattr(module.options, name) == value, name
        for other in ("rope", "rope_base", "decode", "causal"):  # cross-attention's stay off
            if cross:
                assert (
                    getattr(module.options, other)
                    == inspect.signature(jattn.nnx.SelfAttention.__init__).parameters[other].default
                )
