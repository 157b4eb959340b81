"""The linear family's inputs at their edges (issue #43): per-example arrays, huge decays, dropped steps, scales.

Every result is checked against the float64 step-by-step loop (``tests/reference.py``) or a dense float64 form.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

T, D, E = 40, 8, 6


def _qkv(lead, seed=0, T=T, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((*lead, T, x)) for x in (D, D, E))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's keys are L2-normalised
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _per_example(B, seed=1):
    """Segment ids and a padding mask, one row per example: ``(B, T)`` each."""
    r = np.random.default_rng(seed)
    ids = jnp.asarray(np.cumsum(r.uniform(size=(B, T)) < 0.15, axis=-1), jnp.int32)
    keep = jnp.asarray(np.arange(T) < (T - 7 * np.arange(B))[:, None])  # example b has 7 b padded steps
    return ids, keep


# -- per-example arrays: batch first, as jattn.masks reads them ------------------------------------------------


@pytest.mark.parametrize("lead", [(2, 2), (2, 3), (3, 2)])  # B == N is where a per-head reading would hide
def test_per_example_ids_and_padding_are_read_batch_first(lead):
    """``(B, T)`` as ``masks.segment_ids`` reads it; written out per leading index (NumPy's reading) the same; both
    forms."""
    q, k, v = _qkv(lead)
    ids, keep = _per_example(lead[0])
    g = jnp.asarray(-np.random.default_rng(2).uniform(0, 1, (*lead, T)), jnp.float32)
    want, _ = ref.gated_linear(q, k, v, g=g, segment_ids=ids[:, None, :], kv_mask=keep[:, None, :])

    def both(q, k, v, g, ids, keep):
        out = []
        for mode in ("chunk", "recurrent"):
            read = jattn.gated_linear_attention(q, k, v, g=g, segment_ids=ids, kv_mask=keep, mode=mode, chunk_size=8)
            full = jattn.gated_linear_attention(
                q, k, v, g=g, segment_ids=jnp.broadcast_to(ids[:, None, :], (*lead, T)), kv_mask=keep[:, None, :],
                mode=mode, chunk_size=8,
            )  # fmt: skip
            out.append((read, full))
        return out

    for (out, full), mode in zip(jax.jit(both)(q, k, v, g, ids, keep), ("chunk", "recurrent"), strict=True):
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float32), err_msg=mode)
        np.testing.assert_allclose(full, out, **ref.tol(jnp.float32), err_msg=mode)


def test_the_gates_stay_per_head_from_the_right():
    """g ``(N, 1)`` is a constant per head (retention) beside a per-example ``(B, T)`` mask, with B == N."""
    q, k, v = _qkv((3, 3))
    ids, keep = _per_example(3)
    g = jnp.asarray(np.log(1 - 2.0 ** -np.arange(5, 8))[:, None], jnp.float32)  # (N, 1)
    out = jax.jit(
        lambda q, k, v, g, ids, keep: jattn.gated_linear_attention(
            q, k, v, g=g, segment_ids=ids, kv_mask=keep, chunk_size=8
        )
    )(q, k, v, g, ids, keep)
    want, _ = ref.gated_linear(q, k, v, g=g[None], segment_ids=ids[:, None, :], kv_mask=keep[:, None, :])
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))


def _dense_linear(q, k, v, keep):
    """Non-causal elu + 1 linear attention in float64 with a key mask ``keep (..., S)`` broadcast as NumPy does."""
    phi = lambda x: np.where(x > 0, x + 1, np.exp(x))  # noqa: E731
    a = phi(ref.f64(q)) @ np.swapaxes(phi(ref.f64(k)), -1, -2) * keep[..., None, :]
    return (a @ ref.f64(v)) / (a.sum(-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("lead", [(2, 2), (2, 3)])
def test_linear_attention_reads_a_per_example_kv_mask_batch_first(lead):
    q, k, v = _qkv(lead)
    _, keep = _per_example(lead[0])
    out = jax.jit(lambda q, k, v, keep: jattn.linear_attention(q, k, v, kv_mask=keep))(q, k, v, keep)
    np.testing.assert_allclose(out, _dense_linear(q, k, v, np.asarray(keep)[:, None, :]), **ref.tol(jnp.float32))


@pytest.mark.parametrize("call", ["gated", "linear"])
def test_a_per_example_array_that_fits_neither_reading_names_the_fix(call):
    """``(N, T)`` with B != N: read batch first it does not fit; the error says how to write one per head."""
    q, k, v = _qkv((2, 3))
    keep = jnp.ones((3, T), bool)
    f = jattn.gated_linear_attention if call == "gated" else jattn.linear_attention
    with pytest.raises(ValueError, match=r"kv_mask.*batch first.*kv_mask\[None\]"):
        f(q, k, v, kv_mask=keep)


@pytest.mark.parametrize(("name", "call"), [("segment_ids", "gated"), ("kv_mask", "gated"), ("kv_mask", "linear")])
def test_an_array_that_could_span_either_leading_axes_is_refused(name, call):
    """q ``(B, K, G, T, D)`` and ``(B, K, T)``: (B, K) or (K, G)? Refused, with the spelling of both readings."""
    q, k, v = _qkv((2, 3, 4))
    x = jnp.zeros((2, 3, T), jnp.int32) if name == "segment_ids" else jnp.ones((2, 3, T), bool)
    f = jattn.gated_linear_attention if call == "gated" else jattn.linear_attention
    with pytest.raises(ValueError, match=rf"{name} \(2, 3, 40\).*ambiguous.*\(2, 3, 1, 40\).*\[:, :, None, :\]"):
        f(q, k, v, **{name: x})


# -- huge log decays: the chunk form exact to float32 rounding ------------------------------------------------


BIG = [-1e3, -1e4, -1e7, -3e38]


def _big_gates(big, gate, beta, lead=(2, 3), seed=4):
    """Log decays of -0.01..-0.3 with ``big`` at a few steps, and beta.

    ``big`` inside a chunk of 8, twice in one (two of -3e38 overflow their sum to -inf), and at a chunk's start.
    """
    r = np.random.default_rng(seed)
    shape = (*lead, T, D) if gate == "gk" else (*lead, T)
    x = -r.uniform(0.01, 0.3, shape)
    x[0, 1, 5], x[0, 1, 7], x[1, 0, 16], x[1, 2, 21] = big, big, big, big
    kw = {gate: jnp.asarray(x, jnp.float32)}
    if beta:
        kw["beta"] = jnp.asarray(r.uniform(0.1, 0.9, (*lead, T)), jnp.float32)
    return kw


@jax.jit
def _chunks_of_8(q, k, v, kw):
    """The chunk form (chunks of 8) with its state, compiled once for each set of gates (the decays are data)."""
    return jattn.gated_linear_attention(q, k, v, **kw, return_state=True, chunk_size=8)


@pytest.mark.parametrize(("gate", "beta"), [("g", False), ("g", True), ("gk", False)])
@pytest.mark.parametrize("big", BIG)
def test_the_chunk_form_is_exact_after_a_huge_log_decay(big, gate, beta):
    q, k, v = _qkv((2, 3))
    kw = _big_gates(big, gate, beta)
    out, state = _chunks_of_8(q, k, v, kw)
    want, want_state = ref.gated_linear(q, k, v, **kw)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(state))
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(state, want_state, **ref.tol(jnp.float32))


@jax.jit
def _weighted_grad(args, w):
    """The gradient of ``Σ w·out`` of the chunk form (chunks of 8), compiled once for each set of gates."""
    return jax.grad(lambda a: jnp.sum(w * jattn.gated_linear_attention(**a, chunk_size=8)))(args)


@pytest.mark.parametrize(("gate", "beta"), [("g", False), ("g", True), ("gk", False)])
@pytest.mark.parametrize("big", [-1e7, -3e38])
def test_gradients_after_a_huge_log_decay_equal_the_float64_loops(big, gate, beta):
    """float32 chunk-form gradients of every input against central differences of the float64 NumPy loop."""
    q, k, v = _qkv((2, 3))
    args = {"q": q, "k": k, "v": v} | _big_gates(big, gate, beta)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, T, E)), jnp.float32)
    grads = _weighted_grad(args, w)
    r = np.random.default_rng(6)
    for name, x in args.items():
        assert np.all(np.isfinite(grads[name])), name
        u = r.standard_normal(x.shape) * (0.01 if name in ("g", "gk", "beta") else 1.0)
        eps = 1e-6

        def loss64(sign, name=name, u=u, eps=eps):
            moved = {n: ref.f64(a) + (sign * eps * u if n == name else 0) for n, a in args.items()}
            with jax.enable_x64(True):  # the loop's inputs stay float64
                return np.sum(ref.f64(w) * ref.gated_linear(**moved)[0])

        numeric = (loss64(1) - loss64(-1)) / (2 * eps)
        size = np.sum(np.abs(ref.f64(grads[name]) * u))  # the sum's own scale: float32 rounding is relative to it
        np.testing.assert_allclose(
            np.sum(ref.f64(grads[name]) * u), numeric, rtol=0, atol=ref.tol(jnp.float32)["rtol"] * size
        )


# -- a dropped step's gates are not read, eager or traced -------------------------------------------------------


@jax.jit
def _masked(q, k, v, kw, keep):
    return jattn.gated_linear_attention(q, k, v, **kw, kv_mask=keep)


@pytest.mark.parametrize(("name", "bad"), [("g", 0.5), ("g", np.nan), ("gk", np.inf), ("beta", 2.0), ("beta", np.nan)])
def test_bad_gates_at_dropped_steps_are_ignored_eagerly_and_under_jit(name, bad):
    q, k, v = _qkv((2, 3))
    _, keep = _per_example(2)  # example 1 drops its last 7 steps
    r = np.random.default_rng(7)
    kw = {"g": -r.uniform(0, 1, (2, 3, T))} | (
        {"gk": -r.uniform(0, 1, (2, 3, T, D))} if name == "gk" else {"beta": r.uniform(0.1, 0.9, (2, 3, T))}
    )
    if name == "gk":
        del kw["g"]
    want, _ = ref.gated_linear(q, k, v, **kw, kv_mask=keep[:, None, :])  # the loop never reads a dropped step
    kw[name][1, :, T - 3] = bad  # dropped: example 1's steps from T - 7 on
    kw = {n: jnp.asarray(x, jnp.float32) for n, x in kw.items()}
    eager = jattn.gated_linear_attention(q, k, v, **kw, kv_mask=keep)  # op by op, on purpose
    traced = _masked(q, k, v, kw, keep)
    np.testing.assert_allclose(eager, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(traced, eager, **ref.tol(jnp.float32))


def test_bad_gates_at_kept_steps_still_raise_eagerly_and_poison_under_jit():
    q, k, v = _qkv((2, 3))
    _, keep = _per_example(2)
    g = np.full((2, 3, T), -0.1, np.float32)
    g[1, 2, 5] = 0.5  # kept
    with pytest.raises(ValueError, match=r"g is a log decay.*0\.5"):
        jattn.gated_linear_attention(q, k, v, g=jnp.asarray(g), kv_mask=keep)
    out = jax.jit(lambda g: jattn.gated_linear_attention(q, k, v, g=g, kv_mask=keep))(jnp.asarray(g))
    bad = np.zeros((2, 3), bool)
    bad[1, 2] = True
    assert np.all(np.isnan(out[bad])) and np.all(np.isfinite(out[~bad]))


# -- scale ----------------------------------------------------------------------------------------------------


@jax.jit
def _scaled(q, k, v, g, scale):
    return jattn.gated_linear_attention(q, k, v, g=g, scale=scale)


@pytest.mark.parametrize("scale", [1 / jnp.sqrt(2.0), jnp.asarray(0.3, jnp.bfloat16), np.asarray(-1.5)])
def test_array_scales_are_taken_eagerly_and_traced(scale):
    q, k, v = _qkv((2, 3))
    g = jnp.full((T,), -0.2)
    want, _ = ref.gated_linear(q, k, v, g=g, scale=float(scale))
    np.testing.assert_allclose(jattn.gated_linear_attention(q, k, v, g=g, scale=scale), want, **ref.tol(jnp.float32))
    traced = _scaled(q, k, v, g, jnp.asarray(scale, jnp.float32))
    np.testing.assert_allclose(traced, want, **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        (float("nan"), ValueError, r"^scale must be a finite number, got nan$"),
        (jnp.asarray(jnp.inf), ValueError, r"^scale must be a finite number, got inf$"),
        (jnp.ones(2), ValueError, r"scale must be a scalar .*shape \(2,\)"),
        ("1", TypeError, r"scale must be a real number or a 0-d float array, got '1'"),
    ],
)
def test_bad_scales_are_named(scale, error, match):
    q, k, v = _qkv((2, 3))
    with pytest.raises(error, match=match):
        jattn.gated_linear_attention(q, k, v, scale=scale)


# -- the delta rule's keys ------------------------------------------------------------------------------------


def test_long_delta_rule_keys_overflow_as_documented():
    """With β‖k‖² > 2 the state grows each step and turns non-finite unchecked; the docs say so and name the fix."""
    q, k, v = _qkv((1, 2), T=256)  # ‖k‖ = 1
    beta = jnp.ones((1, 2, 256))

    def forms(q, k, v, beta):  # per form: unit keys, then keys of length 4 (β‖k‖² = 16)
        return [
            [jattn.gated_linear_attention(q, x, v, beta=beta, mode=m) for x in (k, 4 * k)]
            for m in ("chunk", "recurrent")
        ]

    want = ref.gated_linear(q, k, v, beta=beta)[0]
    for short, long in jax.jit(forms)(q, k, v, beta):
        np.testing.assert_allclose(short, want, **ref.tol(jnp.float32))
        assert not np.all(np.isfinite(long))
    doc = " ".join(jattn.gated_linear_attention.__doc__.split())
    assert "β ‖k‖² > 2" in doc and "L2-normalised keys" in doc and "NaN" in doc
    guide = " ".join((Path(__file__).parents[1] / "docs/guide/linear.md").read_text().split())
    assert "The delta rule needs short keys" in guide and "L2-normalise k over D" in guide
