"""``vmap`` of jattn's own primitives: the mapped axis folded into the operands, or element by element."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["fold_or_map"]


def fold_or_map(bind: Callable[[list], list], folded, args: list, dims: list) -> tuple[list, list]:
    """A batching rule's result: ``bind`` (the primitive on flat operands) on ``folded``, else mapped.

    ``folded`` is ``(operands with the mapped axis folded in, unfold)`` (``unfold`` restores the axis
    on the outputs), or None where the operands cannot fold: then :func:`jax.lax.map` binds the
    primitive element by element over the mapped operands (``dims``: each one's axis or None).
    """
    if folded is not None:
        flat, unfold = folded
        outs = unfold(bind(flat))
        return outs, [0] * len(outs)
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs, strict=True):
            full[i] = x
        return bind(full)

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
    return outs, [0] * len(outs)
