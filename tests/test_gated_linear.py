"""jattn.gated_linear_attention's decays and delta rule (linear, retention, SSD, GLA, DeltaNet, Gated DeltaNet, KDA).

The tests every kind passes are :class:`tests.linear_family.LinearFamilyTests`, run here over the rows
``GATED_KINDS`` (both forms and the gradients against the float64 step-by-step loop and its adjoint, float32 at
T = 2048, decoding in pieces, jit and vmap, the module kinds written out and decoding from their cache); beside
them the special cases: documents, 16-bit inputs, long sequences and strong decays, the backward's memory, bad
arguments, and KDA's decay order, forward and second order and decays of e^-1e5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref
from tests.linear_family import F_MODEL, GATED_KINDS, HEADS, LinearFamilyTests, as_jax, documents

B, N, T, D, E = 2, 3, 37, 5, 7  # the rows' sizes: odd, distinct; T is not a multiple of the chunks
KIND = {kind.name: kind for kind in GATED_KINDS}


class TestGatedKinds(LinearFamilyTests):
    KINDS = GATED_KINDS


def _inputs(kind="gated deltanet", dtype=jnp.float32, **kw):
    """q, k, v and the kind's gates (no initial state), as ``dtype``."""
    args = as_jax(KIND[kind].example(state=False, **kw), dtype)
    return args.pop("q"), args.pop("k"), args.pop("v"), args


def test_a_document_start_forgets_what_came_before():
    """With segment ids, a document's outputs equal those of the document run on its own."""
    q, k, v, kw = _inputs()
    ids = jnp.asarray((np.arange(T) >= 13).astype(np.int32))

    def both(q, k, v, kw):
        packed = jattn.gated_linear_attention(q, k, v, **kw, segment_ids=ids, chunk_size=8)
        rest = {n: x[..., 13:] for n, x in kw.items()}
        return packed, jattn.gated_linear_attention(q[..., 13:, :], k[..., 13:, :], v[..., 13:, :], **rest)

    packed, alone = jax.jit(both)(q, k, v, kw)
    np.testing.assert_allclose(packed[..., 13:, :], alone, **ref.tol(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs_keep_a_float32_state(dtype):
    q, k, v, kw = _inputs()
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out, state = jax.jit(lambda q, k, v, kw: jattn.gated_linear_attention(q, k, v, **kw, return_state=True))(
        q, k, v, kw
    )
    assert out.dtype == dtype and state.dtype == jnp.float32
    want, want_state = ref.gated_linear(q, k, v, **kw)
    np.testing.assert_allclose(out.astype(jnp.float32), want, **ref.tol(dtype))
    np.testing.assert_allclose(state, want_state, **ref.tol(dtype))


def test_65536_steps_stay_finite_with_strong_decays():
    """Decays in log space: a cumulative decay of e^-65536 over the sequence neither overflows nor underflows to NaN."""
    q, k, v, _ = _inputs("linear", lead=(1,), T=65536)
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


def test_the_backward_keeps_one_state_per_chunk():
    """The gradient's compiled scratch grows as T / chunk_size states, not as a state per step."""
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
    q, k, v, _ = _inputs()
    with pytest.raises(error, match=match):
        jattn.gated_linear_attention(q, k, v, **kw)


def test_traced_bad_decays_give_nan_where_they_occur():
    q, k, v, _ = _inputs()
    g = jnp.zeros((B, N, T)).at[1, 2, 5].set(0.3)
    out = jax.jit(lambda g: jattn.gated_linear_attention(q, k, v, g=g))(g)
    bad = np.zeros((B, N), bool)
    bad[1, 2] = True
    assert np.all(np.isnan(out[bad])) and np.all(np.isfinite(out[~bad]))


# -- Kimi Delta Attention (gk with beta) -----------------------------------------------------------------------
# Its values and gradients in both forms (chunks of 6, 8 and 32) against the float64 loop and its adjoint, and
# float32 at T = 2048, are the row "kda" of TestGatedKinds.


def _kda64(seed=7, T=T, lead=(B, N)):
    """float64 KDA inputs (gk, g, beta, an initial state; float32's values) and documents with padding, as NumPy."""
    return KIND["kda"].example(seed=seed, lead=lead, T=T), documents(T, 6)


def test_kda_forward_mode_and_second_order_equal_the_recurrent_forms():
    """jvp and a Hessian-vector product (through the gates too) of the chunk form against the step-by-step one.

    The chunk form's pair sums carry their own derivative rule (written in the same sums), so forward mode
    and second order are checked apart from reverse mode; chunks of 6 pad to 8 inside.
    """
    with jax.enable_x64(True):
        args, docs = _kda64(T=23)
        args = as_jax(args)
        r = np.random.default_rng(11)
        tangent = {n: jnp.asarray(r.standard_normal(x.shape)) for n, x in args.items()}
        w = jnp.asarray(r.standard_normal((B, N, 23, E)))

        def both(args, tangent):
            results = []
            for mode in ("chunk", "recurrent"):

                def loss(a, mode=mode):
                    return jnp.sum(w * jnp.sin(jattn.gated_linear_attention(**a, **docs, mode=mode, chunk_size=6)))

                value, forward = jax.jvp(loss, (args,), (tangent,))
                results.append((value, forward, jax.jvp(jax.grad(loss), (args,), (tangent,))[1]))
            return results

        (v0, f0, h0), (v1, f1, h1) = jax.jit(both)(args, tangent)
        np.testing.assert_allclose(v0, v1, **ref.tol(jnp.float64))
        np.testing.assert_allclose(f0, f1, **ref.tol(jnp.float64))
        for name in args:
            np.testing.assert_allclose(h0[name], h1[name], **ref.tol(jnp.float64), err_msg=f"second order, {name}")


def test_kda_decays_first_then_the_delta_step():
    """One step from a given state, written out: S = (I - β k kᵀ) diag(a) S0 + β k vᵀ, not diag(a) (I - β k kᵀ) S0."""
    with jax.enable_x64(True):
        args, _ = _kda64(T=1, lead=(1, 1))
        a = np.exp(args["gk"][0, 0, 0] + args["g"][0, 0, 0])
        k, v, b, S0 = args["k"][0, 0, 0], args["v"][0, 0, 0], args["beta"][0, 0, 0], args["initial_state"][0]
        want = (np.eye(D) - b * np.outer(k, k)) @ (a[:, None] * S0) + b * np.outer(k, v)
        other = a[:, None] * ((np.eye(D) - b * np.outer(k, k)) @ S0) + b * np.outer(k, v)
        assert np.abs(want - other).max() > 1e-3  # the orders differ for these inputs
        states = jax.jit(
            lambda a: [jattn.gated_linear_attention(**a, return_state=True, mode=m)[1] for m in ("chunk", "recurrent")]
        )(as_jax(args))
        for S in states:
            np.testing.assert_allclose(S[0, 0], want, **ref.tol(jnp.float64))


def test_kda_stays_exact_through_decays_of_e_minus_1e5():
    """Single steps that wipe a feature (log decay -1e5) among small ones: no exp of a sum above 0 overflows."""
    with jax.enable_x64(True):
        args, docs = _kda64(seed=9, T=70)
        strong = np.random.default_rng(10).uniform(size=args["gk"].shape) < 0.05
        args["gk"] = np.where(strong, -1e5, args["gk"])
        want, want_final = ref.gated_linear(
            **{n: x for n, x in args.items() if n != "initial_state"}, **docs, state=args["initial_state"]
        )
        run = jax.jit(
            lambda a: [jattn.gated_linear_attention(**a, **docs, return_state=True, chunk_size=c) for c in (16, 70)]
        )
        for out, final in run(as_jax(args)):
            np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
            np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))


# -- the modules' recurrent kinds ------------------------------------------------------------------------------
# Each kind written out and decoding from its cache: the rows' module tests of TestGatedKinds.


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
