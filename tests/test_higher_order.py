"""Forward mode and second order on the blockwise path, against a float64 dense reference differentiated by JAX.

Every case runs on several tiles (``block_size=(8, 8)``, odd sizes that pad both axes): jvp, linearize,
jacfwd, grad of grad, both Hessian-vector products and the hessian, each compared with JAX's own
derivative of :func:`tests.reference.dense_jax` (float64, written from the definition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks, score_mods
from tests.reference import assert_grad_close, dense_jax, f64, tol


@pytest.fixture(autouse=True)
def _x64():
    """float64 for the reference (and the float64 cases) in this module's tests only."""
    with jax.enable_x64(True):
        yield


B, N, T, S, D, E = 2, 3, 13, 11, 5, 7  # odd, distinct: a swapped axis fails loudly
BLOCK = (8, 8)  # several tiles, both axes padded


def _positions(t: int, s: int):
    """Query positions (bottom-right aligned, as jattn's default) ``(t, 1)`` and key positions ``(1, s)``."""
    return (s - t + np.arange(t))[:, None], np.arange(s)[None, :]


def _case(name: str, rng) -> dict:
    """``shapes``, jattn's keyword arguments, the reference's, and the name of a differentiable extra (bias, sinks)."""
    shapes = ((B, N, T, D), (B, N, S, D), (B, N, S, E))
    qp, kp = _positions(T, S)
    c = dict(shapes=shapes, kw={}, ref={}, extra=None)
    if name == "causal":  # T > S: the first two rows see no key (tangents exactly 0)
        c.update(kw=dict(mask=masks.causal()), ref=dict(keep=kp <= qp))
    elif name == "window":
        c.update(kw=dict(mask=masks.sliding_window(3)), ref=dict(keep=(kp <= qp) & (kp >= qp - 3)))
    elif name == "padding":
        lengths = np.array([S, 4])
        keep = np.arange(S)[None, None, None, :] < lengths[:, None, None, None]
        c.update(kw=dict(mask=masks.padding(kv_lengths=lengths)), ref=dict(keep=keep))
    elif name == "segments&causal":
        q_ids, kv_ids = (
            np.repeat([[0, 1, 2], [1, 1, 3]], [5, 4, 4], axis=1),
            np.repeat([[0, 1, 2], [1, 2, 3]], [3, 4, 4], 1),
        )
        keep = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None] & (kp <= qp)
        c.update(kw=dict(mask=masks.segment_ids(q_ids, kv_ids) & masks.causal()), ref=dict(keep=keep))
    elif name == "bias":
        c.update(extra=("bias", (B, 1, T, S)))
    elif name == "sinks":
        c.update(kw=dict(mask=masks.causal()), ref=dict(keep=kp <= qp), extra=("sinks", (N,)))
    elif name == "softcap":
        c.update(kw=dict(score_mod=score_mods.softcap(2.0)), ref=dict(softcap=2.0))
    elif name == "gqa":
        c.update(shapes=((B, 2, 3, T, D), (B, 2, 1, S, D), (B, 2, 1, S, E)))
    elif name == "cross":  # T < S, causal
        qp, kp = _positions(7, 19)
        c.update(
            shapes=((B, N, 7, D), (B, N, 19, D), (B, N, 19, E)), kw=dict(mask=masks.causal()), ref=dict(keep=kp <= qp)
        )
    return c


CASES = ["none", "causal", "window", "padding", "segments&causal", "bias", "sinks", "softcap", "gqa", "cross"]


def _setup(name: str, dtype=jnp.float64, seed: int = 0):
    """The jattn function, the reference, the arguments and a tangent for each (all of ``dtype``)."""
    rng = np.random.default_rng(seed)
    c = _case(name, rng)
    shapes = list(c["shapes"]) + ([c["extra"][1]] if c["extra"] else [])
    args = tuple(jnp.asarray(rng.normal(size=s), dtype) for s in shapes)
    tangents = tuple(jnp.asarray(rng.normal(size=s), dtype) for s in shapes)
    key = None if c["extra"] is None else c["extra"][0]

    def ours(q, k, v, *extra):
        kw = dict(c["kw"], **({key: extra[0]} if key else {}))
        return jattn.attention(q, k, v, implementation="blockwise", block_size=BLOCK, return_lse=True, **kw)

    def ref(q, k, v, *extra):
        return dense_jax(q, k, v, **c["ref"], **({key: extra[0]} if key else {}))

    return ours, ref, args, tangents


def _loss(f):
    """A scalar that reads both outputs, finite on rows with no key (their lse is -inf, with derivative 0)."""

    def loss(*args):
        out, lse = f(*args)
        lse = jnp.where(jnp.isfinite(lse), lse, jnp.zeros_like(lse))
        return jnp.sum(jnp.sin(out.astype(jnp.float64))) + 0.5 * jnp.sum(lse.astype(jnp.float64) ** 2)

    return loss


def _all(args) -> tuple[int, ...]:
    return tuple(range(len(args)))


TRANSFORMS = {
    "jvp": lambda f, a, t: jax.jvp(f, a, t),
    "linearize": lambda f, a, t: jax.linearize(f, *a)[1](*t),
    "jacfwd": lambda f, a, t: jax.jacfwd(lambda q: f(q, *a[1:])[0])(a[0]),
    "grad_of_grad": lambda f, a, t: jax.grad(
        lambda *a: sum(jnp.sum(g**2) for g in jax.grad(_loss(f), _all(a))(*a)), _all(a)
    )(*a),
    "hvp_forward_over_reverse": lambda f, a, t: jax.jvp(jax.grad(_loss(f), _all(a)), a, t)[1],
    "hvp_reverse_over_reverse": lambda f, a, t: jax.grad(
        lambda *a: sum(jnp.vdot(g, u) for g, u in zip(jax.grad(_loss(f), _all(a))(*a), t, strict=True)), _all(a)
    )(*a),
    "hessian": lambda f, a, t: jax.hessian(lambda k: _loss(f)(a[0], k, *a[2:]))(a[1]),
}


def _close(got, want, dtype=jnp.float64) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = f64(g), f64(w)
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))  # the lse of a row with no key
        assert_grad_close(np.where(np.isneginf(g), 0, g), np.where(np.isneginf(w), 0, w), dtype)


#: jvp, grad of grad and the forward-over-reverse HVP on every case; linearize (jvp's rule again, partially
#: evaluated), the reverse-over-reverse HVP (grad of grad's path) and the full Jacobian and Hessian on three
#: (CI time: each cell compiles its own second-order program).
EVERY = ("jvp", "grad_of_grad", "hvp_forward_over_reverse")
CELLS = [(c, t) for t in TRANSFORMS for c in CASES if t in EVERY or c in ("causal", "sinks", "gqa")]


@pytest.mark.parametrize(("case", "transform"), CELLS)
def test_transform_equals_the_reference(case, transform):
    ours, ref, args, tangents = _setup(case)
    run = jax.jit(TRANSFORMS[transform], static_argnums=0)  # one program a cell: eager, each operation compiles alone
    _close(run(ours, args, tangents), run(ref, args, tangents))


def test_rows_with_no_key_have_exactly_zero_tangents():
    ours, _, args, tangents = _setup("causal")  # T = 13 > S = 11: query rows 0 and 1 see no key
    (out, lse), (d_out, d_lse) = jax.jit(lambda a, t: jax.jvp(ours, a, t))(args, tangents)
    assert np.all(np.asarray(out[..., :2, :]) == 0) and np.all(np.isneginf(np.asarray(lse[..., :2])))
    assert np.all(np.asarray(d_out[..., :2, :]) == 0) and np.all(np.asarray(d_lse[..., :2]) == 0)
    hvp = jax.jit(TRANSFORMS["hvp_forward_over_reverse"], static_argnums=0)(ours, args, tangents)
    assert np.all(np.isfinite(np.asarray(hvp[0])))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jvp_of_low_precision_inputs_equals_the_reference_of_the_rounded_inputs(dtype):
    ours, ref, args, tangents = _setup("causal", dtype)
    (out, lse), (d_out, d_lse) = jax.jit(lambda a, t: jax.jvp(ours, a, t))(args, tangents)
    assert out.dtype == d_out.dtype == dtype and lse.dtype == d_lse.dtype == jnp.float32
    up = tuple(x.astype(jnp.float64) for x in args), tuple(x.astype(jnp.float64) for x in tangents)
    _, (want_out, want_lse) = jax.jit(lambda a, t: jax.jvp(ref, a, t))(*up)
    assert_grad_close(d_out, want_out, dtype)
    assert_grad_close(d_lse, jnp.where(jnp.isfinite(want_lse), want_lse, 0), dtype)


def test_first_order_reverse_mode_runs_the_flash_backward_not_a_transposed_sweep():
    """grad's program holds the hand-written backward (one primitive pair), not JAX's transpose of the tangent."""
    ours, _, args, _ = _setup("causal", jnp.float32)
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss(ours), (0, 1, 2)))(*args))
    assert "jattn_blockwise_cotangent" in jaxpr and "jattn_blockwise_tangent" not in jaxpr


@pytest.mark.parametrize("fused", [True, False])
def test_the_fused_cpu_forward_under_jvp_and_hvp(monkeypatch, fused):
    """The automatic choice (which takes the fused CPU forward where built) under jvp and an HVP."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, 300, 16)), jnp.float32) for _ in range(3))
    t = tuple(jnp.asarray(rng.normal(size=q.shape), jnp.float32) for _ in range(3))

    def ours(q, k, v):
        return jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise", return_lse=True)

    if not fused:
        monkeypatch.setenv("JATTN_FUSED_CPU", "0")
    took = "jattn_fused_forward" in str(jax.make_jaxpr(ours)(q, k, v))
    if fused and not took:
        pytest.skip(
            "the fused CPU forward is not built here (it needs a CPU backend, g++ and AVX-512, AVX2 + FMA or NEON)"
        )
    assert took == fused
    ref = functools.partial(dense_jax, keep=np.tril(np.ones((300, 300), bool)))
    up = lambda xs: tuple(x.astype(jnp.float64) for x in xs)  # noqa: E731
    jvp = jax.jit(jax.jvp, static_argnums=0)  # each function its own program: values and tangents
    (_, (d_out, _)), (_, (want, _)) = jvp(ours, (q, k, v), t), jvp(ref, up((q, k, v)), up(t))
    assert_grad_close(d_out, want, jnp.float32)
    hvp = jax.jit(TRANSFORMS["hvp_forward_over_reverse"], static_argnums=0)
    got, want = hvp(ours, (q, k, v), t), hvp(ref, up((q, k, v)), up(t))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(
            f64(g), f64(w), atol=1e-3 * (1 + np.max(np.abs(f64(w)))), rtol=tol(jnp.float32)["rtol"]
        )


#: (heads N, tangents n, T): the float32 cases of issue #43, wrong under jit on jaxlib 0.10.2 without
#: jattn's XLA flag where n·N·T·T passes one YNNPACK block (jattn/_xla_flags.py), and others around them.
HVP_SWEEP = [(2, 128, 16), (4, 64, 16), (8, 32, 16), (2, 128, 32), (2, 65, 16), (1, 256, 16), (3, 50, 24)]


@pytest.mark.parametrize(("heads", "n", "t"), HVP_SWEEP)
def test_jit_of_batched_hvps_equals_the_float64_reference(heads, n, t):
    """jit(vmap) of n forward-over-reverse HVPs of a float32 causal loss (jax.hessian's shape), every path's.

    Blockwise at its default tiles (a tile holds every row of the call: the folded n·N rows make the
    wrong fusion of the issue) and dense, one program, against JAX's float64 derivative of the reference.
    """
    rng = np.random.default_rng(heads * 1000 + n + t)
    q, k, v = (jnp.asarray(rng.normal(size=(1, heads, t, 4)), jnp.float32) for _ in range(3))
    basis = jnp.asarray(rng.normal(size=(n, 1, heads, t, 4)), jnp.float32)
    keep = np.arange(t)[None, :] <= np.arange(t)[:, None]

    def hvps(f):
        loss = lambda q: jnp.sum(jnp.sin(f(q)))  # noqa: E731
        return jax.vmap(lambda u: jax.jvp(jax.grad(loss), (q,), (u,))[1])(basis)

    paths = jax.jit(lambda: [hvps(lambda q, i=i: jattn.attention(q, k, v, mask=masks.causal(), implementation=i))
                             for i in ("blockwise", "dense")])()  # fmt: skip
    # the reference under jit too: XLA:CPU's YNNPACK miscompile is float32's (float64 is right without the flag)
    want = jax.jit(lambda: hvps(lambda q: dense_jax(q, k, v, keep=keep)[0]))()
    for got in paths:
        assert_grad_close(f64(got), f64(want), jnp.float32)


def test_jit_of_the_hessian_equals_the_float64_reference():
    """``jax.jit(jax.hessian(...))`` of issue #43's loss (q ``(1, 2, 16, 4)``, causal): 0.68 off before the flag."""
    rng = np.random.default_rng(43)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, 16, 4)), jnp.float32) for _ in range(3))
    keep = np.arange(16)[None, :] <= np.arange(16)[:, None]
    loss = lambda f: lambda q: jnp.sum(jnp.sin(f(q)))  # noqa: E731
    # the reference under jit too: XLA:CPU's YNNPACK miscompile is float32's (float64 is right without the flag)
    want = jax.jit(jax.hessian(loss(lambda q: dense_jax(q, k, v, keep=keep)[0])))(q)
    for path in ("blockwise", "dense"):
        got = jax.jit(
            jax.hessian(loss(lambda q, p=path: jattn.attention(q, k, v, mask=masks.causal(), implementation=p)))
        )(q)
        assert_grad_close(f64(got), f64(want), jnp.float32)
