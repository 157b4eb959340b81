"""KDA's pair sums inside a chunk: ``Σ_f x_tf exp(b_tf - b_sf) k_sf`` with a decay per key feature, as matmuls.

Dimension key as in :mod:`jattn._core`; ``C`` is the chunk's steps. With a decay per feature the pair decays
``exp(b_t - b_s)`` are vectors, and kept per pair and feature they cost ``C² D`` exponentials a chunk (GLA's
form). Split at a running sum ``r`` between the two steps, ``b_t - b_s = (b_t - r) + (r - b_s)``, they become a
factor of the query times a factor of the key, each ``exp`` of a difference ``<= 0`` (no overflow at any decay),
and the sums of a block of queries against a block of keys one matmul. A chunk of ``C = 2^L`` steps splits as a
binary tree: at level ``h = 1, 2, ..., C/2`` each block of ``2h`` steps pairs its upper ``h`` queries with its
lower ``h`` keys at ``r``, the running sum at the lower half's last step; every pair ``s < t`` lies in one such
block pair, ``s = t`` needs no decay. ``L C D`` exponentials and ``L`` small matmuls a chunk.

The derivative (:func:`pair_sums`' JVP rule) is written in the same pair sums, so reverse mode is its transpose:
the sums are bilinear in ``x`` and the keys, and a tangent ``db`` of the running sums enters as ``x ⊙ db`` on the
query side and ``-k ⊙ db`` on the key side (``∂ exp(b_t - b_s) = exp(b_t - b_s) (db_t - db_s)``). Left to
autodiff through the factors, each level's reference ``r`` would gather its half's gradients in small
reductions that cost more than the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["pair_sums"]


def pair_sums(q: Array, k: Array, hi: Array, lo: Array, precision: jax.lax.PrecisionLike) -> tuple[Array, Array]:
    """``Σ_f x_tf exp(b_tf - b_sf) k_sf`` for x = q and x = k, ``(..., C, C)`` each (s <= t; 0 above the diagonal).

    Args:
      q, k: ``(..., C, D)``.
      hi, lo: the running sums ``b = hi + lo`` of the log decays ``(..., C, D)``, non-increasing along C
        (:func:`jattn._linear.chunking.running_sums`).
      precision: of the matmuls.

    A chunk whose length is not a power of 2 is padded (zero q and k, the last running sum repeated).
    """
    *lead, C, _ = k.shape
    size = 1 << max(C - 1, 0).bit_length()
    if size != C:
        pad = [(0, 0)] * len(lead) + [(0, size - C), (0, 0)]
        q, k = (jnp.pad(y, pad) for y in (q, k))
        hi, lo = (jnp.pad(y, pad, mode="edge") for y in (hi, lo))
    scores, a = _pair_sums(q, k, hi, lo, precision)
    return scores[..., :C, :C], a[..., :C, :C]


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _pair_sums(q: Array, k: Array, hi: Array, lo: Array, precision) -> tuple[Array, Array]:
    """:func:`pair_sums` for ``C`` a power of 2."""
    sums = _tree_sums(jnp.stack([q, k]), k, _factors(hi, lo), precision)
    return sums[0], sums[1]


@_pair_sums.defjvp
def _pair_sums_jvp(precision, primals, tangents):
    q, k, hi, lo = primals
    dq, dk, dhi, dlo = tangents
    db = dhi + dlo
    factors = _factors(hi, lo)
    x = jnp.stack([q, k])
    sums = _tree_sums(x, k, factors, precision)
    d = _tree_sums(jnp.stack([dq, dk]) + x * db[None], k, factors, precision)
    d = d + _tree_sums(x, dk - k * db, factors, precision)
    return (sums[0], sums[1]), (d[0], d[1])


def _factors(hi: Array, lo: Array) -> list[tuple[Array, Array]]:
    """Per level ``h = 1, 2, ..., C/2``: the upper halves' ``exp(b_t - r)`` and the lower's ``exp(r - b_s)``.

    Each ``(..., C / 2h, h, D)``; ``r`` the running sum at the lower half's last step, so both exponents are
    ``<= 0`` (``hi`` and ``lo`` differenced apart, as :func:`jattn._linear.chunking.running_sums` says).
    """
    *lead, C, D = hi.shape
    factors, h = [], 1
    while h < C:
        bh, bl = (y.reshape(*lead, C // (2 * h), 2, h, D) for y in (hi, lo))
        rh, rl = bh[..., 0, h - 1 :, :], bl[..., 0, h - 1 :, :]
        up = jnp.exp((bh[..., 1, :, :] - rh) + (bl[..., 1, :, :] - rl))
        down = jnp.exp((rh - bh[..., 0, :, :]) + (rl - bl[..., 0, :, :]))
        factors.append((up, down))
        h *= 2
    return factors


def _tree_sums(x: Array, y: Array, factors: list[tuple[Array, Array]], precision) -> Array:
    """``Σ_f x_tf exp(b_tf - b_sf) y_sf`` for ``x (X, ..., C, D)``, ``y (..., C, D)``: ``(X, ..., C, C)``, s <= t.

    Built from the diagonal up, each level joining two blocks of ``h`` into one of ``2h``: the lower block,
    zeros, and the new pairs of the upper queries with the lower keys beside the upper block.
    """
    X, *lead, C, D = x.shape
    sums = jnp.sum(x * y[None], axis=-1)[..., None, None]  # (X, ..., C, 1, 1): s = t
    h = 1
    for up, down in factors:
        blocks = C // (2 * h)
        queries = x.reshape(X, *lead, blocks, 2, h, D)[..., 1, :, :] * up[None]
        keys = y.reshape(*lead, blocks, 2, h, D)[..., 0, :, :] * down
        cross = jnp.einsum("x...tf,...sf->x...ts", queries, keys, precision=precision)
        sums = sums.reshape(X, *lead, blocks, 2, h, h)
        top = jnp.concatenate([sums[..., 0, :, :], jnp.zeros_like(cross)], axis=-1)
        sums = jnp.concatenate([top, jnp.concatenate([cross, sums[..., 1, :, :]], axis=-1)], axis=-2)
        h *= 2
    return sums.reshape(X, *lead, C, C)
