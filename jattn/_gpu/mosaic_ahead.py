"""Tiles copied a step ahead: a Mosaic GPU kernel's loop over one axis' blocks, with two buffers of their tiles.

While tile ``n`` is computed, TMA copies block ``n + 1``'s tiles into the other buffer (the one tile ``n - 1``
read: its products awaited, and with ``loads`` its register loads committed). EMPTY tiles are neither copied nor
awaited nor computed: a copy and its wait go together, as a barrier's phase advances a copy at a time. With one
buffer (where two would not fit shared memory) each tile's copies come just before it, awaited at once.
"""

from __future__ import annotations

from collections.abc import Callable

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._masks import EMPTY

__all__ = ["ahead", "copy_keys"]


def ahead(bounds: tuple, kind: Callable, copy: Callable, tile: Callable, barriers, init, *, buffers: int, loads: bool):
    """``tile(n, slot, carry) -> carry`` over the blocks ``n`` in ``bounds = (lo, hi)`` whose ``kind(n)`` is not EMPTY.

    ``copy(n, slot)`` issues block ``n``'s TMA copies into buffer ``slot``, each arriving on its barrier of
    ``barriers`` (each a ``Barrier(num_barriers=2)``), awaited before ``tile`` reads the buffer. ``buffers``: 2
    (copies a step ahead) or 1. ``loads``: the tiles are also read into registers (a ``commit_smem`` before
    TMA overwrites them); products alone need none.
    """
    lo, hi = bounds

    def fetch(n, slot):
        def issue():
            if loads:
                plgpu.commit_smem()
            copy(n, slot)

        pl.when(kind(n) != EMPTY)(issue)

    def step(n, carry):
        if buffers == 2:
            slot = lax.rem(n - lo, 2)
            pl.when(n + 1 < hi)(lambda: fetch(n + 1, 1 - slot))
        else:
            slot = 0
            fetch(n, slot)

        def body(carry):
            for bar in barriers:
                plgpu.barrier_wait(bar.at[slot])
            return tile(n, slot, carry)

        return lax.cond(kind(n) == EMPTY, lambda c: c, body, carry)

    if buffers == 2:
        pl.when(lo < hi)(lambda: fetch(lo, 0))
    return lax.fori_loop(lo, hi, step, init)


def copy_keys(spec, refs, buffers, r, j, slot) -> None:
    """A ``copy`` for :func:`ahead` over key blocks: block ``j``'s k and v tiles of query row ``r`` into ``slot``.

    ``refs``: k and v in global memory (kv row ``r // G``); ``buffers``: their shared tiles and barriers.
    """
    g, (k_ref, v_ref), (k_s, v_s, bar_k, bar_v) = spec.grid, refs, buffers
    at = (lax.div(r, spec.G), pl.ds(j * g.bk, g.bk))
    plgpu.copy_gmem_to_smem(k_ref.at[at], k_s.at[slot], bar_k.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[at], v_s.at[slot], bar_v.at[slot])
