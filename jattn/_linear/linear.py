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

``eps`` (default 1e-6, must be > 0) guards the normaliser: where the feature sums vanish (e.g.
``relu`` features of a query with no positive entry, or no key yet) the output is 0, not NaN.

Features must be non-negative. The built-in maps are; a user callable is checked on every
call: a negative feature raises a ValueError when the values can be read and, traced (under
``jit``, ``grad``, ``vmap``), makes the output (and state) NaN for every leading index whose
query or key features went negative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn._arrays import compute_dtype
from jattn._checks import check_qkv
from jattn._masks import per_example_steps
from jattn._scalars import check_bool, check_int, check_real, is_traced

__all__ = ["LinearState", "linear_attention"]

FEATURE_MAPS: dict[str, Callable[[Array], Array]] = {
    "elu": lambda x: jax.nn.elu(x) + 1.0,
    "relu": jax.nn.relu,
}


class LinearState(NamedTuple):
    """Running sums over the keys seen so far: ``kv (..., F, E)`` and ``z (..., F)``."""

    kv: Array
    z: Array


def feature_fn(feature_map: str | Callable[[Array], Array]) -> Callable[[Array], Array]:
    """The feature map named ``feature_map`` (a key of :data:`FEATURE_MAPS`), or the callable itself."""
    if callable(feature_map):
        return feature_map
    if not isinstance(feature_map, str):
        raise TypeError(f"feature_map must be a name in {sorted(FEATURE_MAPS)} or a callable, got {feature_map!r}")
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
        returning non-negative features (see the module docstring for negative ones).
      causal: bool; query t sees keys s <= t (and everything in ``initial_state``).
      kv_mask: boolean, False drops a key (padding; it never enters the state): ``(S,)``, ``(B, S)`` per
        example (batch first, shared by the heads, as :mod:`jattn.masks` reads per-example arrays, whatever B
        and N are), or one axis per leading axis of q, k, v (``(B, N, S)``, ``(B, 1, S)``: per leading index).
        Between those (``(B, K, S)`` for q ``(B, K, G, T, D)``) it is ambiguous: a ValueError says how to
        write it.
      chunk_size: positive int, chunk length of the causal form.
      eps: positive number added to the normaliser (see the module docstring). A traced ``eps``
        is not checked.
      initial_state: sums over earlier keys, ``kv (..., F, E)`` and ``z (..., F)`` with leading
        dimensions that broadcast with those of q, k, v; e.g. a cache for decoding.
      return_state: bool; also return the state after the last key.

    Returns:
      ``out (..., T, E)`` in the input dtype (float32 accumulation for bfloat16/float16), and the
      :class:`LinearState` ``kv (..., F, E)``, ``z (..., F)`` when ``return_state``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    causal, return_state = check_bool("causal", causal), check_bool("return_state", return_state)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal linear attention needs T == S, got q {q.shape} and k {k.shape}")
    chunk_size = check_int("chunk_size", chunk_size, min=1)
    eps = check_real("eps", eps, low=0.0, open_low=True)
    compute = compute_dtype(q.dtype)
    phi = feature_fn(feature_map)
    fq, fk = _apply(phi, feature_map, q, compute), _apply(phi, feature_map, k, compute)  # (..., T, F), (..., S, F)
    vc = v.astype(compute)
    try:
        lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading dimensions of q, k, v do not broadcast: q {q.shape}, k {k.shape}, v {v.shape}"
        ) from None
    if kv_mask is not None:
        kv_mask = _check_kv_mask(kv_mask, lead, k.shape[-2])
        fk = jnp.where(kv_mask[..., None], fk, jnp.zeros((), compute))
    lead = jnp.broadcast_shapes(lead, fk.shape[:-2])
    fq = jnp.broadcast_to(fq, (*lead, *fq.shape[-2:]))
    fk = jnp.broadcast_to(fk, (*lead, *fk.shape[-2:]))
    vc = jnp.broadcast_to(vc, (*lead, *vc.shape[-2:]))
    F, E = fk.shape[-1], vc.shape[-1]
    if initial_state is None:
        initial_state = LinearState(jnp.zeros((*lead, F, E), compute), jnp.zeros((*lead, F), compute))
    state = _check_state(initial_state, lead, F, E, compute)
    ein = dict(precision=precision)
    if not causal:
        kv = state.kv + jnp.einsum("...sf,...se->...fe", fk, vc, **ein)
        z = state.z + jnp.sum(fk, axis=-2)
        num = jnp.einsum("...tf,...fe->...te", fq, kv, **ein)
        den = jnp.einsum("...tf,...f->...t", fq, z, **ein)
        out, state = num / (den + eps)[..., None], LinearState(kv, z)
    else:
        out, state = _causal_chunks(fq, fk, vc, state, chunk_size, eps, precision)
    if callable(feature_map):
        out, state = _poison_negative(out, state, fq, fk)
    out = out.astype(v.dtype)
    return (out, state) if return_state else out


def _apply(phi: Callable[[Array], Array], feature_map: object, x: Array, compute: jnp.dtype) -> Array:
    """Features ``(..., L, F)`` of ``x (..., L, D)``; raises on a wrong shape or dtype, or (concrete) a negative value."""
    f = phi(x.astype(compute))
    if not isinstance(f, jax.Array) or f.shape[:-1] != x.shape[:-1] or not jnp.issubdtype(f.dtype, jnp.floating):
        got = f"{getattr(f, 'dtype', type(f).__name__)} {getattr(f, 'shape', '')}"
        raise ValueError(
            f"feature_map {feature_map!r} must map (..., L, D) {x.shape} to floating (..., L, F), got {got}"
        )
    f = f.astype(compute)
    if callable(feature_map) and not is_traced(f) and f.size and bool(jnp.any(f < 0)):
        raise ValueError(f"feature_map {feature_map!r} must return non-negative features, got min {float(f.min())}")
    return f


def _poison_negative(out: Array, state: LinearState, fq: Array, fk: Array) -> tuple[Array, LinearState]:
    """NaN out ``(..., T, E)`` and state wherever (traced) features of q or k went negative."""
    bad = jnp.any(fq < 0, axis=(-2, -1)) | jnp.any(fk < 0, axis=(-2, -1))  # (...)
    nan = jnp.full((), jnp.nan, out.dtype)
    return jnp.where(bad[..., None, None], nan, out), LinearState(
        jnp.where(bad[..., None, None], nan, state.kv), jnp.where(bad[..., None], nan, state.z)
    )


def _broadcasts(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast of ``shapes``, or None when they do not broadcast."""
    try:
        return tuple(jnp.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _check_kv_mask(kv_mask: ArrayLike, lead: tuple[int, ...], S: int) -> Array:
    """``kv_mask`` as a boolean array ``(..., S)`` broadcasting with ``lead``, read as masks read per-example arrays.

    ``(B, S)`` is per example, batch first (:func:`jattn._masks.per_example.per_example_steps`).
    """
    kv_mask = jnp.asarray(kv_mask)
    if kv_mask.dtype != jnp.bool_:
        raise TypeError(f"kv_mask must be boolean (..., S={S}), got {kv_mask.dtype} with shape {kv_mask.shape}")
    if kv_mask.ndim < 1 or kv_mask.shape[-1] != S:
        raise ValueError(f"kv_mask must have shape (..., S={S}), got {kv_mask.shape}")
    read = per_example_steps("kv_mask", kv_mask, lead)
    if _broadcasts(lead, read.shape[:-1]) is None:
        raise ValueError(
            f"kv_mask {kv_mask.shape}, read as {read.shape} ((B, S) per example, batch first as jattn.masks reads "
            f"it, or one axis per leading axis), does not broadcast with the leading dimensions {lead} of q, k, v; "
            f"for one mask per head give it one axis per leading axis, e.g. (1, N, S) as kv_mask[None] for q (B, N, T, D)"
        )
    return read


def _check_state(state: object, lead: tuple[int, ...], F: int, E: int, compute: jnp.dtype) -> LinearState:
    """``initial_state`` broadcast to ``kv (*lead, F, E)``, ``z (*lead, F)`` in the compute dtype."""
    want = f"LinearState with kv (..., F={F}, E={E}) and z (..., F={F}) whose leading dimensions broadcast to {lead}"
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(f"initial_state must be a {want}, got {type(state).__name__}")
    kv, z = jnp.asarray(state[0]), jnp.asarray(state[1])
    if not (jnp.issubdtype(kv.dtype, jnp.floating) and jnp.issubdtype(z.dtype, jnp.floating)):
        raise TypeError(f"initial_state must be floating, got kv {kv.dtype} and z {z.dtype}")
    fits = kv.shape[-2:] == (F, E) and z.shape[-1:] == (F,)
    if not fits or _broadcasts(lead, kv.shape[:-2], z.shape[:-1]) != lead:
        raise ValueError(f"initial_state must be a {want}, got kv {kv.shape} and z {z.shape}")
    return LinearState(
        jnp.broadcast_to(kv.astype(compute), (*lead, F, E)), jnp.broadcast_to(z.astype(compute), (*lead, F))
    )


def _causal_chunks(fq, fk, v, state, chunk, eps, precision):
    """Causal form: within-chunk quadratic part + running state across chunks (``lax.scan``)."""
    *lead, T, _ = fq.shape
    c = max(min(chunk, T), 1)  # T = 0: no chunk at all
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
    out = jnp.moveaxis(out, 0, -3).reshape(*lead, n * c, v.shape[-1])[..., :T, :]
    return out, LinearState(kv, z)
