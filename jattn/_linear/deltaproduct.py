r"""DeltaProduct: several delta (Householder) steps a token, as one delta-rule sequence of ``n_h`` sub-steps a token.

Dimension key as in :mod:`jattn._core`; ``n_h`` is ``num_householder``. DeltaProduct (Siems et al. 2025;
flash-linear-attention's ``gated_delta_product``) updates each token's state with ``n_h`` delta steps::

    S ← a_t S                                                   (the token's decay, once: Gated DeltaProduct)
    S ← (I - β_{t,j} k_{t,j} k_{t,j}ᵀ) S + β_{t,j} k_{t,j} v_{t,j}ᵀ     for j = 1 .. n_h
    o_t = scale · Sᵀ q_t                                        (read once, after the last sub-step)

so the token's transition is a product of ``n_h`` generalised Householder matrices (times ``a_t``). That is the
delta rule run over ``T·n_h`` sub-steps, token ``t``'s sub-step ``j`` at position ``t·n_h + j``: the decay
``g_t`` on each token's first sub-step (0, no decay, on the others), q on its last (0 on the others, whose
outputs are not read), ``segment_ids`` and ``kv_mask`` repeated on every sub-step. :func:`interleave` lays the
inputs out so, :func:`last_substeps` reads the outputs back; the chunkwise and recurrent forms, documents,
padding, states, sequence parallelism and gradients are the delta rule's own (:mod:`jattn._linear.gated`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

__all__ = ["SubSteps", "interleave", "last_substeps"]


class SubSteps(NamedTuple):
    """The delta rule's inputs over ``T·n_h`` sub-steps: q ``(..., T·n_h, D)``, g ``(..., T·n_h)`` or None, ids, mask."""

    q: Array
    g: Array | None
    segment_ids: Array | None
    kv_mask: Array | None


def interleave(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    num_householder: int,
    g: ArrayLike | None,
    gk: ArrayLike | None,
    beta: ArrayLike | None,
    segment_ids: ArrayLike | None,
    kv_mask: ArrayLike | None,
) -> SubSteps:
    """q, g, ``segment_ids`` and ``kv_mask`` over the tokens' sub-steps, from ``T = q.shape[-2]`` tokens.

    k ``(..., T·n_h, D)``, v ``(..., T·n_h, E)`` and ``beta (..., T·n_h)`` are per sub-step already
    (flash-linear-attention's layout, token-major). Errors name the argument and the shapes it got.
    """
    q = jnp.asarray(q)
    n = num_householder
    if q.ndim < 2:
        raise ValueError(f"q must have shape (..., T, D), got {q.shape}")
    T = q.shape[-2]
    for name, x, tail in (("k", k, 2), ("v", v, 2), ("beta", beta, 1)):
        shape = None if x is None else jnp.shape(x)
        if shape is not None and (len(shape) < tail or shape[-tail] != T * n):
            want = "(..., T·n_h)" if tail == 1 else "(..., T·n_h, ·)"
            raise ValueError(
                f"with num_householder={n}, {name} has n_h sub-steps a token: {want} = T·n_h = {T * n} for q of "
                f"shape {q.shape} (T={T}), got {name} of shape {shape}"
            )
    if beta is None:
        raise ValueError(f"num_householder={n} takes the delta rule's beta (..., T·n_h): DeltaProduct; got beta=None")
    if gk is not None:
        raise ValueError(f"num_householder={n} takes a decay per token (g), not per key feature (gk)")
    qs = jnp.zeros((*q.shape[:-1], n, q.shape[-1]), q.dtype).at[..., -1, :].set(q)
    return SubSteps(
        qs.reshape(*q.shape[:-2], T * n, q.shape[-1]),
        _first_substep("g", g, T, n),
        _repeated("segment_ids", segment_ids, T, n),
        _repeated("kv_mask", kv_mask, T, n),
    )


def _first_substep(name: str, x: ArrayLike | None, T: int, n: int) -> Array | None:
    """A per-token ``x (..., T)`` (or ``(..., 1)``) on each token's first sub-step, 0 on the others: ``(..., T·n)``."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] not in (1, T):
        raise ValueError(f"{name} is per token: it must broadcast to (..., T={T}), got shape {x.shape}")
    x = jnp.broadcast_to(x, (*x.shape[:-1], T))
    return jnp.zeros((*x.shape, n), x.dtype).at[..., 0].set(x).reshape(*x.shape[:-1], T * n)


def _repeated(name: str, x: ArrayLike | None, T: int, n: int) -> Array | None:
    """A per-token ``x (..., T)`` repeated on each token's sub-steps ``(..., T·n)`` (``(..., 1)`` as it is)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] not in (1, T):
        raise ValueError(f"{name} is per token: it must have shape (..., T={T}), got shape {x.shape}")
    return x if x.shape[-1] == 1 else jnp.repeat(x, n, axis=-1)


def last_substeps(out: Array, num_householder: int) -> Array:
    """The outputs ``(..., T, E)`` of each token's last sub-step, from ``out (..., T·n_h, E)``."""
    *lead, length, e = out.shape
    return out.reshape(*lead, length // num_householder, num_householder, e)[..., -1, :]
