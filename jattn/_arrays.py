"""Array conventions every path shares: the compute dtype, the leading dims as rows, shard_map's varying axes.

Dimension key as in :mod:`jattn._core`. Every path accumulates in :func:`compute_dtype`; flattens the leading
dims of ``(..., L, X)`` operands to one axis ``B`` of rows (:func:`flat_lead`), whose (batch, head) a score
modification reads (:func:`head_rows`, :func:`lead_index`); inside ``shard_map`` marks a fresh loop state as
varying like its inputs (:func:`vary`) and sums a gradient over the axes its primal does not vary over
(:func:`sum_to`); and names attention's output and log-sum-exp for ``jax.checkpoint`` policies
(:data:`CHECKPOINT_NAMES`).
"""

from __future__ import annotations

import math
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import Array

from jattn._masks import lead_rows

__all__ = ["CHECKPOINT_NAMES", "Tree", "compute_dtype", "flat_lead", "head_rows", "lead_index", "sum_to", "vary"]

Tree = TypeVar("Tree")  # a pytree of arrays


#: The names (:func:`jax.ad_checkpoint.checkpoint_name`) of attention's output and log-sum-exp, on the
#: residuals the backward reads and on :func:`jattn.attention`'s results: a ``jax.checkpoint`` policy
#: ``save_only_these_names(*CHECKPOINT_NAMES)`` keeps them, so its backward recomputes no forward.
CHECKPOINT_NAMES = ("jattn_out", "jattn_lse")


def compute_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, float32 for everything else (the softmax is never done in 16 bits)."""
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def flat_lead(x: Array, lead: tuple[int, ...]) -> Array:
    """``(..., L, X)`` broadcast to the leading shape ``lead`` and flattened: ``(B, L, X)``."""
    return jnp.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(math.prod(lead), *x.shape[-2:])


def head_rows(lead: tuple[int, ...]) -> Array:
    """``(B, 2)`` int32: the (batch, head) of each row of the leading shape ``lead`` flattened to ``B``.

    ``batch`` indexes the first leading axis, ``head`` the remaining ones flattened row-major
    (``(B, K, G)``: head = k·G + g); both 0 where there is no such axis.
    """
    return jnp.asarray(lead_rows(lead))


def lead_index(lead: tuple[int, ...]) -> tuple[Array, Array]:
    """``batch`` and ``head`` (:func:`head_rows`) unflattened: ``(B|1, 1, ..., 1, 1, 1)`` and ``(1, *lead[1:], 1, 1)``."""
    rows = lead_rows(lead).reshape(*lead, 2)
    batch = rows[..., 0][(slice(None),) + (slice(0, 1),) * (len(lead) - 1)] if lead else rows[..., 0]
    head = rows[..., 1][:1] if lead else rows[..., 1]
    return jnp.asarray(batch[..., None, None]), jnp.asarray(head[..., None, None])


def vary(tree: Tree, *like: Array) -> Tree:
    """Marks the arrays of ``tree`` as varying over every manual mesh axis one of ``like`` varies over.

    Inside ``shard_map`` (with its default ``check_vma``) a loop's fresh initial state (zeros,
    ``-inf``) must vary over the mesh axes its updates from q, k, v do; outside it this is the identity.
    """
    axes = set().union(*(jax.typeof(x).manual_axis_type.varying for x in like))

    def one(x):
        missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def sum_to(grads: Tree, primals) -> Tree:
    """Each gradient summed over the manual mesh axes it varies over and its primal does not.

    Inside ``shard_map`` an input that is the same on every device of an axis (sinks against a
    batch-sharded q) gets one gradient from each: a custom VJP returns their sum, as JAX's own
    transpose of the implicit broadcast would. Outside it this is the identity.
    """

    def one(g, x):
        extra = tuple(sorted(set(jax.typeof(g).manual_axis_type.varying) - set(jax.typeof(x).manual_axis_type.varying)))
        return jax.lax.psum(g, extra) if extra else g

    return jax.tree.map(one, grads, primals)
