"""DeltaProduct (``gated_linear_attention(num_householder=n)``) against explicit Householder products in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

B, N, T, D, E, NH = 2, 3, 13, 5, 7, 3  # distinct sizes; T·NH = 39 sub-steps, not a multiple of the chunks


def _inputs(seed=0, T=T, nh=NH, dtype=jnp.float64, gated=True):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, N, T, D))
    k = r.standard_normal((B, N, T * nh, D))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, N, T * nh, E))
    kw = {"beta": r.uniform(0.05, 0.95, (B, N, T * nh))}
    if gated:
        kw["g"] = -r.uniform(0, 1, (B, N, T))
    state = r.standard_normal((N, D, E))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v)), {n: cast(x) for n, x in kw.items()}, cast(state)


def _documents(seed=2, T=T):
    r = np.random.default_rng(seed)
    ids = np.cumsum(r.uniform(size=(B, 1, T)) < 0.2, axis=-1)
    keep = np.arange(T) < np.array([T, T - 4])[:, None, None]  # the second example is padded
    return {"segment_ids": jnp.asarray(ids, jnp.int32), "kv_mask": jnp.asarray(keep)}


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_chunk_and_recurrent_equal_the_householder_products(gated, mode):
    with jax.enable_x64(True):
        (q, k, v), kw, state = _inputs(gated=gated)
        out, final = jattn.gated_linear_attention(
            q, k, v, **kw, num_householder=NH, **_documents(), initial_state=state, return_state=True, mode=mode,
            chunk_size=8,
        )  # fmt: skip
        want, want_final = ref.delta_product(
            *map(ref.f64, (q, k, v)), ref.f64(kw["beta"]), NH, g=kw.get("g"), **_documents(), state=state
        )
        assert out.shape == (B, N, T, E) and final.shape == (B, N, D, E)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))
        assert np.all(np.asarray(out)[1, :, T - 4 :] == 0)  # padded tokens output 0


def test_gradients_equal_the_float64_references_derivatives():
    """grad of the chunkwise form against grad of the explicit-product reference (jax.numpy), every input included."""
    with jax.enable_x64(True):
        (q, k, v), kw, state = _inputs(seed=7)
        args = {"q": q, "k": k, "v": v, "initial_state": state} | kw
        docs = _documents()
        w = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, T, E)))
        u = jnp.asarray(np.random.default_rng(5).standard_normal((B, N, D, E)))

        def loss(args):
            out, final = jattn.gated_linear_attention(
                **args, num_householder=NH, **docs, chunk_size=8, return_state=True
            )
            return jnp.sum(w * out) + jnp.sum(u * final)

        def ref_loss(args, xp=jnp):
            out, final = ref.delta_product(
                args["q"], args["k"], args["v"], args["beta"], NH, g=args["g"], state=args["initial_state"],
                **docs, xp=xp,
            )  # fmt: skip
            return xp.sum(w * out) + xp.sum(u * final)

        grads, want = jax.grad(loss)(args), jax.grad(ref_loss)(args)
        for name in args:
            np.testing.assert_allclose(grads[name], want[name], **ref.tol(jnp.float64), err_msg=name)
        # the jax.numpy reference's derivative is the NumPy loop's: one direction by central differences
        r, eps = np.random.default_rng(6), 1e-6
        d = {n: r.standard_normal(x.shape) * (0.01 if n in ("g", "beta") else 1.0) for n, x in args.items()}
        moved = lambda s: {n: np.asarray(x) + s * eps * d[n] for n, x in args.items()}  # noqa: E731
        numeric = (ref_loss(moved(1), np) - ref_loss(moved(-1), np)) / (2 * eps)
        analytic = sum(np.sum(np.asarray(grads[n]) * d[n]) for n in args)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_the_chunkwise_and_recurrent_forms_have_the_same_gradients():
    with jax.enable_x64(True):
        (q, k, v), kw, state = _inputs(seed=3)

        def grads(mode):
            def loss(q, k, v, kw, state):
                out = jattn.gated_linear_attention(
                    q, k, v, **kw, num_householder=NH, initial_state=state, **_documents(), mode=mode, chunk_size=16
                )
                return jnp.sum(jnp.sin(out))

            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, kw, state)

        for got, want in zip(jax.tree.leaves(grads("chunk")), jax.tree.leaves(grads("recurrent")), strict=True):
            np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))


def test_one_householder_step_is_the_delta_rule():
    """n_h = 1 is Gated DeltaNet (the float64 delta-rule loop), and n_h = 2 with the second betas 0 is too."""
    with jax.enable_x64(True):
        (q, k, v), kw, state = _inputs(nh=1)
        out = jattn.gated_linear_attention(q, k, v, **kw, num_householder=1, **_documents(), initial_state=state)
        want, _ = ref.gated_linear(q, k, v, **kw, **_documents(), state=state)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(
            ref.delta_product(q, k, v, kw["beta"], 1, g=kw["g"], **_documents(), state=state)[0], want, rtol=1e-13
        )
        r = np.random.default_rng(9)
        k2 = jnp.stack([k, jnp.asarray(r.standard_normal(k.shape))], axis=-2).reshape(B, N, 2 * T, D)
        v2 = jnp.stack([v, jnp.asarray(r.standard_normal(v.shape))], axis=-2).reshape(B, N, 2 * T, E)
        beta2 = jnp.stack([kw["beta"], jnp.zeros_like(kw["beta"])], axis=-1).reshape(B, N, 2 * T)
        two = jattn.gated_linear_attention(
            q, k2, v2, g=kw["g"], beta=beta2, num_householder=2, **_documents(), initial_state=state, chunk_size=8
        )
        np.testing.assert_allclose(two, want, **ref.tol(jnp.float64))


def test_float32_at_2048_tokens_is_within_1e_3_of_float64():
    (q, k, v), kw, _ = _inputs(seed=11, T=2048, nh=2, dtype=jnp.float32)
    out = jattn.gated_linear_attention(q[:1, :1], k[:1, :1], v[:1, :1], **{n: x[:1, :1] for n, x in kw.items()},
                                       num_householder=2)  # fmt: skip
    with jax.enable_x64(True):
        (q, k, v), kw, _ = _inputs(seed=11, T=2048, nh=2)
        want = jattn.gated_linear_attention(q[:1, :1], k[:1, :1], v[:1, :1], **{n: x[:1, :1] for n, x in kw.items()},
                                            num_householder=2, mode="recurrent")  # fmt: skip
        want = np.asarray(want)
    assert out.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(out, np.float64) - want)) <= 1e-3 * np.max(np.abs(want))


def test_decoding_token_by_token_equals_the_full_pass():
    (q, k, v), kw, state = _inputs(dtype=jnp.float32)
    full, final = jattn.gated_linear_attention(
        q, k, v, **kw, num_householder=NH, initial_state=state, return_state=True
    )
    outs = []
    for t0, t1 in [(0, 5), *((t, t + 1) for t in range(5, T))]:
        out, state = jattn.gated_linear_attention(
            q[..., t0:t1, :], k[..., t0 * NH : t1 * NH, :], v[..., t0 * NH : t1 * NH, :],
            g=kw["g"][..., t0:t1], beta=kw["beta"][..., t0 * NH : t1 * NH], num_householder=NH,
            initial_state=state, return_state=True, mode="recurrent" if t1 - t0 == 1 else "chunk",
        )  # fmt: skip
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=-2), full, **ref.tol(jnp.float32))
    np.testing.assert_allclose(state, final, **ref.tol(jnp.float32))


def test_jit_and_vmap_equal_the_eager_call_and_a_loop():
    (q, k, v), kw, _ = _inputs(dtype=jnp.float32)

    def f(q, k, v, g, beta):
        return jattn.gated_linear_attention(q, k, v, g=g, beta=beta, num_householder=NH, chunk_size=8)

    eager = f(q, k, v, kw["g"], kw["beta"])
    np.testing.assert_allclose(jax.jit(f)(q, k, v, kw["g"], kw["beta"]), eager, **ref.tol(jnp.float32))
    mapped = jax.vmap(f)(q, k, v, kw["g"], kw["beta"])
    looped = jnp.stack([f(q[i], k[i], v[i], kw["g"][i], kw["beta"][i]) for i in range(B)])
    np.testing.assert_allclose(mapped, looped, **ref.tol(jnp.float32))
    np.testing.assert_allclose(mapped, eager, **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(k=np.zeros((2, 4, 5))), r"with num_householder=2, k has n_h sub-steps a token.*T·n_h = 6.*\(2, 4, 5\)"),
        (dict(beta=np.zeros((2, 5))), r"beta has n_h sub-steps.*T·n_h = 6.*\(2, 5\)"),
        (dict(beta=None), r"num_householder=2 takes the delta rule's beta"),
        (dict(g=np.zeros((2, 6))), r"g is per token: it must broadcast to \(\.\.\., T=3\), got shape \(2, 6\)"),
        (dict(kv_mask=np.ones(6, bool)), r"kv_mask is per token: it must have shape \(\.\.\., T=3\).*\(6,\)"),
        (dict(num_householder=0), r"num_householder"),
        (dict(gk=np.zeros((2, 3, 5))), r"not per key feature \(gk\)"),
    ],
)
def test_bad_arguments_are_named(kw, match):
    args = dict(q=np.zeros((2, 3, 5)), k=np.zeros((2, 6, 5)), v=np.zeros((2, 6, 4)), beta=np.full((2, 6), 0.5))
    with pytest.raises(ValueError, match=match):
        jattn.gated_linear_attention(**(args | {"num_householder": 2} | kw))


# -- the modules' kinds 'deltaproduct' and 'gated_deltaproduct' ---------------------------------------------

F_MODEL, HEADS, LENGTH = 24, 3, 11  # head depth 8


def _written_out(m, x, kind, nh):
    """The module in float64 NumPy from its parameters: projections ((n h d) layout), SiLU + L2 norm, gates, loop."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    silu_l2 = lambda y: (y / (1 + np.exp(-y))) / np.sqrt(np.sum((y / (1 + np.exp(-y))) ** 2, -1, keepdims=True) + 1e-6)  # noqa: E731
    b, t = x.shape[:2]
    q = silu_l2((x @ ref.f64(m.wq.kernel[...])).reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3))
    k, v = ((x @ ref.f64(getattr(m, w).kernel[...])).reshape(b, t, nh, HEADS, -1) for w in ("wk", "wv"))
    k, v = (y.transpose(0, 3, 1, 2, 4).reshape(b, HEADS, t * nh, -1) for y in (k, v))  # token t's j-th at t·nh + j
    beta = (1 / (1 + np.exp(-(x @ p["w_beta"])))).reshape(b, t, nh, HEADS).transpose(0, 3, 1, 2).reshape(b, HEADS, -1)
    g = None
    if kind == "gated_deltaproduct":
        g = (-np.exp(p["a_log"]) * np.log1p(np.exp(x @ p["w_dt"] + p["dt_bias"]))).transpose(0, 2, 1)
    out, _ = ref.delta_product(q, silu_l2(k), v, beta, nh, g=g)
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1) @ ref.f64(m.wo.kernel[...])


@pytest.mark.parametrize("kind, nh", [("deltaproduct", None), ("gated_deltaproduct", 3)])
def test_each_module_kind_equals_its_householder_products_written_out(kind, nh):
    """NNX (float64, to 1e-12) and Linen: (n h d) projections, SiLU + L2 keys, sigmoid betas, SSD gate, the loop."""
    from flax import nnx

    with jax.enable_x64(True):
        m = jattn.nnx.SelfAttention(
            F_MODEL, num_heads=HEADS, kind=kind, num_householder=nh, param_dtype=jnp.float64, rngs=nnx.Rngs(0)
        )
        x = jax.random.normal(jax.random.key(1), (2, LENGTH, F_MODEL), jnp.float64)
        n = 2 if nh is None else nh
        assert m.options.num_householder == n and m.wk.kernel.shape == (F_MODEL, n * F_MODEL)
        got = m(x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, _written_out(m, x, kind, n), **ref.tol(jnp.float64))
        linen = jattn.linen.SelfAttention(
            F_MODEL, num_heads=HEADS, kind=kind, num_householder=nh, param_dtype=jnp.float64
        )
        np.testing.assert_allclose(linen.apply({"params": ref.linen_params(m)}, x), got, **ref.tol(jnp.float64))


def test_module_decoding_from_the_cache_equals_the_full_pass():
    from flax import nnx

    kw = dict(num_heads=HEADS, kind="gated_deltaproduct", num_householder=3)
    m = jattn.nnx.SelfAttention(F_MODEL, **kw, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, LENGTH, F_MODEL))
    full = m(x)
    m.init_cache(2, LENGTH)
    pieces = [m(x[:, :4], decode=True)] + [m(x[:, t : t + 1], decode=True) for t in range(4, LENGTH)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **ref.tol(jnp.float32))
    linen = jattn.linen.SelfAttention(F_MODEL, **kw)
    cache = linen.init(jax.random.key(0), 2, LENGTH, method="init_cache")["cache"]
    outs = []
    for t in range(LENGTH):
        y, state = linen.apply(
            {"params": ref.linen_params(m), "cache": cache}, x[:, t : t + 1], decode=True, mutable=["cache"]
        )
        outs.append(y)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, **ref.tol(jnp.float32))


def test_num_householder_is_the_deltaproduct_kinds_own():
    from flax import nnx

    with pytest.raises(
        ValueError, match=r"num_householder is DeltaProduct's.*kind='gated_deltanet'.*num_householder=2"
    ):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="gated_deltanet", num_householder=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_householder"):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="deltaproduct", num_householder=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kind='deltaproduct' is causal self-attention"):
        jattn.nnx.CrossAttention(F_MODEL, 7, num_heads=HEADS, kind="deltaproduct", rngs=nnx.Rngs(0))
