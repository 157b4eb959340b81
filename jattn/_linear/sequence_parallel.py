"""Gated linear attention with the sequence split over a mesh axis: the state passes from shard to shard.

Inside ``jax.shard_map``, device ``i`` of the axis holds steps ``[i T, (i + 1) T)`` of every sequence.
Each shard's effect on the state is affine, ``S -> M S + H`` (``M (D, D)``, ``H (D, E)``): the recurrence is
linear in the state, so running it from ``[I | 0]`` with values ``[0 | v]`` gives ``[M | H]`` (a document
start inside the shard zeroes ``M``). The shards' maps are gathered (``D (D + E)`` numbers a head each,
small beside the sequence), every device composes the ones before it into its incoming state, and runs
its steps again from there. The work is about three times a shard's own (the first pass carries D + E
columns), in parallel over the devices, with one all-gather of the maps. The diagonal-plus-low-rank
transition (``a``, ``b``) composes the same way: ``M`` is the product of its shard's transitions, ``(D, D)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.steps import Steps

__all__ = ["first_resets", "run_sharded"]


def first_resets(segment_ids: Array, lead: tuple[int, ...], axis_name: str) -> Array:
    """``(*lead,)``: whether each sequence's first step here starts a document.

    It does where its id differs from the previous shard's last; never on the axis's first device.
    """
    T = segment_ids.shape[-1]
    ids = jnp.broadcast_to(segment_ids, (*lead, T))
    n = jax.lax.psum(1, axis_name)
    previous = jax.lax.ppermute(ids[..., -1], axis_name, [(i, i + 1) for i in range(n - 1)])
    return (ids[..., 0] != previous) & (jax.lax.axis_index(axis_name) > 0)


def run_sharded(
    steps: Steps,
    state: Array,
    *,
    axis_name: str,
    mode: str,
    chunk_size: int,
    precision: jax.lax.PrecisionLike,
    run: Callable[..., tuple[Array, Array]],
) -> tuple[Array, Array]:
    """``out (*lead, T, E)`` of this shard and the state after the whole sequence's last step (every device).

    ``run(steps, state, mode=, chunk_size=, precision=)`` runs a shard's steps (:func:`jattn._linear.forms.run` of a
    family: any recurrence linear in its state whose steps have ``k`` and ``v``).
    """
    *lead, T, _ = steps.v.shape
    D = steps.k.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(D, dtype=state.dtype), (*lead, D, D))
    augmented = steps._replace(v=jnp.concatenate([jnp.zeros((*lead, T, D), steps.v.dtype), steps.v], axis=-1))
    start = jnp.concatenate([eye, jnp.zeros_like(state)], axis=-1)
    _, maps = run(augmented, start, mode=mode, chunk_size=chunk_size, precision=precision)
    maps = jax.lax.all_gather(maps, axis_name, to="invarying")  # (n, *lead, D, D + E): [M | H] of every shard
    incoming = [state]  # the state before shard j; the call's initial state before the first
    for j in range(maps.shape[0]):
        m, h = maps[j, ..., :D], maps[j, ..., D:]
        incoming.append(jnp.einsum("...fg,...ge->...fe", m, incoming[-1], precision=precision) + h)
    mine = jnp.stack(incoming[:-1])[jax.lax.axis_index(axis_name)]
    out, _ = run(steps, mine, mode=mode, chunk_size=chunk_size, precision=precision)
    return out, incoming[-1]
