r"""Log-linear attention with the sequence split over a mesh axis: the level states pass from shard to shard.

Inside ``jax.shard_map``, device ``i`` of the axis holds the steps at positions ``[start + i T, start + (i+1) T)``.
As in :mod:`jattn._linear.sequence_parallel`, a shard's effect on what follows is affine in the level states it
starts from (relative to the position before its first step) and gives them relative to its last position:

    S ↦ merge_h(M S) + H        h = bit_length((start_i - 1) XOR (start_i + T - 1))

``M (D, D)`` is the shard's transition (the same for every level: a step moves every level alike; a document
start zeroes it), ``merge_h`` the Fenwick merge of levels ``0 .. h`` into ``h`` (relative to the shard's last
position the incoming keys lie at level h or above: with T a power of 2 dividing start_i, h is
``log2(T) + bit_length(i' XOR i)`` for the shard ``i'`` just before, the Fenwick tree over shards), and ``H
(L, D, E)`` the shard's own keys' level states. One pass from ``[I | 0]`` (I at the top level, which no merge
moves) with values ``[0 | v]`` gives ``M`` (the sum of the levels' first D columns) and ``H``; the maps are
gathered (``D (D + L E)`` numbers a head each), every device composes those before it into its incoming level
states and runs its steps again from there, with ``start`` at its first position. The work is about three
times a shard's own, with one all-gather of the maps, and two reductions of ``(L, D, E)`` for the final state.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._linear.log_linear.levels import gap_level, merge_levels
from jattn._linear.steps import Steps

__all__ = ["run_sharded"]

Form = Callable[[Steps, Array, Array, Array], tuple[Array, Array, Array]]


def run_sharded(
    steps: Steps, lam: Array, state: Array, start: Array, *, axis_name: str, form: Form
) -> tuple[Array, Array]:
    """``out (*lead, T, E)`` of this shard and the level states after the sequence's last kept step (every device).

    ``form(steps, lam, state, start) -> (out, states, last)``: the chunkwise or the recurrent form
    (:mod:`jattn._linear.log_linear.chunk`, :mod:`jattn._linear.log_linear.recurrent`); ``state (*lead, L, D, E)`` relative to ``start - 1``, the position
    ``start (*lead,)`` of the first shard's first step. The states returned are the recurrent form's: relative to
    the last kept step of the whole sequence (``state`` where none is), zeroed where a document starts after it.
    """
    T = steps.keep.shape[-1]
    here = start + jax.lax.axis_index(axis_name) * T
    maps = jax.lax.all_gather(_shard_map(steps, lam, here, state.shape[-3], form), axis_name, to="invarying")
    incoming = [state]  # the level states before shard j, relative to its first position minus 1
    for j in range(jax.lax.axis_size(axis_name)):
        m, h = maps[0][j], maps[1][j]
        moved = jnp.einsum("...fg,...lge->...lfe", m, incoming[-1])
        first = start + j * T
        incoming.append(merge_levels(moved, gap_level(first - 1, first + T - 1)) + h)
    mine = jnp.stack(incoming[:-1])[jax.lax.axis_index(axis_name)]
    out, final, last = form(steps, lam, mine, here)
    return out, _final_states(steps, final, last >= here, state, axis_name)


def _shard_map(steps: Steps, lam: Array, here: Array, L: int, form: Form) -> tuple[Array, Array]:
    """The shard's ``M (*lead, D, D)`` and ``H (*lead, L, D, E)`` relative to its last position (module docstring)."""
    *lead, T, E = steps.v.shape
    D = steps.k.shape[-1]
    top = jnp.zeros((L, D, D), steps.v.dtype).at[L - 1].set(jnp.eye(D, dtype=steps.v.dtype))
    probe = jnp.concatenate([jnp.broadcast_to(top, (*lead, L, D, D)), jnp.zeros((*lead, L, D, E), top.dtype)], -1)
    augmented = steps._replace(v=jnp.concatenate([jnp.zeros((*lead, T, D), steps.v.dtype), steps.v], axis=-1))
    _, mapped, last = form(augmented, lam, probe, here)
    return jnp.sum(mapped[..., :D], axis=-3), merge_levels(mapped[..., D:], gap_level(last, here + T - 1))


def _final_states(steps: Steps, final: Array, kept: Array, state: Array, axis_name: str) -> Array:
    """The states of the last shard with a kept step (the call's ``state`` where none has one), every device.

    ``final``: this shard's states after its last kept step; a document start in a later shard zeroes them.
    """
    i = jax.lax.axis_index(axis_name)
    owner = jax.lax.pmax(jnp.where(kept, i, -1), axis_name)  # (*lead,)
    later = jax.lax.psum((jnp.any(steps.reset, axis=-1) & (i > owner)).astype(jnp.int32), axis_name) > 0
    chosen = jax.lax.psum(jnp.where((i == owner)[..., None, None, None], final, 0.0), axis_name)
    chosen = jnp.where((owner < 0)[..., None, None, None], state, chosen)
    return jnp.where(later[..., None, None, None], 0.0, chosen)
