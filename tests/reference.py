"""Independent float64 NumPy references, the one tolerance table, and the helpers tests share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from jattn import masks

if TYPE_CHECKING:
    import jattn.nnx

# Tolerances against the float64 reference, keyed by the input dtype. Low-precision inputs are
# compared after rounding the inputs, so the error left is the rounding of the weights fed to
# the value matmul and of the output.
TOL = {
    jnp.dtype(jnp.float64): dict(atol=1e-12, rtol=1e-12),
    jnp.dtype(jnp.float32): dict(atol=2e-6, rtol=2e-5),
    jnp.dtype(jnp.float16): dict(atol=3e-3, rtol=3e-3),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
}


def tol(dtype) -> dict:
    return TOL[jnp.dtype(dtype)]


def f64(x) -> np.ndarray:
    """Any float array (bfloat16 included) as a float64 NumPy array, exactly."""
    x = jnp.asarray(x)
    return np.asarray(x if x.dtype == jnp.float64 else x.astype(jnp.float32), np.float64)


def softmax(x, where=None, sink=None):
    """Row softmax over the last axis; rows with nothing kept are all zeros.

    ``sink`` (broadcastable to ``x.shape[:-1]``) adds ``exp(sink)`` to each row's denominator.
    Returns the weights, the log-sum-exp (sink included) and each row's sink weight.
    """
    x = np.asarray(x, np.float64)
    where = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
    sink = None if sink is None else np.broadcast_to(np.asarray(sink, np.float64), x.shape[:-1])
    out = np.zeros_like(x)
    lse = np.full(x.shape[:-1], -np.inf)
    sink_w = np.zeros(x.shape[:-1])
    for idx in np.ndindex(*x.shape[:-1]):
        keep = where[idx]
        row = x[idx][keep]
        if sink is not None:
            row = np.append(row, sink[idx])
        if row.size:
            m = row.max()
            e = np.exp(row - m)
            out[idx][keep] = e[: keep.sum()] / e.sum()
            lse[idx] = m + np.log(e.sum())
            sink_w[idx] = 0.0 if sink is None else e[-1] / e.sum()
    return out, lse, sink_w


def lead_indices(lead):
    """``batch`` and ``head`` of every leading index, each of shape ``lead + (1, 1)``: batch is the
    first leading axis, head the index into the rest counted row-major."""
    lead = tuple(lead)
    batch = np.zeros(lead, np.int64)
    head = np.zeros(lead, np.int64)
    for idx in np.ndindex(*lead):
        if idx:
            batch[idx] = idx[0]
            h = 0
            for i, n in zip(idx[1:], lead[1:], strict=True):
                h = h * n + i
            head[idx] = h
    return batch[..., None, None], head[..., None, None]


def scores(q, k, mask=None, bias=None, scale=None, score_mod=None, q_offset=None, kv_offset=0, lead=None):
    """The modified scaled scores ``(..., T, S)`` in float64 and the broadcast mask (or None).

    ``score_mod(score, batch, head, q_pos, kv_pos)`` gets NumPy arrays: the whole score, the
    indices of :func:`lead_indices` and absolute positions ``q_pos (T, 1)``, ``kv_pos (1, S)``
    (``q_offset`` defaults to ``S - T + kv_offset``). ``lead`` is the leading shape to broadcast to.
    """
    q, k = f64(q), f64(k)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    shape = s.shape if mask is None else np.broadcast_shapes(s.shape, np.shape(mask))
    if lead is not None:
        shape = np.broadcast_shapes(shape, (*lead, 1, 1))
    s = np.broadcast_to(s, shape)
    if score_mod is not None:
        T, S = s.shape[-2:]
        q_offset = S - T + kv_offset if q_offset is None else q_offset
        q_pos = (q_offset + np.arange(T))[:, None]
        kv_pos = (kv_offset + np.arange(S))[None, :]
        s = np.broadcast_to(score_mod(s, *lead_indices(s.shape[:-2]), q_pos, kv_pos), shape).astype(np.float64)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), shape)
    return s, mask


def attention(q, k, v, mask=None, bias=None, scale=None, score_mod=None, sinks=None, q_offset=None, stats=False):
    """Dense attention in float64: returns (out (..., T, E), weights (..., T, S), lse (..., T)).

    ``score_mod`` as in :func:`scores`; ``sinks`` broadcastable to the leading shape. ``stats``
    adds the row max logit over kept entries (``-inf`` for an empty row).
    """
    v = f64(v)
    lead = np.broadcast_shapes(np.shape(q)[:-2], np.shape(k)[:-2], v.shape[:-2])
    if sinks is not None:
        lead = np.broadcast_shapes(lead, np.shape(sinks))
    s, mask = scores(q, k, mask, bias, scale, score_mod, q_offset, lead=lead if sinks is not None else None)
    sink = None if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64), s.shape[:-2])[..., None]
    w, lse, _ = softmax(s, mask, sink)
    out = np.matmul(w, v)
    lse = np.broadcast_to(lse, out.shape[:-1])
    if not stats:
        return out, w, lse
    top = np.max(np.where(np.ones(s.shape, bool) if mask is None else mask, s, -np.inf), -1)
    return out, w, lse, np.broadcast_to(top, out.shape[:-1])


def article_self_attention(x, wq, wk, wv):
    """The article's module: x (B, T, d) with kernels (d, d_k) -> (B, T, d_k)."""
    x = np.asarray(x, np.float64)
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(wq.shape[1])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def attention_grads(q, k, v, dout, mask=None, bias=None, scale=None, sinks=None, softcap=None, drop=None):
    """Float64 gradients of ``sum(attention(...) * dout)``: returns (dq, dk, dv, dbias), each reduced
    back to its input's (broadcast) shape; dbias is None without a bias. With ``sinks`` a fifth,
    dsinks, in the shape of ``sinks``. ``softcap=c`` caps the scores as ``c · tanh(x / c)``.

    The softmax backward by hand: dP = dO Vᵀ, dS = P ∘ (dP - rowsum(P ∘ dP)), dQ = dS K · scale,
    dK = dSᵀ Q · scale, dV = Pᵀ dO, dbias = dS; a sink is one more softmax entry with dP = 0, so
    d sink = -Σ_t P_sink,t · rowsum(P ∘ dP)_t; a soft cap multiplies dS by 1 - tanh²(x / c).
    ``drop`` (broadcastable to the weights, without sinks) is a materialised dropout factor Z (0 or
    1 / keep_prob) on the weights, out = (P ∘ Z) V: then dP = (dO Vᵀ) ∘ Z and dV = (P ∘ Z)ᵀ dO.
    """
    cap = None if softcap is None else (lambda x, *_: softcap * np.tanh(x / softcap))
    _, w, _ = attention(q, k, v, mask, bias, scale, score_mod=cap, sinks=sinks)
    if sinks is not None:
        s, m = scores(q, k, mask, bias, scale, score_mod=cap, lead=w.shape[:-2])
        _, _, w_sink = softmax(s, m, np.broadcast_to(np.asarray(sinks, np.float64), s.shape[:-2])[..., None])
        dp_rows = np.sum(w * np.matmul(np.asarray(dout, np.float64), np.swapaxes(f64(v), -1, -2)), -1)
        dsinks = unbroadcast(np.sum(-w_sink * dp_rows, -1), np.shape(sinks))
    q, k, v, dout = f64(q), f64(k), f64(v), np.asarray(dout, np.float64)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    dp = np.matmul(dout, np.swapaxes(v, -1, -2))
    if drop is not None:
        dp = dp * np.asarray(drop, np.float64)
    ds = w * (dp - np.sum(w * dp, -1, keepdims=True))
    if softcap is not None:  # the chain rule through c · tanh(x / c), x the uncapped score
        x, _ = scores(q, k, None, bias, scale)
        ds = ds * (1.0 - np.tanh(x / softcap) ** 2)
    dq = np.matmul(ds, k) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * scale
    dv = np.matmul(np.swapaxes(w if drop is None else w * np.asarray(drop, np.float64), -1, -2), dout)
    return (
        unbroadcast(dq, q.shape),
        unbroadcast(dk, k.shape),
        unbroadcast(dv, v.shape),
        None if bias is None else unbroadcast(ds, np.shape(bias)),
    ) + ((dsinks,) if sinks is not None else ())


def lse_grads(q, k, dlse, mask=None, bias=None, scale=None, sinks=None):
    """Float64 gradients of ``sum(lse · dlse)``: (dq, dk, dbias) and with ``sinks`` a fourth, dsinks.

    ``d lse_t / d x_ts = P_ts``, the softmax weight (sinks included in its denominator), so dS =
    P ∘ dlse, dQ = dS K · scale, dK = dSᵀ Q · scale, dbias = dS; a sink's weight P_sink,t gives
    d sink = Σ_t P_sink,t · dlse_t. A row with no key and no sink has lse -inf and no gradient.
    """
    lead = None if sinks is None else np.broadcast_shapes(np.shape(q)[:-2], np.shape(k)[:-2], np.shape(sinks))
    s, m = scores(q, k, mask, bias, scale, lead=lead)
    sink = None if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64), s.shape[:-2])[..., None]
    w, lse, w_sink = softmax(s, m, sink)
    g = np.where(
        np.isneginf(np.broadcast_to(lse, s.shape[:-1])),
        0.0,
        np.broadcast_to(np.asarray(dlse, np.float64), s.shape[:-1]),
    )
    ds = w * g[..., None]
    q, k = f64(q), f64(k)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    grads = (
        unbroadcast(np.matmul(ds, k) * scale, q.shape),
        unbroadcast(np.matmul(np.swapaxes(ds, -1, -2), q) * scale, k.shape),
        None if bias is None else unbroadcast(ds, np.shape(bias)),
    )
    return grads if sinks is None else (*grads, unbroadcast(np.sum(w_sink * g, -1), np.shape(sinks)))


def unbroadcast(x, shape):
    """Sums ``x`` over the axes that broadcasting added to ``shape``."""
    x = np.sum(x, axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return np.sum(x, axis=axes, keepdims=True) if axes else x


def assert_grad_close(got, want, dtype, scale=0.0):
    """Gradients against the float64 reference with the dtype's tolerance, relative to the gradient's size.

    Low-precision gradients are rounded once at the end, so the error scales with the largest
    entry; ``scale`` adds the float32 arithmetic noise of the problem (|dO|·|v|·|k|·scale·S) for
    inputs of extreme magnitude.
    """
    got, want = f64(got), np.asarray(want, np.float64)
    t = tol(dtype)
    atol = t["atol"] * (1 + np.max(np.abs(want), initial=0.0)) + 64 * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(got, want, rtol=t["rtol"], atol=atol)


def rope(x, positions, base=10000.0):
    """Rotary embedding in float64, rotate-half pairs (i, i + D/2), one position per row of x (..., D)."""
    x = f64(x)
    half = x.shape[-1] // 2
    pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:-1])
    a = pos[..., None] * base ** (-2.0 * np.arange(half) / x.shape[-1])  # (..., D/2) angles
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], axis=-1)


# -- shared helpers ---------------------------------------------------------------------------------


@st.composite
def static_masks(draw, depth=2):
    leaves = [
        st.just(masks.causal()),
        st.builds(masks.sliding_window, st.integers(0, 6), st.integers(0, 6)),
        st.builds(masks.chunked, st.integers(1, 7)),
        st.builds(masks.prefix_lm, st.integers(0, 9)),
        st.lists(st.integers(0, 20), min_size=1, max_size=3).map(masks.global_tokens),
    ]
    m = draw(st.one_of(leaves))
    for _ in range(draw(st.integers(0, depth))):
        other = draw(st.one_of(leaves))
        op = draw(st.sampled_from(["and", "or", "not"]))
        m = m & other if op == "and" else m | other if op == "or" else ~m
    return m


def linen_params(m: jattn.nnx.SelfAttention) -> dict:
    """The NNX module's weights as the Linen module's ``params`` (same names)."""
    params = {}
    for name in ("wq", "wk", "wv", "wo"):
        layer = getattr(m, name)
        if layer is not None:
            params[name] = {"kernel": layer.kernel[...]} | ({} if layer.bias is None else {"bias": layer.bias[...]})
    return params | {name: getattr(m, name)[...] for name in m.gate_names}  # a recurrent kind's gates


def dense_jax(q, k, v, keep=None, bias=None, sinks=None, softcap=None, drop=None):
    """Dense attention in float64 JAX, differentiable by JAX at every order: ``(out (..., T, E), lse (..., T))``.

    ``keep`` a boolean mask broadcastable to ``(..., T, S)``; ``sinks`` broadcastable to the leading
    shape; ``softcap`` caps the scaled scores as ``cap · tanh(s / cap)``. A row with no key (and no
    sink) gives 0 and lse ``-inf``, and its derivatives are 0. ``drop``: dropout's factor on each weight
    (``(..., T, S)``: ``1 / keep_prob`` or 0), after the softmax. Written from the definition, sharing no
    code with jattn, so that JAX's own differentiation of it is the reference for every order.
    """
    q, k, v = (jnp.asarray(x, wide()) for x in (q, k, v))
    s = jnp.einsum("...td,...sd->...ts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + jnp.asarray(bias, wide())
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    keep = jnp.ones(s.shape, bool) if keep is None else jnp.broadcast_to(jnp.asarray(keep), s.shape)
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, -1)
    sink = None if sinks is None else jnp.broadcast_to(jnp.asarray(sinks, wide()), m.shape[:-1])[..., None]
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(keep, jnp.exp(s - m[..., None]), 0.0)
    den = e.sum(-1) + (0.0 if sink is None else jnp.exp(sink - m))
    safe = jnp.where(den > 0, den, 1.0)
    w = e / safe[..., None] if drop is None else e / safe[..., None] * jnp.asarray(drop, wide())
    out = jnp.einsum("...ts,...se->...te", w, v)
    return out, jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def kernel_jaxpr(eqn):
    """The jaxpr of ``eqn``'s program where its primitive carries it as an implementation, not a sub-jaxpr; else None.

    jattn's blockwise derivatives are two such primitives (``jattn_blockwise_tangent`` and ``..._cotangent``):
    a test that inspects the tiles or loops of a backward reads their implementation's jaxpr, traced here
    at the equation's input types.
    """
    if not eqn.primitive.name.startswith("jattn_"):
        return None
    avals = [v.aval for v in eqn.invars]
    return jax.make_jaxpr(lambda *a: eqn.primitive.impl(*a, **eqn.params))(*avals).jaxpr


def program_text(fn, *args) -> str:
    """``fn``'s jaxpr as text, followed by the jaxprs of its jattn derivative primitives (:func:`kernel_jaxpr`)."""
    closed = jax.make_jaxpr(fn)(*args)
    return "\n".join([str(closed), *(str(j) for j in _kernels(closed.jaxpr))])


def _kernels(jaxpr):
    """:func:`kernel_jaxpr` of every equation of ``jaxpr`` and of the jaxprs nested in it."""
    for e in jaxpr.eqns:
        inner = kernel_jaxpr(e)
        if inner is not None:
            yield inner
        for p in e.params.values():
            for x in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(x, "eqns") or hasattr(x, "jaxpr"):
                    yield from _kernels(getattr(x, "jaxpr", x))


def wide():
    """float64 where x64 is on (the references), else float32 (where a test turns it off)."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def transform_loss(f):
    """A scalar of ``f``'s output: ``sum(sin(out))`` in the widest float enabled."""
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(wide())))


def _hvp_rev(f, a, t):
    return jax.grad(
        lambda *a: sum(jnp.vdot(g, u) for g, u in zip(jax.grad(transform_loss(f), (0, 1, 2))(*a), t, strict=True)),
        (0, 1, 2),
    )(*a)


#: What each row of jattn.TRANSFORMS runs on ``f(q, k, v)`` (most rows; tests/test_transforms.py):
def _grad_of_jvp(f, a, t) -> tuple:
    """The gradient in q of a loss through ``jax.jvp`` (consistency-model training), plain and under ``jax.checkpoint``."""

    def loss(q):
        return sum(jnp.sum(x**2) for x in jax.tree.leaves(jax.jvp(f, (q, *a[1:]), t)[1]))

    return jax.grad(loss)(a[0]), jax.grad(jax.checkpoint(loss))(a[0])


TRANSFORM_RUNS = {  # transformation -> (f, args, tangents) -> a pytree to compare with the reference's
    "jit": lambda f, a, t: jax.jit(f)(*a),
    "vmap": lambda f, a, t: jax.vmap(f, in_axes=(0, None, 0))(jnp.stack(a), a[1], jnp.stack(t[:3])),
    "grad": lambda f, a, t: jax.grad(transform_loss(f), (0, 1, 2))(*a),
    "grad of grad, reverse-over-reverse HVP": lambda f, a, t: (
        jax.grad(lambda q: sum(jnp.sum(g**2) for g in jax.grad(transform_loss(f), (0, 1, 2))(q, *a[1:])))(a[0]),
        _hvp_rev(f, a, t),
    ),
    "jvp, forward-over-reverse HVP": lambda f, a, t: (
        jax.jvp(f, a, t),
        jax.jvp(jax.grad(transform_loss(f), (0, 1, 2)), a, t)[1],
    ),
    "grad of jvp (a loss through jvp), with and without jax.checkpoint": lambda f, a, t: _grad_of_jvp(f, a, t),
    "jacfwd": lambda f, a, t: jax.jacfwd(f)(*a),
    "hessian": lambda f, a, t: jax.hessian(lambda q: transform_loss(f)(q, *a[1:]))(a[0]),
    "linearize": lambda f, a, t: jax.linearize(f, *a)[1](*t),
    "lax.scan over layers": lambda f, a, t: jax.grad(
        lambda q: jnp.sum(jax.lax.scan(lambda x, _: (x + f(x, x, x).astype(x.dtype), None), q, length=2)[0] ** 2)
    )(a[0]),
    "eval_shape": lambda f, a, t: jax.eval_shape(f, *a),
}


def gated_linear(q, k, v, g=None, gk=None, beta=None, scale=None, segment_ids=None, kv_mask=None, state=None):
    """The gated linear attention / delta-rule recurrence step by step in float64 NumPy, one leading index at a time.

    q, k ``(..., T, D)``, v ``(..., T, E)``; ``g``, ``beta``, ``segment_ids``, ``kv_mask`` broadcast to ``(..., T)``,
    ``gk`` to ``(..., T, D)``, ``state`` to ``(..., D, E)``. Returns ``out (..., T, E)`` and the final state.
    """
    q, k, v = f64(q), f64(k), f64(v)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / np.sqrt(D) if scale is None else scale

    def full(x, tail, fill):
        return np.broadcast_to(
            np.full((1,) * (len(lead) + 1 + len(tail)), fill) if x is None else np.asarray(x), (*lead, T, *tail)
        )

    q, k, v = (np.broadcast_to(x, (*lead, T, x.shape[-1])) for x in (q, k, v))
    g, gk, b = full(g, (), 0.0), full(gk, (D,), 0.0), full(beta, (), np.nan)
    ids, keep = full(segment_ids, (), 0), full(kv_mask, (), True)
    S0 = np.zeros((*lead, D, E)) if state is None else np.broadcast_to(f64(state), (*lead, D, E))
    out, final = np.zeros((*lead, T, E)), np.zeros((*lead, D, E))
    for i in np.ndindex(*lead):
        S = S0[i].copy()
        for t in range(T):
            if t and ids[i][t] != ids[i][t - 1]:
                S[:] = 0
            if not keep[i][t]:
                continue
            S = np.exp(g[i][t]) * np.exp(gk[i][t])[:, None] * S
            if np.isnan(b[i][t]):
                S = S + np.outer(k[i][t], v[i][t])
            else:
                S = (np.eye(D) - b[i][t] * np.outer(k[i][t], k[i][t])) @ S + b[i][t] * np.outer(k[i][t], v[i][t])
            out[i][t] = scale * S.T @ q[i][t]
        final[i] = S
    return out, final


def delta_product(
    q, k, v, beta, num_householder, g=None, scale=None, segment_ids=None, kv_mask=None, state=None, xp=np
):
    """DeltaProduct token by token with each token's transition an explicit product of Householder matrices.

    q ``(..., T, D)``; k ``(..., T·n, D)``, v ``(..., T·n, E)``, ``beta (..., T·n)`` (token t's j-th at
    ``t·n + j``); ``g``, ``segment_ids``, ``kv_mask`` broadcast to ``(..., T)``, ``state`` to ``(..., D, E)``.
    Per token: ``S <- A_t S + W_t`` with ``A_t = H_n ... H_1 exp(g_t)``, ``H_j = I - β_j k_j k_jᵀ`` and
    ``W_t = Σ_j H_n ... H_{j+1} β_j k_j v_jᵀ``; ``o_t = scale · Sᵀ q_t``. ``xp``: ``np`` (float64 NumPy) or
    ``jax.numpy`` (float64 under x64, for exact derivatives); functional, no in-place writes.
    """
    n = num_householder
    if xp is np:  # float64 whatever the inputs' dtype
        q, k, v, beta = f64(q), f64(k), f64(v), f64(beta)
        g, state = (None if x is None else f64(x) for x in (g, state))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / np.sqrt(D) if scale is None else scale

    def full(x, tail, fill):
        return xp.broadcast_to(xp.full((1,) * (len(lead) + 1), fill) if x is None else xp.asarray(x), (*lead, *tail))

    q, k, v = (xp.broadcast_to(x, (*lead, *x.shape[-2:])) for x in (q, k, v))
    g, b = full(g, (T,), 0.0), full(beta, (T * n,), 0.0)
    ids, keep = (
        np.broadcast_to(np.asarray(0 if segment_ids is None else segment_ids), (*lead, T)),
        np.broadcast_to(np.asarray(True if kv_mask is None else kv_mask), (*lead, T)),
    )
    S0 = xp.zeros((*lead, D, E)) if state is None else xp.broadcast_to(xp.asarray(state), (*lead, D, E))
    outs, finals = [], []
    for i in np.ndindex(*lead):
        S, rows = S0[i], []
        for t in range(T):
            if t and ids[i][t] != ids[i][t - 1]:
                S = xp.zeros((D, E))
            if not keep[i][t]:
                rows.append(xp.zeros(E))
                continue
            A, W = xp.exp(g[i][t]) * xp.eye(D), xp.zeros((D, E))
            for j in range(n):
                kj, bj = k[i][t * n + j], b[i][t * n + j]
                H = xp.eye(D) - bj * xp.outer(kj, kj)
                A, W = H @ A, H @ W + bj * xp.outer(kj, v[i][t * n + j])
            S = A @ S + W
            rows.append(scale * S.T @ q[i][t])
        outs.append(xp.stack(rows))
        finals.append(S)
    return xp.stack(outs).reshape(*lead, T, E), xp.stack(finals).reshape(*lead, D, E)


def _dplr_steps(q, k, v, a, b, gk, g, segment_ids, kv_mask, state):
    """The DPLR reference's inputs as float64 arrays of full shape ``(*lead, T, ...)``."""
    q, k, v, a, b = f64(q), f64(k), f64(v), f64(a), f64(b)
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in (q, k, v, a, b)))
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    q, k, a, b = (np.broadcast_to(x, (*lead, T, D)) for x in (q, k, a, b))
    v = np.broadcast_to(v, (*lead, T, E))
    decay = np.broadcast_to(0.0 if gk is None else f64(gk), (*lead, T, D))
    decay = decay + (0.0 if g is None else np.broadcast_to(f64(g), (*lead, T))[..., None])
    ids = np.broadcast_to(0 if segment_ids is None else np.asarray(segment_ids), (*lead, T))
    keep = np.broadcast_to(True if kv_mask is None else np.asarray(kv_mask), (*lead, T))
    S0 = np.zeros((*lead, D, E)) if state is None else np.broadcast_to(f64(state), (*lead, D, E))
    return lead, (q, k, v, a, b, decay, ids, keep, S0)


def dplr(q, k, v, a, b, gk=None, g=None, scale=None, segment_ids=None, kv_mask=None, state=None, grads_of=None):
    """The diagonal-plus-low-rank recurrence ``S_t = (diag(exp(gk_t + g_t)) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``, step by step.

    float64 NumPy, one leading index at a time; ``o_t = scale S_tᵀ q_t``; resets and dropped steps as
    :func:`gated_linear`. Returns ``out (*lead, T, E)`` and the final state. With ``grads_of=(dout, dfinal)`` it
    returns instead the gradients (full shapes, by the recurrence's adjoint, written out by hand) of
    ``Σ dout·out + Σ dfinal·final``: a dict over q, k, v, a, b, gk (of the summed log decay; g's is its sum over D)
    and state.
    """
    lead, (q, k, v, a, b, decay, ids, keep, S0) = _dplr_steps(q, k, v, a, b, gk, g, segment_ids, kv_mask, state)
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / np.sqrt(D) if scale is None else scale
    out, final = np.zeros((*lead, T, E)), np.zeros((*lead, D, E))
    grads = {n: np.zeros(x.shape) for n, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("gk", decay))}
    grads["state"] = np.zeros(S0.shape)
    for i in np.ndindex(*lead):
        S, before = S0[i].copy(), []
        for t in range(T):
            if t and ids[i][t] != ids[i][t - 1]:
                S = np.zeros_like(S)
            before.append(S)
            if keep[i][t]:
                S = (np.diag(np.exp(decay[i][t])) + np.outer(b[i][t], a[i][t])) @ S + np.outer(k[i][t], v[i][t])
                out[i][t] = scale * S.T @ q[i][t]
        final[i] = S
        if grads_of is None:
            continue
        dS = np.array(np.broadcast_to(grads_of[1], final.shape)[i])
        for t in reversed(range(T)):
            if keep[i][t]:
                do = np.broadcast_to(grads_of[0], out.shape)[i][t]
                after = (np.diag(np.exp(decay[i][t])) + np.outer(b[i][t], a[i][t])) @ before[t]
                after = after + np.outer(k[i][t], v[i][t])
                grads["q"][i][t] = scale * after @ do
                dS = dS + scale * np.outer(q[i][t], do)
                grads["k"][i][t], grads["v"][i][t] = dS @ v[i][t], dS.T @ k[i][t]
                dW = dS @ before[t].T
                grads["gk"][i][t] = np.diag(dW) * np.exp(decay[i][t])
                grads["b"][i][t], grads["a"][i][t] = dW @ a[i][t], dW.T @ b[i][t]
                dS = (np.diag(np.exp(decay[i][t])) + np.outer(b[i][t], a[i][t])).T @ dS
            if t and ids[i][t] != ids[i][t - 1]:
                dS = np.zeros_like(dS)
        grads["state"][i] = dS
    return (out, final) if grads_of is None else grads


def gated_linear_vjp(q, k, v, g=None, gk=None, beta=None, segment_ids=None, kv_mask=None, state=None, *, dout, dfinal):
    """The derivatives of ``Σ dout·out + Σ dfinal·final`` of :func:`gated_linear`, by its adjoint recurrence (float64).

    Every input full-sized: q, k ``(*lead, T, D)``, v ``(*lead, T, E)``, ``g``/``beta`` ``(*lead, T)``, ``gk``
    ``(*lead, T, D)``, ``state (*lead, D, E)``; the default scale. Returns a dict of the derivatives of the
    floating inputs given (and ``state``, zeros where it is None). Each step, with ``A = a ⊙ S_{t-1}``:
    ``w = β (v - Aᵀ k)`` (``v`` without ``beta``), ``S_t = A + k wᵀ``, ``o_t = scale S_tᵀ q_t``, run backwards.
    """
    q, k, v = f64(q), f64(k), f64(v)
    *lead, T, D = q.shape
    E = v.shape[-1]
    scale = 1 / np.sqrt(D)
    g0 = np.zeros((*lead, T)) if g is None else f64(g)
    gk0 = np.zeros((*lead, T, D)) if gk is None else f64(gk)
    b = None if beta is None else f64(beta)
    ids = np.zeros((*lead, T), int) if segment_ids is None else np.broadcast_to(segment_ids, (*lead, T))
    keep = np.ones((*lead, T), bool) if kv_mask is None else np.broadcast_to(kv_mask, (*lead, T))
    S0 = np.zeros((*lead, D, E)) if state is None else f64(state)
    dout, dfinal = f64(dout), f64(dfinal)
    d = {n: np.zeros_like(x) for n, x in (("q", q), ("k", k), ("v", v), ("g", g0), ("gk", gk0), ("state", S0))}
    d["beta"] = None if b is None else np.zeros_like(b)
    for i in np.ndindex(*lead):
        states, S = [], S0[i].copy()  # the state before each step (after its reset)
        for t in range(T):
            if t and ids[i][t] != ids[i][t - 1]:
                S = np.zeros((D, E))
            states.append(S)
            if keep[i][t]:
                A = np.exp(g0[i][t] + gk0[i][t])[:, None] * S
                w = v[i][t] if b is None else b[i][t] * (v[i][t] - A.T @ k[i][t])
                S = A + np.outer(k[i][t], w)
        dS = dfinal[i].copy()
        for t in reversed(range(T)):
            S = states[t]
            if keep[i][t]:
                a = np.exp(g0[i][t] + gk0[i][t])
                A = a[:, None] * S
                p = A.T @ k[i][t]
                w = v[i][t] if b is None else b[i][t] * (v[i][t] - p)
                new = A + np.outer(k[i][t], w)
                d["q"][i][t] = scale * new @ dout[i][t]
                dS = dS + scale * np.outer(q[i][t], dout[i][t])
                dA, dw = dS.copy(), dS.T @ k[i][t]
                d["k"][i][t] = dS @ w
                if b is None:
                    d["v"][i][t] = dw
                else:
                    d["beta"][i][t] = dw @ (v[i][t] - p)
                    d["v"][i][t] = b[i][t] * dw
                    dp = -b[i][t] * dw
                    dA = dA + np.outer(k[i][t], dp)
                    d["k"][i][t] += A @ dp
                d["gk"][i][t] = np.sum(dA * A, axis=-1)
                d["g"][i][t] = np.sum(d["gk"][i][t])
                dS = a[:, None] * dA
            if t and ids[i][t] != ids[i][t - 1]:
                dS = np.zeros((D, E))
        d["state"][i] = dS
    given = {"g": g is not None, "gk": gk is not None, "beta": beta is not None}
    return {n: x for n, x in d.items() if given.get(n, True)}
