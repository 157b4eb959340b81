"""The two forms of a linear-family recurrence, run the same way for every family (``mode``: chunk or recurrent).

Dimension key as in :mod:`jattn._core`. A family gives its step-by-step form ``recurrent(steps, state,
precision)`` and its chunkwise form ``chunked(steps, state, chunk_size, precision)``, each ``-> (out (*lead, T, E),
state (*lead, D, E))``: the gated / delta-rule family (:mod:`jattn._linear.gated_delta_rule`) and the
diagonal-plus-low-rank one (:mod:`jattn._linear.dplr`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._arrays import vary

__all__ = ["Forms", "run"]


class Forms(NamedTuple):
    """A family's two forms (module docstring)."""

    recurrent: Callable[..., tuple[Array, Array]]
    chunked: Callable[..., tuple[Array, Array]]


def run(
    forms: Forms, steps, state: Array, *, mode: str, chunk_size: int, precision: jax.lax.PrecisionLike
) -> tuple[Array, Array]:
    """``out (*lead, T, E)`` (0 at dropped steps) and the final state ``(*lead, D, E)`` of prepared steps.

    ``steps``: the family's prepared steps, their first eight entries arrays (or None) that vary like the state
    inside ``shard_map``, and ``keep (*lead, T)``.
    """
    state = vary(state, *(x for x in steps[:8] if x is not None))  # inside shard_map: as the steps vary
    if mode == "recurrent":
        out, state = forms.recurrent(steps, state, precision)
    else:
        out, state = forms.chunked(steps, state, chunk_size, precision)
    return jnp.where(steps.keep[..., None], out, 0.0), state
