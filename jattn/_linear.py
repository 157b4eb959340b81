r"""Linear attention (the article series' last variant): a positive feature map instead of softmax.

With a feature map :math:`\phi \ge 0` applied to queries and keys (dimension key in
:mod:`jattn._core`; F is the feature depth, F = D for the elementwise maps)::

    out_t = phi(q_t) · KV / (phi(q_t) · z + eps),   KV = sum_s phi(k_s) v_sᵀ  (F, E),
                                                     z  = sum_s phi(k_s)       (F,)

which costs O(T·F·E) instead of O(T·S·D). Causal attention restricts the sums to ``s <= t``; it
is computed in chunks of ``chunk_size``: the quadratic form inside a chunk (parallel) plus the
running state ``(KV, z)`` of all earlier chunks, carried across chunks by ``lax.scan``. The same
state, returned with ``return_state=True`` and passed back as ``initial_state``, decodes one or
more tokens at a time.

``eps`` (default 1e-6) guards the normaliser: where the feature sums vanish (e.g. ``relu``
features of a query with no positive entry, or no key yet) the output is 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

__all__ = ["LinearState", "linear_attention"]

FEATURE_MAPS: dict[str, Callable[[Array], Array]] = {
    "elu": lambda x: jax.nn.elu(x) + 1.0,
    "relu": jax.nn.relu,
}


class LinearState(NamedTuple):
    """Running sums over the keys seen so far: ``kv (..., F, E)`` and ``z (..., F)``."""

    kv: Array
    z: Array


def _features(feature_map: str | Callable[[Array], Array]) -> Callable[[Array], Array]:
    if callable(feature_map):
        return feature_map
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, got {feature_map!r}")
    return FEATURE_MAPS[feature_map]


def linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    feature_map: str | Callable[[Array], Array] = "elu",
    causal: bool = False,
    kv_mask: ArrayLike | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    precision: jax.lax.PrecisionLike = None,
) -> Array | tuple[Array, LinearState]:
    """Linear attention of q ``(..., T, D)`` over k ``(..., S, D)``, v ``(..., S, E)`` -> ``(..., T, E)``.

    Args:
      q, k, v: one floating dtype; leading dimensions broadcast. Causal needs ``T == S``.
      feature_map: ``'elu'`` (elu + 1, default), ``'relu'``, or a callable ``(..., D) -> (..., F)``
        returning non-negative features.
      causal: query t sees keys s <= t (and everything in ``initial_state``).
      kv_mask: boolean ``(..., S)``, False drops a key (padding; it never enters the state).
      chunk_size: chunk length of the causal form.
      eps: added to the normaliser (see the module docstring).
      initial_state: sums over earlier keys, e.g. a cache for decoding.
      return_state: also return the state after the last key.

    Returns:
      ``out (..., T, E)`` in the input dtype (float32 accumulation for bfloat16/float16), and the
      :class:`LinearState` when ``return_state``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    from jattn._core import _check_qkv  # the same validation as the softmax core

    _check_qkv(q, k, v)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal linear attention needs T == S, got q {q.shape} and k {k.shape}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    phi = _features(feature_map)
    fq, fk = phi(q.astype(compute)), phi(k.astype(compute))  # (..., T, F), (..., S, F)
    vc = v.astype(compute)
    if kv_mask is not None:
        kv_mask = jnp.asarray(kv_mask)
        if kv_mask.dtype != jnp.bool_ or kv_mask.shape[-1:] != k.shape[-2:-1]:
            raise ValueError(f"kv_mask must be boolean (..., S={k.shape[-2]}), got {kv_mask.dtype} {kv_mask.shape}")
        fk = jnp.where(kv_mask[..., None], fk, jnp.zeros((), compute))
    lead = jnp.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], vc.shape[:-2])
    fq = jnp.broadcast_to(fq, (*lead, *fq.shape[-2:]))
    fk = jnp.broadcast_to(fk, (*lead, *fk.shape[-2:]))
    vc = jnp.broadcast_to(vc, (*lead, *vc.shape[-2:]))
    F, E = fk.shape[-1], vc.shape[-1]
    if initial_state is None:
        initial_state = LinearState(jnp.zeros((*lead, F, E), compute), jnp.zeros((*lead, F), compute))
    state = LinearState(
        *(
            jnp.broadcast_to(x.astype(compute), (*lead, *x.shape[-n:]))
            for x, n in zip(initial_state, (2, 1), strict=True)
        )
    )
    ein = dict(precision=precision)
    if not causal:
        kv = state.kv + jnp.einsum("...sf,...se->...fe", fk, vc, **ein)
        z = state.z + jnp.sum(fk, axis=-2)
        num = jnp.einsum("...tf,...fe->...te", fq, kv, **ein)
        den = jnp.einsum("...tf,...f->...t", fq, z, **ein)
        out, state = num / (den + eps)[..., None], LinearState(kv, z)
    else:
        out, state = _causal_chunks(fq, fk, vc, state, chunk_size, eps, precision)
    out = out.astype(v.dtype)
    return (out, state) if return_state else out


def _causal_chunks(fq, fk, v, state, chunk, eps, precision):
    """Causal form: within-chunk quadratic part + running state across chunks (``lax.scan``)."""
    *lead, T, _ = fq.shape
    c = min(chunk, T)
    n = -(-T // c)
    pad = n * c - T  # padded keys have zero features: they add nothing to the state

    def chunks(x):  # (..., T, X) -> (n, ..., c, X)
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
        return jnp.moveaxis(x.reshape(*lead, n, c, x.shape[-1]), -3, 0)

    tril = jnp.tril(jnp.ones((c, c), bool))

    def step(carry, xs):
        kv, z = carry
        q, k, val = xs  # (..., c, F), (..., c, F), (..., c, E)
        a = jnp.einsum("...tf,...sf->...ts", q, k, precision=precision)
        a = jnp.where(tril, a, jnp.zeros((), a.dtype))
        num = jnp.einsum("...ts,...se->...te", a, val, precision=precision)
        num = num + jnp.einsum("...tf,...fe->...te", q, kv, precision=precision)
        den = jnp.sum(a, axis=-1) + jnp.einsum("...tf,...f->...t", q, z, precision=precision)
        kv = kv + jnp.einsum("...sf,...se->...fe", k, val, precision=precision)
        z = z + jnp.sum(k, axis=-2)
        return (kv, z), num / (den + eps)[..., None]

    (kv, z), out = jax.lax.scan(step, tuple(state), (chunks(fq), chunks(fk), chunks(v)))
    out = jnp.moveaxis(out, 0, -3).reshape(*lead, n * c, -1)[..., :T, :]
    return out, LinearState(kv, z)
