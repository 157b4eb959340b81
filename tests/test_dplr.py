"""jattn.gated_linear_attention's diagonal-plus-low-rank transition (a, b; RWKV-7): both forms against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

B, N, T, D, E = 2, 3, 37, 5, 7  # odd, distinct sizes; T is not a multiple of the chunks below


def _inputs(seed=0, lead=(B, N), T=T, dtype=jnp.float64):
    """q, k, v and RWKV-7's transition: ``a = -κ̂``, ``b = κ̂ ⊙ α`` (κ̂ unit, α in [0, 1]), log decays in [-1, 0]."""
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((*lead, T, x)) for x in (D, D, E))
    kappa = r.standard_normal((*lead, T, D))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    gates = {"gk": -r.uniform(0, 1, (*lead, T, D)), "a": -kappa, "b": kappa * r.uniform(0, 1, (*lead, T, D))}
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return tuple(cast(x) for x in (q, k, v)), {n: cast(x) for n, x in gates.items()}


def _documents(seed=2):
    r = np.random.default_rng(seed)
    ids = jnp.asarray(np.cumsum(r.uniform(size=(B, 1, T)) < 0.15, axis=-1), jnp.int32)
    keep = jnp.asarray(np.arange(T) < np.array([T, T - 6])[:, None, None])  # the second example is padded
    return {"segment_ids": ids, "kv_mask": keep}


def _state(dtype=jnp.float64):
    return jnp.asarray(np.random.default_rng(3).standard_normal((N, D, E)), dtype)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64])
def test_both_forms_equal_the_float64_recurrence(mode, chunk_size):
    """float64 inputs: chunkwise and recurrent equal the step-by-step loop to 1e-12, with documents, padding, a state."""
    if mode == "recurrent" and chunk_size != 8:
        pytest.skip("the recurrent form has no chunks")
    with jax.enable_x64(True):
        (q, k, v), gates = _inputs()
        g = jnp.asarray(-np.random.default_rng(4).uniform(0, 0.5, (N, T)))  # a decay per step and head adds to gk
        out, final = jattn.gated_linear_attention(
            q, k, v, **gates, g=g, **_documents(), initial_state=_state(), return_state=True, mode=mode,
            chunk_size=chunk_size,
        )  # fmt: skip
        want, want_final = ref.dplr(q, k, v, **gates, g=g, **_documents(), state=_state())
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))
        assert not np.allclose(want, ref.dplr(q, k, v, **gates, g=g, state=_state())[0])  # the documents matter


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradients_equal_the_hand_written_adjoint(mode):
    """Every input's gradient (q, k, v, gk, g, a, b, initial_state) to 1e-12 of the float64 adjoint recurrence."""
    with jax.enable_x64(True):
        (q, k, v), gates = _inputs()
        args = {"q": q, "k": k, "v": v, **gates, "initial_state": jnp.broadcast_to(_state(), (B, N, D, E))}
        args["g"] = jnp.asarray(-np.random.default_rng(4).uniform(0, 0.5, (B, N, T)))
        r = np.random.default_rng(5)
        dout, dfinal = r.standard_normal((B, N, T, E)), r.standard_normal((B, N, D, E))

        def loss(args):
            out, final = jattn.gated_linear_attention(
                **args, **_documents(), return_state=True, mode=mode, chunk_size=8
            )
            return jnp.sum(dout * out) + jnp.sum(dfinal * final)

        got = jax.grad(loss)(args)
        moved = {n: x for n, x in args.items() if n != "initial_state"}
        want = ref.dplr(**moved, **_documents(), state=args["initial_state"], grads_of=(dout, dfinal))
        want["initial_state"], want["g"] = want.pop("state"), np.sum(want["gk"], axis=-1)
        for name in args:
            ref.assert_grad_close(got[name], want[name], jnp.float64)


def test_its_special_cases_are_deltanet_gated_deltanet_and_gla():
    """a = k, b = -β k with β v is DeltaNet; a = e^g k with the decay g, Gated DeltaNet; a = b = 0, GLA."""
    with jax.enable_x64(True):
        (q, k, v), gates = _inputs()
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        r = np.random.default_rng(6)
        beta, g = jnp.asarray(r.uniform(0.05, 0.95, (B, N, T))), jnp.asarray(-r.uniform(0, 1, (B, N, T)))
        docs = _documents()
        kw = dict(**docs, initial_state=_state(), return_state=True, chunk_size=8)
        cases = [
            ({"beta": beta}, {"a": k, "b": -beta[..., None] * k}),
            ({"beta": beta, "g": g}, {"a": jnp.exp(g)[..., None] * k, "b": -beta[..., None] * k, "g": g}),
        ]
        for mode in ("chunk", "recurrent"):
            for delta, low_rank in cases:
                want = jattn.gated_linear_attention(q, k, v, **delta, **kw, mode=mode)
                got = jattn.gated_linear_attention(q, k, beta[..., None] * v, **low_rank, **kw, mode=mode)
                for x, y in zip(got, want, strict=True):
                    np.testing.assert_allclose(x, y, **ref.tol(jnp.float64))
            zero = jnp.zeros_like(k)
            want = jattn.gated_linear_attention(q, k, v, gk=gates["gk"], **kw, mode=mode)
            got = jattn.gated_linear_attention(q, k, v, gk=gates["gk"], a=zero, b=zero, **kw, mode=mode)
            for x, y in zip(got, want, strict=True):
                np.testing.assert_allclose(x, y, **ref.tol(jnp.float64))


def test_float32_at_2048_steps_is_within_1e3_of_float64():
    """RWKV-7's transition over 2048 steps: float32 within 1e-3 (relative to the output's size) of float64."""
    with jax.enable_x64(True):
        (q, k, v), gates = _inputs(lead=(1, 2), T=2048)
        want, want_final = jattn.gated_linear_attention(q, k, v, **gates, return_state=True)
        np.testing.assert_allclose(want, ref.dplr(q, k, v, **gates)[0], **ref.tol(jnp.float64))
        f32 = {n: x.astype(jnp.float32) for n, x in gates.items()}
        for mode in ("chunk", "recurrent"):
            out, final = jattn.gated_linear_attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **f32, return_state=True,
                mode=mode,
            )  # fmt: skip
            assert out.dtype == jnp.float32
            assert np.max(np.abs(ref.f64(out) - want)) <= 1e-3 * np.max(np.abs(want))
            assert np.max(np.abs(ref.f64(final) - want_final)) <= 1e-3 * np.max(np.abs(want_final))


def _structured(T: int, seed: int = 8):
    """Removal keys that repeat or correlate, where the reads' triangular system is far from the identity.

    Three key patterns, each as RWKV-7 (``a = -κ̂``, ``b = 0.9 κ̂``, log decays -0.01) and as DeltaNet written
    as DPLR (``a = κ̂``, ``b = -β κ̂`` with ``β = 0.9``, the key ``κ̂``, ``β v`` for v, no decay), two examples
    each, stacked on one leading axis of 12: ``repeated`` (one unit key at every step), ``alternating`` (two
    unit keys at 0.9 cosine, in turn) and ``correlated`` (a unit key plus 10% noise a step). Returns ``(q, k,
    v)`` and the gates as float64 NumPy arrays ``(12, T, ...)``.
    """
    r = np.random.default_rng(seed)
    unit, normal = np.linalg.qr(r.standard_normal((D, 2)))[0].T  # orthonormal
    patterns = [
        np.broadcast_to(unit, (2, T, D)),
        np.where(np.arange(2 * T).reshape(2, T, 1) % 2 == 0, unit, 0.9 * unit + np.sqrt(1 - 0.81) * normal),
        unit + 0.1 * r.standard_normal((2, T, D)),
    ]
    kappa = np.concatenate(patterns)
    kappa = np.concatenate([kappa, kappa])
    kappa = kappa / np.linalg.norm(kappa, axis=-1, keepdims=True)
    rwkv7 = np.arange(12)[:, None, None] < 6  # the first six RWKV-7, the last six DeltaNet
    q, v = r.standard_normal((12, T, D)), r.standard_normal((12, T, E))
    k = np.where(rwkv7, r.standard_normal((12, T, D)) / np.sqrt(D), kappa)
    gates = {"gk": np.where(rwkv7, -0.01, 0.0) * np.ones((12, T, D)), "a": np.where(rwkv7, -kappa, kappa)}
    gates["b"] = np.where(rwkv7, 0.9, -0.9) * kappa
    return (q, k, np.where(rwkv7, v, 0.9 * v)), gates


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 32, 64, 128, 256])
def test_repeated_and_correlated_keys_at_every_chunk_size_float64(chunk_size):
    """Chunks of 1 to 256 (past T) equal the float64 loop to 1e-12 in values and in every input's gradient.

    With keys that repeat or correlate, a Neumann product ``(I + L)(I + L²)...`` of the reads' system holds
    binomial-sized powers that cancel (a relative error of 0.125 at chunks of 32 in float32, 1e-4 at 64 in
    float64); the chunk form solves it by forward substitution.
    """
    T_long = 150
    (q, k, v), gates = _structured(T_long)
    dout = np.random.default_rng(9).standard_normal((12, T_long, E))
    with jax.enable_x64(True):
        want = ref.dplr(q, k, v, **gates)[0]
        grads_want = ref.dplr(q, k, v, **gates, grads_of=(dout, 0.0))

        def loss(q, k, v, gates):
            out = jattn.gated_linear_attention(q, k, v, **gates, chunk_size=chunk_size)
            return jnp.sum(dout * out), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, gates)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        for name, got in zip("qkv", grads[:3], strict=True):
            ref.assert_grad_close(got, grads_want[name], jnp.float64)
        for name, got in grads[3].items():
            ref.assert_grad_close(got, grads_want[name], jnp.float64)


def test_repeated_and_correlated_keys_float32_at_2048_steps():
    """float32, T = 2048: chunks of 8 to 128 and the recurrence within 1e-4 (relative to the output) of float64."""
    (q, k, v), gates = _structured(2048)
    with jax.enable_x64(True):
        want = ref.dplr(q, k, v, **gates)[0]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    q, k, v, gates = f32(q), f32(k), f32(v), {n: f32(x) for n, x in gates.items()}
    f = jax.jit(jattn.gated_linear_attention, static_argnames=("chunk_size", "mode"))
    for mode, chunk_size in [("recurrent", 8), *(("chunk", c) for c in (8, 16, 32, 64, 128))]:
        out = ref.f64(f(q, k, v, **gates, chunk_size=chunk_size, mode=mode))
        err = np.max(np.abs(out - want), axis=(1, 2)) / np.max(np.abs(want), axis=(1, 2))  # each example's
        assert np.all(err <= 1e-4), (mode, chunk_size, err)


def test_decoding_in_pieces_equals_the_full_pass():
    """The state after a prefix, passed back, continues the sequence: a chunk, then one token at a time."""
    (q, k, v), gates = _inputs(dtype=jnp.float32)
    full, final = jattn.gated_linear_attention(q, k, v, **gates, return_state=True)
    state, outs = None, []
    for t0, t1 in [(0, 20), *((t, t + 1) for t in range(20, T))]:
        out, state = jattn.gated_linear_attention(
            q[..., t0:t1, :], k[..., t0:t1, :], v[..., t0:t1, :], **{n: x[..., t0:t1, :] for n, x in gates.items()},
            initial_state=state, return_state=True, mode="recurrent" if t1 - t0 == 1 else "chunk",
        )  # fmt: skip
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=-2), full, **ref.tol(jnp.float32))
    np.testing.assert_allclose(state, final, **ref.tol(jnp.float32))


def test_jit_vmap_and_one_state_per_chunk():
    (q, k, v), gates = _inputs(dtype=jnp.float32)
    f = jax.jit(lambda q, k, v, gates: jattn.gated_linear_attention(q, k, v, **gates))
    eager = jattn.gated_linear_attention(q, k, v, **gates)
    np.testing.assert_allclose(f(q, k, v, gates), eager, **ref.tol(jnp.float32))
    np.testing.assert_allclose(jax.vmap(f)(q, k, v, gates), eager, **ref.tol(jnp.float32))
    sizes = []  # the backward keeps the state at each chunk's start: scratch grows as T, not as T D E
    for t in (512, 2048):
        x = jnp.zeros((1, t, 32))

        def loss(x, t=t):
            return jnp.sum(jattn.gated_linear_attention(x, x, x, gk=-jnp.ones((t, 32)), a=x, b=-x))

        sizes.append(jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes)
    assert sizes[1] < 4.5 * sizes[0] and sizes[1] < 32 * 2048 * 32 * 4  # well below a state per step


def test_strong_decays_over_16384_steps_stay_finite():
    """Every exponent a difference <= 0: a cumulative decay of e^-16384 per feature neither overflows nor turns NaN."""
    (q, k, v), gates = _inputs(lead=(1,), T=16384, dtype=jnp.float32)
    gk = jnp.asarray(-np.random.default_rng(7).uniform(0.5, 1.5, (1, 16384, D)), jnp.float32)
    out, state = jax.jit(
        lambda q, k, v: jattn.gated_linear_attention(q, k, v, **(gates | {"gk": gk}), return_state=True)
    )(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(jnp.isfinite(state)))
    tail = slice(16384 - 40, None)  # the last steps depend (to float32) only on the steps just before them
    want, _ = ref.dplr(
        *(x[..., tail, :] for x in (q, k, v)), **{n: x[..., tail, :] for n, x in (gates | {"gk": gk}).items()}
    )
    np.testing.assert_allclose(out[..., -8:, :], want[..., -8:, :], **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"a": jnp.zeros((T, D))}, ValueError, r"a and b .* come together: got only a"),
        ({"b": jnp.zeros((T, D))}, ValueError, r"got only b"),
        ({"a": jnp.zeros((T, D)), "b": jnp.zeros((T, D)), "beta": jnp.full(T, 0.5)}, ValueError, r"beta .* and a, b"),
        (
            {"a": jnp.zeros((T, D + 1)), "b": jnp.zeros((T, D))},
            ValueError,
            r"a must broadcast to \(\.\.\., T=37, D=5\)",
        ),
        (
            {"a": jnp.zeros((T, D)), "b": jnp.zeros((T + 1, D))},
            ValueError,
            r"b must broadcast to .* got shape \(38, 5\)",
        ),
        ({"a": jnp.zeros((T, D), jnp.int32), "b": jnp.zeros((T, D))}, TypeError, r"a must be floating"),
        ({"a": jnp.zeros((4, 1, T, D)), "b": jnp.zeros((T, D))}, ValueError, r"do not broadcast: q \(2, 3, 37, 5\)"),
        (
            {"a": jnp.zeros((T, D)), "b": jnp.zeros((T, D)), "gk": jnp.full((T, D), 0.2)},
            ValueError,
            r"gk is a log decay",
        ),
    ],
)
def test_bad_arguments_are_named(kw, error, match):
    (q, k, v), _ = _inputs(dtype=jnp.float32)
    with pytest.raises(error, match=match):
        jattn.gated_linear_attention(q, k, v, **kw)


# -- the modules' 'rwkv7' kind ---------------------------------------------------------------------------------

F_MODEL, HEADS, DEPTH = 24, 3, 8


def _np_rwkv7(m, x):
    """The 'rwkv7' kind written out in float64 NumPy from the module's parameters (jattn._linear.kinds)."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    heads = lambda y: y.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731  (B, N, T, D)
    q, k, v = (heads(x @ ref.f64(getattr(m, w).kernel[...])) for w in ("wq", "wk", "wv"))
    gk = -np.exp(-0.5) * sigmoid(np.tanh(x @ p["w_decay_down"]) @ p["w_decay_up"] + p["b_decay"])
    rate = heads(sigmoid(x @ p["w_iclr_down"] @ p["w_iclr_up"] + p["b_iclr"]))
    k_k, k_a = (p[n].reshape(HEADS, 1, DEPTH) for n in ("k_k", "k_a"))
    kappa = k * k_k / np.sqrt(np.sum((k * k_k) ** 2, -1, keepdims=True))
    out, _ = ref.dplr(q, k * (1 + (rate - 1) * k_a), v, a=-kappa, b=kappa * rate, gk=heads(gk))
    return out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1) @ ref.f64(m.wo.kernel[...])


def test_the_rwkv7_kind_equals_its_gates_written_out():
    """NNX (float32 and float64) and Linen: projections, RWKV-7's gates and transition, the float64 recurrence."""
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="rwkv7", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL))
    np.testing.assert_allclose(m(x), _np_rwkv7(m, x), rtol=1e-4, atol=1e-5)
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind="rwkv7")
    np.testing.assert_allclose(linen.apply({"params": ref.linen_params(m)}, x), m(x), **ref.tol(jnp.float32))
    with jax.enable_x64(True):
        m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="rwkv7", param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL), jnp.float64)
        got = m(x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, _np_rwkv7(m, x), **ref.tol(jnp.float64))


def test_rwkv7_decoding_from_the_cache_equals_the_full_pass():
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="rwkv7", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL))
    m.init_cache(2, 11)
    pieces = [m(x[:, :4], decode=True)] + [m(x[:, t : t + 1], decode=True) for t in range(4, 11)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), m(x), **ref.tol(jnp.float32))
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind="rwkv7")
    cache = linen.init(jax.random.key(0), 2, 11, method="init_cache")["cache"]
    outs = []
    for t in range(11):
        y, state = linen.apply(
            {"params": ref.linen_params(m), "cache": cache}, x[:, t : t + 1], decode=True, mutable=["cache"]
        )
        outs.append(y)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), m(x), **ref.tol(jnp.float32))
