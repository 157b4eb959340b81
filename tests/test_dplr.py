"""jattn.gated_linear_attention's diagonal-plus-low-rank transition (a, b; RWKV-7): both forms against float64 NumPy.

The tests every kind passes are :class:`tests.linear_family.LinearFamilyTests`, run here over the row ``rwkv7``
(``a = -κ̂``, ``b = κ̂ ⊙ α``, ``gk`` and ``g``; chunks of 1, 8, 16 and 64): both forms and the gradients against the
float64 step-by-step loop and its hand-written adjoint, float32 at T = 2048, decoding in pieces, jit and vmap, the
``rwkv7`` module kind written out and decoding from its cache. Beside them the special cases: DeltaNet, Gated
DeltaNet and GLA as DPLR, repeated and correlated removal keys at every chunk size, the backward's memory, strong
decays over 16384 steps and bad arguments.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref
from tests.linear_family import DPLR_KINDS, LinearFamilyTests, as_jax, documents

B, N, T, D, E = 2, 3, 37, 5, 7  # the row's sizes: odd, distinct; T is not a multiple of the chunks
RWKV7 = DPLR_KINDS[0]


class TestLowRankKinds(LinearFamilyTests):
    KINDS = DPLR_KINDS


def _inputs(seed=0, lead=(B, N), T=T, dtype=jnp.float64):
    """q, k, v and RWKV-7's transition: ``a = -κ̂``, ``b = κ̂ ⊙ α`` (κ̂ unit, α in [0, 1]), log decays in [-1, 0]."""
    args = as_jax(RWKV7.example(seed=seed, lead=lead, T=T, state=False), dtype)
    del args["g"]  # the row's decay per head and step, beside gk
    return (args.pop("q"), args.pop("k"), args.pop("v")), args


def _documents():
    return {n: jnp.asarray(x) for n, x in documents(T, 6).items()}


def _state(dtype=jnp.float64):
    return jnp.asarray(RWKV7.state(), dtype)


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

        def pairs(q, k, v, gk, beta, g):
            out = []
            for mode in ("chunk", "recurrent"):
                for delta, low_rank in cases:
                    want = jattn.gated_linear_attention(q, k, v, **delta, **kw, mode=mode)
                    got = jattn.gated_linear_attention(q, k, beta[..., None] * v, **low_rank, **kw, mode=mode)
                    out.append((got, want))
                zero = jnp.zeros_like(k)
                want = jattn.gated_linear_attention(q, k, v, gk=gk, **kw, mode=mode)
                out.append((jattn.gated_linear_attention(q, k, v, gk=gk, a=zero, b=zero, **kw, mode=mode), want))
            return out

        for got, want in jax.jit(pairs)(q, k, v, gates["gk"], beta, g):
            for x, y in zip(got, want, strict=True):
                np.testing.assert_allclose(x, y, **ref.tol(jnp.float64))


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


@functools.cache
def _structured_reference(T_long: int) -> tuple:
    """:func:`_structured`'s inputs (float64), a cotangent, and the float64 loop's output and gradients (once a run)."""
    (q, k, v), gates = _structured(T_long)
    dout = np.random.default_rng(9).standard_normal((12, T_long, E))
    with jax.enable_x64(True):
        return (q, k, v), gates, dout, ref.dplr(q, k, v, **gates)[0], ref.dplr(q, k, v, **gates, grads_of=(dout, 0.0))


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 32, 64, 128, 256])
def test_repeated_and_correlated_keys_at_every_chunk_size_float64(chunk_size):
    """Chunks of 1 to 256 (past T) equal the float64 loop to 1e-12 in values and in every input's gradient.

    With keys that repeat or correlate, a Neumann product ``(I + L)(I + L²)...`` of the reads' system holds
    binomial-sized powers that cancel (a relative error of 0.125 at chunks of 32 in float32, 1e-4 at 64 in
    float64); the chunk form solves it by forward substitution.
    """
    (q, k, v), gates, dout, want, grads_want = _structured_reference(150)
    with jax.enable_x64(True):

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


def test_the_backward_keeps_one_state_per_chunk():
    """The gradient's compiled scratch grows as T (a state per chunk), not as T D E (a state per step)."""
    sizes = []
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
# Written out (NNX float32 and float64, Linen) and decoding from its cache: the row's module tests above.
