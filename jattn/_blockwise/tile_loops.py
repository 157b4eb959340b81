"""The loops of the blockwise path: groups of rows of B in turn, and a query block's key blocks in order.

:func:`by_group` runs a kernel over groups of rows of the flattened leading axis B, one after
another (:meth:`jattn._blockwise.plan.Plan.group`), each group reading its rows of the whole arrays
through :class:`Rows`; :func:`sweep` runs a query block over its scheduled key blocks
(:class:`jattn._blockwise.tiles.Schedule`). :func:`put` and :func:`add_block` write a block of a loop's
result in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._arrays import Tree
from jattn._blockwise.plan import Plan
from jattn._masks import FULL

__all__ = ["Rows", "add_block", "by_group", "put", "sweep"]


class Rows(NamedTuple):
    """One group's rows ``start .. start + size`` of the flattened leading axis B, read from the whole arrays.

    The group's blocks are sliced from ``(B, ...)`` inside the loops, so no group or blocked
    copy of q, k, v (or of out and its cotangent) is ever made (T=32768: 5 copies of 32 MiB).
    """

    start: Array | int
    size: int

    def of(self, x: Array) -> Array:
        """``x (B, ...)`` -> the group's ``(size, ...)``."""
        return x if x.shape[0] == self.size else jax.lax.dynamic_slice_in_dim(x, self.start, self.size)

    def block(self, x: Array, n: Array, length: int) -> Array:
        """Block n ``(size, length, ...)`` of the group's rows of ``x (B, n·length, ...)``."""
        starts = tuple(jnp.asarray(i, jnp.int32) for i in (self.start, n * length, *(0,) * (x.ndim - 2)))
        return jax.lax.dynamic_slice(x, starts, (self.size, length, *x.shape[2:]))


def put(x: Array, n: Array, size: int, block: Array) -> Array:
    """``x (b, L, ...)`` with its block n ``(b, size, ...)`` replaced by ``block`` (in place in a loop)."""
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), n * size, axis=1)


def add_block(xt: Array, n: Array, size: int, block: Array) -> Array:
    """``xt (b, X, L)`` with ``block (b, X, size)`` added to its columns ``n·size ..`` (in place in a loop)."""
    start = n * size
    return jax.lax.dynamic_update_slice_in_dim(xt, jax.lax.dynamic_slice_in_dim(xt, start, size, 2) + block, start, 2)


def by_group(plan: Plan, body, xs: tuple[Array, ...], arrays: tuple[Array, ...]):
    """``body(xs, arrays, group)`` over groups of ``plan.group(B)`` rows of B, one group after another.

    Each of ``xs`` is ``(B, ...)`` and passed whole, ``group`` (:class:`Rows`) says which rows are
    the group's; mask ``arrays`` are ``(B|1, ...)`` (shared when 1) and passed as the group's rows.
    ``body`` returns ``(rows, summed)``: the leaves of ``rows`` are ``(group, ...)`` and come back as
    ``(B, ...)``; those of ``summed`` (gradients of shared arrays) are summed over the groups.
    """
    b = xs[0].shape[0]
    h = plan.group(b)
    if h == b:
        return body(xs, arrays, Rows(0, b))

    def one(start):
        group = Rows(start, h)
        return body(xs, tuple(group.of(a) if a.shape[0] != 1 else a for a in arrays), group)

    out, summed = jax.lax.map(one, jnp.arange(0, b, h, dtype=jnp.int32))
    return jax.tree.map(lambda y: y.reshape(b, *y.shape[2:]), out), jax.tree.map(lambda y: y.sum(0), summed)


def sweep(
    plan: Plan,
    key_block: Callable[[Tree, tuple[Array, Array | int]], tuple[Tree, None]],
    carry: Tree,
    i: Array,
    index,
    kind,
    static: bool,
) -> Tree:
    """``key_block(carry, (j, kind))`` over query block i's scheduled key blocks, in order.

    On CPU, where query blocks have different numbers of key blocks (causal, windows), the
    loop runs that block's count, not the schedule's padded width (whose EMPTY entries would
    each still cost a branch). Elsewhere a loop of unknown trip count would read its
    condition back to the host every step: the padded scan is kept. With ``static`` kinds
    (no mask arrays) a CPU loop takes a block's leading FULL tiles first with ``kind`` the
    int FULL, no branch: a branch's result is copied into the loop's state every step (the
    forward's accumulator, 6.5 us of a 270 us 1024 x 128 tile on one thread). A plan's
    reverse-differentiable loops (``plan.remat``) are a padded scan whose body is checkpointed, so
    differentiating them keeps each step's carry, not its tiles.
    """
    tiles = plan.tiles
    if plan.remat:  # reverse-differentiable: a scan of static length, its body recomputed in the backward
        return jax.lax.scan(jax.checkpoint(key_block), carry, (index[i], kind[i]))[0]
    lead = tiles.lead and static  # FULL tiles first, unbranched
    if not lead and not (plan.platform == "cpu" and np.any(tiles.count != tiles.count[0])):
        return jax.lax.scan(key_block, carry, (index[i], kind[i]))[0]

    def loop(start, stop, carry, full: bool) -> Tree:
        def step(n: Array, carry: Tree) -> Tree:
            return key_block(carry, (index[i, n], FULL if full else kind[i, n]))[0]

        return jax.lax.fori_loop(start, stop, step, carry)

    count = jnp.asarray(tiles.count)
    if not lead:
        return loop(0, count[i], carry, full=False)
    full = jnp.asarray(tiles.full)
    return loop(full[i], count[i], loop(0, full[i], carry, full=True), full=False)
