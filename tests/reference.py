"""Independent float64 NumPy references and the one tolerance table of the suite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

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


def softmax(x, where=None):
    """Row softmax over the last axis; rows with nothing kept are all zeros."""
    x = np.asarray(x, np.float64)
    where = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
    out = np.zeros_like(x)
    lse = np.full(x.shape[:-1], -np.inf)
    for idx in np.ndindex(*x.shape[:-1]):
        keep = where[idx]
        if keep.any():
            row = x[idx][keep]
            m = row.max()
            e = np.exp(row - m)
            out[idx][keep] = e / e.sum()
            lse[idx] = m + np.log(e.sum())
    return out, lse


def attention(q, k, v, mask=None, bias=None, scale=None):
    """Dense attention in float64: returns (out (..., T, E), weights (..., T, S), lse (..., T))."""
    q, k, v = f64(q), f64(k), f64(v)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        mask = np.asarray(mask, bool)
        shape = np.broadcast_shapes(s.shape, mask.shape)
        s, mask = np.broadcast_to(s, shape), np.broadcast_to(mask, shape)
    w, lse = softmax(s, mask)
    out = np.matmul(w, v)
    return out, w, np.broadcast_to(lse, out.shape[:-1])


def article_self_attention(x, wq, wk, wv):
    """The article's module: x (B, T, d) with kernels (d, d_k) -> (B, T, d_k)."""
    x = np.asarray(x, np.float64)
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(wq.shape[1])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def attention_grads(q, k, v, dout, mask=None, bias=None, scale=None):
    """Float64 gradients of ``sum(attention(...) * dout)``: returns (dq, dk, dv, dbias), each reduced
    back to its input's (broadcast) shape; dbias is None without a bias.

    The softmax backward by hand: dP = dO Vᵀ, dS = P ∘ (dP - rowsum(P ∘ dP)), dQ = dS K · scale,
    dK = dSᵀ Q · scale, dV = Pᵀ dO, dbias = dS.
    """
    _, w, _ = attention(q, k, v, mask, bias, scale)
    q, k, v, dout = f64(q), f64(k), f64(v), np.asarray(dout, np.float64)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    dp = np.matmul(dout, np.swapaxes(v, -1, -2))
    ds = w * (dp - np.sum(w * dp, -1, keepdims=True))
    dq = np.matmul(ds, k) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * scale
    dv = np.matmul(np.swapaxes(w, -1, -2), dout)
    return (
        unbroadcast(dq, q.shape),
        unbroadcast(dk, k.shape),
        unbroadcast(dv, v.shape),
        None if bias is None else unbroadcast(ds, np.shape(bias)),
    )


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
