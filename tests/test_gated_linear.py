"""jattn.gated_linear_attention: decays, the delta rule, documents, both forms, against a float64 step-by-step loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

B, N, T, D, E = 2, 3, 37, 5, 7  # odd, distinct sizes; T is not a multiple of the chunks below


def _inputs(seed=0, lead=(B, N), T=T, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((*lead, T, x)) for x in (D, D, E))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's papers L2-normalise k
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _gates(seed=1, lead=(B, N), T=T):
    r = np.random.default_rng(seed)
    return {
        "retention": lambda: {"g": jnp.asarray(np.log(1 - 2.0 ** -np.arange(5, 5 + N))[:, None], jnp.float32)},
        "ssd": lambda: {"g": jnp.asarray(-r.uniform(0, 1, (*lead, T)), jnp.float32)},
        "gla": lambda: {"gk": jnp.asarray(-r.uniform(0, 1, (*lead, T, D)), jnp.float32)},
        "deltanet": lambda: {"beta": jnp.asarray(r.uniform(0.05, 0.95, (*lead, T)), jnp.float32)},
        "gated deltanet": lambda: {
            "g": jnp.asarray(-r.uniform(0, 1, (*lead, T)), jnp.float32),
            "beta": jnp.asarray(r.uniform(0.05, 0.95, (*lead, T)), jnp.float32),
        },
        "kda": lambda: {
            "gk": jnp.asarray(-r.uniform(0, 1, (*lead, T, D)), jnp.float32),
            "beta": jnp.asarray(r.uniform(0.05, 0.95, (*lead, T)), jnp.float32),
        },
        "linear": dict,
    }


VARIANTS = ("linear", "retention", "ssd", "gla", "deltanet", "gated deltanet", "kda")


def _documents(seed=2):
    r = np.random.default_rng(seed)
    ids = jnp.asarray(np.cumsum(r.uniform(size=(B, 1, T)) < 0.15, axis=-1), jnp.int32)
    keep = jnp.asarray(np.arange(T) < np.array([T, T - 6])[:, None, None])  # the second example is padded
    return {"segment_ids": ids, "kv_mask": keep}


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_equals_the_step_by_step_recurrence(variant, mode):
    q, k, v = _inputs()
    kw = _gates()[variant]()
    state = jnp.asarray(np.random.default_rng(3).standard_normal((N, D, E)), jnp.float32)
    out, final = jattn.gated_linear_attention(
        q, k, v, **kw, **_documents(), initial_state=state, return_state=True, mode=mode, chunk_size=8
    )
    want, want_final = ref.gated_linear(q, k, v, **kw, **_documents(), state=state)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_equal_the_float64_recurrences_derivatives(variant):
    """grad of the chunkwise form (float64) against central differences of the NumPy loop, every input included."""
    with jax.enable_x64(True):
        q, k, v = _inputs(dtype=jnp.float64)
        args = {"q": q, "k": k, "v": v} | {n: x.astype(jnp.float64) for n, x in _gates()[variant]().items()}
        docs = _documents()
        w = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, T, E)))

        def loss(args):
            return jnp.sum(w * jattn.gated_linear_attention(**args, **docs, chunk_size=8))

        grads = jax.grad(loss)(args)
        r = np.random.default_rng(5)
        for name, x in args.items():
            u = r.standard_normal(x.shape) * (0.01 if name in ("g", "gk", "beta") else 1.0)
            eps = 1e-6

            def ref_loss(sign, name=name, u=u, eps=eps):
                moved = {n: np.asarray(a) + (sign * eps * u if n == name else 0) for n, a in args.items()}
                return np.sum(np.asarray(w) * ref.gated_linear(**moved, **docs)[0])

            numeric = (ref_loss(1) - ref_loss(-1)) / (2 * eps)
            np.testing.assert_allclose(np.sum(np.asarray(grads[name]) * u), numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("variant", ["ssd", "gla", "gated deltanet", "kda"])
def test_the_chunkwise_and_recurrent_forms_have_the_same_gradients(variant):
    q, k, v = _inputs()
    kw = _gates()[variant]()

    def grads(mode):
        def loss(q, k, v, kw):
            return jnp.sum(
                jnp.sin(jattn.gated_linear_attention(q, k, v, **kw, **_documents(), mode=mode, chunk_size=16))
            )

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, kw)

    for got, want in zip(jax.tree.leaves(grads("chunk")), jax.tree.leaves(grads("recurrent")), strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


def test_decoding_token_by_token_equals_the_full_pass():
    """The state returned after a prefix, passed back, continues the sequence: one token at a time and in pieces."""
    q, k, v = _inputs()
    kw = _gates()["gated deltanet"]()
    full, final = jattn.gated_linear_attention(q, k, v, **kw, return_state=True)
    state, outs = None, []
    for t0, t1 in [(0, 20), *((t, t + 1) for t in range(20, T))]:
        piece = {n: x[..., t0:t1] for n, x in kw.items()}
        out, state = jattn.gated_linear_attention(
            q[..., t0:t1, :], k[..., t0:t1, :], v[..., t0:t1, :], **piece, initial_state=state, return_state=True,
            mode="recurrent" if t1 - t0 == 1 else "chunk",
        )  # fmt: skip
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=-2), full, **ref.tol(jnp.float32))
    np.testing.assert_allclose(state, final, **ref.tol(jnp.float32))


def test_a_document_start_forgets_what_came_before():
    """With segment ids, a document's outputs equal those of the document run on its own."""
    q, k, v = _inputs()
    kw = _gates()["gated deltanet"]()
    ids = jnp.asarray((np.arange(T) >= 13).astype(np.int32))
    packed = jattn.gated_linear_attention(q, k, v, **kw, segment_ids=ids, chunk_size=8)
    alone = jattn.gated_linear_attention(
        q[..., 13:, :], k[..., 13:, :], v[..., 13:, :], **{n: x[..., 13:] for n, x in kw.items()}
    )
    np.testing.assert_allclose(packed[..., 13:, :], alone, **ref.tol(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs_keep_a_float32_state(dtype):
    q, k, v = _inputs(dtype=dtype)
    kw = _gates()["gated deltanet"]()
    out, state = jattn.gated_linear_attention(q, k, v, **kw, return_state=True)
    assert out.dtype == dtype and state.dtype == jnp.float32
    want, want_state = ref.gated_linear(q, k, v, **kw)
    np.testing.assert_allclose(out.astype(jnp.float32), want, **ref.tol(dtype))
    np.testing.assert_allclose(state, want_state, **ref.tol(dtype))


def test_65536_steps_stay_finite_with_strong_decays():
    """Decays in log space: a cumulative decay of e^-65536 over the sequence neither overflows nor underflows to NaN."""
    q, k, v = _inputs(lead=(1,), T=65536)
    r = np.random.default_rng(6)
    g = jnp.asarray(-r.uniform(0.5, 1.5, (1, 65536)), jnp.float32)
    beta = jnp.asarray(r.uniform(0.1, 0.9, (1, 65536)), jnp.float32)
    out, state = jax.jit(lambda q, k, v: jattn.gated_linear_attention(q, k, v, g=g, beta=beta, return_state=True))(
        q, k, v
    )
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(jnp.isfinite(state)))
    tail = slice(65536 - 40, None)  # the last steps depend (to float32) only on the steps just before them
    want, _ = ref.gated_linear(q[..., tail, :], k[..., tail, :], v[..., tail, :], g=g[..., tail], beta=beta[..., tail])
    np.testing.assert_allclose(out[..., -8:, :], want[..., -8:, :], **ref.tol(jnp.float32))


def test_jit_vmap_and_the_chunk_scan_keep_one_state_per_chunk():
    q, k, v = _inputs()
    kw = _gates()["gated deltanet"]()
    f = jax.jit(lambda q, k, v, kw: jattn.gated_linear_attention(q, k, v, **kw))
    np.testing.assert_allclose(jax.vmap(f)(q, k, v, kw), f(q, k, v, kw), **ref.tol(jnp.float32))
    # the backward keeps the state at each chunk's start, not at each step: scratch grows as T / chunk_size
    sizes = []
    for t in (1024, 4096):
        x = jnp.zeros((1, t, 64))
        grad = jax.jit(
            jax.grad(
                lambda x, t=t: jnp.sum(jattn.gated_linear_attention(x, x, x, g=-jnp.ones(t), beta=jnp.full(t, 0.5)))
            )
        )
        sizes.append(grad.lower(x).compile().memory_analysis().temp_size_in_bytes)
    assert sizes[1] < 4.5 * sizes[0] and sizes[1] < 64 * 4096 * 64 * 4  # O(T), well below a state per step


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"beta": jnp.full(T, 1.5)}, ValueError, r"beta must lie in \[0, 1\].*1.5"),
        ({"g": jnp.full(T, 0.1)}, ValueError, r"g is a log decay.*0.1"),
        ({"gk": jnp.full((T, D), 0.2)}, ValueError, r"gk is a log decay"),
        ({"gk": jnp.full((T, D), 0.2), "beta": jnp.full(T, 0.5)}, ValueError, r"gk is a log decay.*0.2"),
        ({"gk": jnp.zeros((T, D)), "beta": jnp.full(T, -0.5)}, ValueError, r"beta must lie in \[0, 1\].*-0.5"),
        ({"g": jnp.zeros((T + 1,))}, ValueError, rf"g must broadcast to \(\.\.\., T={T}\), got shape \({T + 1},\)"),
        ({"gk": jnp.zeros((T, D + 1))}, ValueError, r"gk must broadcast to .*D=5"),
        ({"segment_ids": jnp.zeros(T)}, TypeError, r"segment_ids must be integers"),
        ({"kv_mask": jnp.ones(T, jnp.int32)}, TypeError, r"kv_mask must be boolean"),
        ({"initial_state": jnp.zeros((D, E + 1))}, ValueError, r"initial_state must have shape \(\.\.\., D=5, E=7\)"),
        (
            {"g": jnp.zeros((4, T))},
            ValueError,
            r"leading dimensions .* do not broadcast: q \(2, 3, 37, 5\).*g \(4, 37\)",
        ),
        ({"mode": "fused"}, ValueError, r"mode must be one of \('chunk', 'recurrent'\)"),
        ({"chunk_size": 0}, ValueError, r"chunk_size"),
    ],
)
def test_bad_arguments_are_named(kw, error, match):
    q, k, v = _inputs()
    with pytest.raises(error, match=match):
        jattn.gated_linear_attention(q, k, v, **kw)


def test_traced_bad_decays_give_nan_where_they_occur():
    q, k, v = _inputs()
    g = jnp.zeros((B, N, T)).at[1, 2, 5].set(0.3)
    out = jax.jit(lambda g: jattn.gated_linear_attention(q, k, v, g=g))(g)
    bad = np.zeros((B, N), bool)
    bad[1, 2] = True
    assert np.all(np.isnan(out[bad])) and np.all(np.isfinite(out[~bad]))


# -- Kimi Delta Attention (gk with beta) -----------------------------------------------------------------------


def _kda64(seed=7, T=T, lead=(B, N)):
    """float64 KDA inputs, full-sized (g too: it adds to gk), with documents and padding per leading index."""
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((*lead, T, x)) for x in (D, D, E))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    args = {
        "q": q, "k": k, "v": v, "gk": -r.uniform(0, 1, (*lead, T, D)), "g": -r.uniform(0, 0.5, (*lead, T)),
        "beta": r.uniform(0, 1, (*lead, T)), "initial_state": r.standard_normal((*lead, D, E)),
    }  # fmt: skip
    ids = np.cumsum(r.uniform(size=(*lead, T)) < 0.15, axis=-1).astype(np.int32)
    keep = np.ones((*lead, T), bool)
    keep[-1, ..., T - 6 :] = False  # the last example is padded
    return args, {"segment_ids": ids, "kv_mask": keep}


@pytest.mark.parametrize("chunk_size", [8, 6, 32])
def test_kda_chunk_recurrent_and_the_float64_loop_agree_to_1e_12_values_and_gradients(chunk_size):
    """Values, final state and every derivative (q, k, v, gk, g, beta, initial_state) against the NumPy loop's adjoint."""
    with jax.enable_x64(True):
        args, docs = _kda64()
        r = np.random.default_rng(8)
        dout, dfinal = r.standard_normal((B, N, T, E)), r.standard_normal((B, N, D, E))
        state = args["initial_state"]
        want, want_final = ref.gated_linear(
            **{n: x for n, x in args.items() if n != "initial_state"}, **docs, state=state
        )
        want_grads = ref.gated_linear_vjp(
            **{n: x for n, x in args.items() if n != "initial_state"}, **docs, state=state, dout=dout, dfinal=dfinal
        )
        want_grads["initial_state"] = want_grads.pop("state")
        for mode in ("chunk", "recurrent"):

            def call(a, mode=mode):
                return jattn.gated_linear_attention(**a, **docs, return_state=True, mode=mode, chunk_size=chunk_size)

            out, final = call({n: jnp.asarray(x) for n, x in args.items()})
            np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
            np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))
            grads = jax.grad(lambda a, call=call: jnp.sum(call(a)[0] * dout) + jnp.sum(call(a)[1] * dfinal))(
                {n: jnp.asarray(x) for n, x in args.items()}
            )
            for name, x in want_grads.items():
                np.testing.assert_allclose(grads[name], x, **ref.tol(jnp.float64), err_msg=f"{mode} d{name}")


def test_kda_forward_mode_and_second_order_equal_the_recurrent_forms():
    """jvp and a Hessian-vector product (through the gates too) of the chunk form against the step-by-step one.

    The chunk form's pair sums carry their own derivative rule (written in the same sums), so forward mode
    and second order are checked apart from reverse mode; chunks of 6 pad to 8 inside.
    """
    with jax.enable_x64(True):
        args, docs = _kda64(T=23)
        args = {n: jnp.asarray(x) for n, x in args.items()}
        r = np.random.default_rng(11)
        tangent = {n: jnp.asarray(r.standard_normal(x.shape)) for n, x in args.items()}
        w = jnp.asarray(r.standard_normal((B, N, 23, E)))
        results = {}
        for mode in ("chunk", "recurrent"):

            def loss(a, mode=mode):
                return jnp.sum(w * jnp.sin(jattn.gated_linear_attention(**a, **docs, mode=mode, chunk_size=6)))

            value, forward = jax.jvp(loss, (args,), (tangent,))
            results[mode] = (value, forward, jax.jvp(jax.grad(loss), (args,), (tangent,))[1])
        (v0, f0, h0), (v1, f1, h1) = results["chunk"], results["recurrent"]
        np.testing.assert_allclose(v0, v1, **ref.tol(jnp.float64))
        np.testing.assert_allclose(f0, f1, **ref.tol(jnp.float64))
        for name in args:
            np.testing.assert_allclose(h0[name], h1[name], **ref.tol(jnp.float64), err_msg=f"second order, {name}")


def test_kda_decays_first_then_the_delta_step():
    """One step from a given state, written out: S = (I - β k kᵀ) diag(a) S0 + β k vᵀ, not diag(a) (I - β k kᵀ) S0."""
    with jax.enable_x64(True):
        args, _ = _kda64(T=1, lead=(1, 1))
        a = np.exp(args["gk"][0, 0, 0] + args["g"][0, 0, 0])
        k, v, b, S0 = args["k"][0, 0, 0], args["v"][0, 0, 0], args["beta"][0, 0, 0], args["initial_state"][0, 0]
        want = (np.eye(D) - b * np.outer(k, k)) @ (a[:, None] * S0) + b * np.outer(k, v)
        other = a[:, None] * ((np.eye(D) - b * np.outer(k, k)) @ S0) + b * np.outer(k, v)
        assert np.abs(want - other).max() > 1e-3  # the orders differ for these inputs
        for mode in ("chunk", "recurrent"):
            _, S = jattn.gated_linear_attention(**args, return_state=True, mode=mode)
            np.testing.assert_allclose(S[0, 0], want, **ref.tol(jnp.float64))


def test_kda_float32_at_2048_steps_is_within_1e_3_of_float64():
    with jax.enable_x64(True):
        args, docs = _kda64(T=2048, lead=(2, 1))
        docs["kv_mask"] = docs["kv_mask"][:, :1]
        out64, state64 = jattn.gated_linear_attention(**args, **docs, return_state=True)
        out32, state32 = jattn.gated_linear_attention(
            **{n: jnp.asarray(x, jnp.float32) for n, x in args.items()}, **docs, return_state=True
        )
    assert out32.dtype == jnp.float32
    for got, want in ((out32, out64), (state32, state64)):
        err = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want)))
        assert err <= 1e-3 * np.max(np.abs(np.asarray(want))), err


def test_kda_stays_exact_through_decays_of_e_minus_1e5():
    """Single steps that wipe a feature (log decay -1e5) among small ones: no exp of a sum above 0 overflows."""
    with jax.enable_x64(True):
        args, docs = _kda64(seed=9, T=70)
        strong = np.random.default_rng(10).uniform(size=args["gk"].shape) < 0.05
        args["gk"] = np.where(strong, -1e5, args["gk"])
        want, want_final = ref.gated_linear(
            **{n: x for n, x in args.items() if n != "initial_state"}, **docs, state=args["initial_state"]
        )
        for chunk_size in (16, 70):
            out, final = jattn.gated_linear_attention(**args, **docs, return_state=True, chunk_size=chunk_size)
            np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
            np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))


# -- the modules' recurrent kinds ------------------------------------------------------------------------------

KINDS = ("retention", "ssd", "gla", "deltanet", "gated_deltanet", "kda")
F_MODEL, HEADS = 24, 3  # head depth 8


def _np_gates(kind, m, x):
    """The gates of ``kind`` written out in float64 NumPy from the module's parameters (docs: jattn._linear.kinds)."""
    p = {name: np.asarray(getattr(m, name)[...], np.float64) for name in m.gate_names}
    x = np.asarray(x, np.float64)
    softplus, sigmoid = (lambda z: np.log1p(np.exp(z))), (lambda z: 1 / (1 + np.exp(-z)))
    heads = lambda y: np.moveaxis(y, -1, -2)  # noqa: E731  (B, T, N) -> (B, N, T)
    out = {}
    if kind == "retention":
        out["g"] = np.log(1 - 2.0 ** -(5.0 + np.arange(HEADS)))[None, :, None]
    if kind in ("ssd", "gated_deltanet"):
        out["g"] = heads(-np.exp(p["a_log"]) * softplus(x @ p["w_dt"] + p["dt_bias"]))
    if kind == "gla":
        gk = np.log(sigmoid(x @ p["w_gk_down"] @ p["w_gk_up"] + p["b_gk"])) / 16
        out["gk"] = gk.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)
    if kind == "kda":  # -exp(a_log) per head times softplus of a rank-D map, per head and feature
        gk = softplus(x @ p["w_gk_down"] @ p["w_gk_up"] + p["dt_bias"]).reshape(*x.shape[:2], HEADS, -1)
        out["gk"] = (-np.exp(p["a_log"])[:, None] * gk).transpose(0, 2, 1, 3)
    if kind in ("deltanet", "gated_deltanet", "kda"):
        out["beta"] = heads(sigmoid(x @ p["w_beta"]))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_each_module_kind_equals_its_gates_written_out(kind):
    """NNX and Linen: projections, the kind's gates (NumPy, from the parameters) and the float64 recurrence."""
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL))
    split = lambda y: np.asarray(y, np.float64).reshape(2, 11, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = (split(x @ getattr(m, w).kernel[...]) for w in ("wq", "wk", "wv"))
    if kind in ("deltanet", "gated_deltanet", "kda"):  # SiLU, then an L2 norm over the head depth
        q, k = (
            (y / (1 + np.exp(-y))) / np.sqrt(np.sum((y / (1 + np.exp(-y))) ** 2, -1, keepdims=True) + 1e-6)
            for y in (q, k)
        )
    out, _ = ref.gated_linear(q, k, v, **_np_gates(kind, m, x))
    want = out.transpose(0, 2, 1, 3).reshape(2, 11, F_MODEL) @ np.asarray(m.wo.kernel[...], np.float64)
    np.testing.assert_allclose(m(x), want, rtol=1e-4, atol=1e-5)
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind)
    np.testing.assert_allclose(linen.apply({"params": ref.linen_params(m)}, x), m(x), **ref.tol(jnp.float32))


@pytest.mark.parametrize("setup", ["float64 params and input", "dtype=float64"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_float64_module_computes_its_gates_in_float64(kind, setup):
    """The module's compute dtype rule (float64 in, float64 out) reaches the gates and q/k features: to 1e-12."""
    from flax import nnx

    with jax.enable_x64(True):
        wide = setup == "float64 params and input"
        opts = {"param_dtype": jnp.float64} if wide else {"dtype": jnp.float64}
        m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, rngs=nnx.Rngs(0), **opts)
        x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL), jnp.float64 if wide else jnp.float32)
        split = lambda y: y.reshape(2, 11, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (split(ref.f64(x) @ ref.f64(getattr(m, w).kernel[...])) for w in ("wq", "wk", "wv"))
        if kind in ("deltanet", "gated_deltanet", "kda"):  # SiLU, then an L2 norm over the head depth
            q, k = (y / (1 + np.exp(-y)) for y in (q, k))
            q, k = (y / np.sqrt(np.sum(y**2, -1, keepdims=True) + 1e-6) for y in (q, k))
        out, _ = ref.gated_linear(q, k, v, **_np_gates(kind, m, x))
        want = out.transpose(0, 2, 1, 3).reshape(2, 11, F_MODEL) @ ref.f64(m.wo.kernel[...])
        got = m(x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))


@pytest.mark.parametrize("kind", ["gla", "gated_deltanet", "kda"])
def test_module_decoding_from_the_cache_equals_the_full_pass(kind):
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL))
    m.init_cache(2, 11)
    pieces = [m(x[:, :4], decode=True)] + [m(x[:, t : t + 1], decode=True) for t in range(4, 11)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), m(x), **ref.tol(jnp.float32))
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind)
    cache = linen.init(jax.random.key(0), 2, 11, method="init_cache")["cache"]
    outs = []
    for t in range(11):
        y, state = linen.apply(
            {"params": ref.linen_params(m), "cache": cache}, x[:, t : t + 1], decode=True, mutable=["cache"]
        )
        outs.append(y)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), m(x), **ref.tol(jnp.float32))


def test_module_kinds_refuse_what_they_cannot_do():
    from flax import nnx

    with pytest.raises(ValueError, match=r"kind='deltanet'.*num_kv_heads = num_heads.*num_kv_heads=1"):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, num_kv_heads=1, kind="deltanet", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kind='ssd'.*dropout_rate=0.1"):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="ssd", dropout_rate=0.1, rngs=nnx.Rngs(0))
    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="gla", rngs=nnx.Rngs(0))
    x = jnp.ones((1, 5, F_MODEL))
    with pytest.raises(ValueError, match=r"kind='gla' is causal: it takes mask=None or masks.causal\(\)"):
        m(x, jattn.masks.sliding_window(2))
    with pytest.raises(ValueError, match=r"return_weights needs kind='softmax'"):
        m(x, return_weights=True)
    with pytest.raises(ValueError, match=r"kind='retention' is causal self-attention"):  # refused when built
        jattn.nnx.CrossAttention(F_MODEL, 7, num_heads=HEADS, kind="retention", rngs=nnx.Rngs(0))
