"""jax.nn's and Flax's head layout, ``(batch..., L, heads, H)``, to and from jattn's grouped one.

jattn reads the heads as leading dimensions: queries ``(batch..., K, G, T, D)`` against keys and
values ``(batch..., K, 1, S, D)``, so grouped-query attention is broadcasting (dimension key:
:mod:`jattn._core`). :func:`jattn.dot_product_attention` (jax.nn's signature) and
:func:`jattn.flax.attention_fn` (Flax's hook) take the other layout, with the heads after the
length; both convert through these functions, and their masks and biases ``(batch..., N, T, S)``
through :func:`heads_grid`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

__all__ = ["from_grouped", "heads_grid", "to_grouped"]


def to_grouped(q: Array, k: Array, v: Array, num_kv_heads: int) -> tuple[Array, Array, Array]:
    """``q (batch..., T, N, H)``, ``k, v (batch..., S, K, H|E)`` -> ``(batch..., K, G, T, H)``, ``(batch..., K, 1, S, H|E)``."""
    nb, (N, H) = q.ndim - 3, q.shape[-2:]
    K = num_kv_heads
    qg = jnp.moveaxis(q.reshape(*q.shape[:-2], K, N // K, H), nb, nb + 2)
    kg, vg = (jnp.moveaxis(x, nb, nb + 1)[..., None, :, :] for x in (k, v))
    return qg, kg, vg


def from_grouped(out: Array, N: int) -> Array:
    """``out (batch..., K, G, T, E)`` -> ``(batch..., T, N, E)``, N = K·G."""
    nb, (T, E) = out.ndim - 4, out.shape[-2:]
    return jnp.moveaxis(out, nb + 2, nb).reshape(*out.shape[:nb], T, N, E)


def heads_grid(name: str, x: ArrayLike, lead: tuple[int, ...], N: int, K: int, T: int, S: int) -> Array:
    """A ``mask``/``bias`` broadcastable to ``(batch..., N, T, S)`` as ``(batch...|1, K|1, G|1, T|1, S|1)``.

    ``lead`` is the batch shape ``batch...``. Fewer dimensions are left-padded with unit axes, as
    jax.nn does. Errors report the shape given; a ``(B, S)`` one (torch's key padding) is told
    how to expand.
    """
    x = jnp.asarray(x)
    given, full = x.shape, (*lead, N, T, S)
    axes = "(B, N, T, S)" if len(lead) == 1 else "(batch..., N, T, S)"
    if x.ndim > len(full):
        raise ValueError(f"{name} of shape {given} has more dimensions than {axes} = {full}")
    x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
    if any(n not in (1, f) for n, f in zip(x.shape, full, strict=True)):
        raise ValueError(f"{name} of shape {given} does not broadcast to {axes} = {full}" + _hint(name, given, lead, S))
    *b, n, t, s = x.shape
    return x.reshape(*b, K, N // K, t, s) if n == N and N > 1 else x.reshape(*b, 1, 1, t, s)


def _hint(name: str, given: tuple[int, ...], lead: tuple[int, ...], S: int) -> str:
    """How a ``(B, S)`` mask or bias (torch's key padding) expands to ``(B, N, T, S)``."""
    if len(lead) != 1 or given != (*lead, S):
        return ""
    hint = f"; a (B, S) {name} per example and key goes as {name}[:, None, None, :]"
    if name == "mask":
        hint += (
            " (True = attend: torch's key_padding_mask is True at padding, so ~mask), or pass "
            "key_value_seq_lengths=lengths with the valid keys (B,) of each example"
        )
    return hint
