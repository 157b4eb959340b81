"""A mask inside one call: the leading shape it shares with q, k, v, and its row form.

A call's leading shape ``lead`` broadcasts q, k, v, bias, the mask's explicit arrays and a
per-example mask's batch (:func:`call_lead`); the blockwise and kernel paths read the mask per
row of ``lead`` flattened (:func:`as_rows`, :func:`call_rows`). :func:`array_leaves` and
:func:`example_lead` find what of the mask adds to that shape.
"""

from __future__ import annotations

import numpy as np
from jax import Array

from jattn._checks import broadcast_all
from jattn._example_masks import PerExample
from jattn._mask_base import ArrayMask, Combination, Mask, check_lengths

__all__ = ["array_leaves", "as_rows", "call_lead", "call_rows", "example_lead"]


def _leaves_of(mask: Mask | None, kind: type) -> list:
    """The leaves of ``mask`` of type ``kind``, left to right (through its ``&``, ``|``, ``~``)."""
    if isinstance(mask, Combination):
        return [leaf for part in mask._parts() for leaf in _leaves_of(part, kind)]
    return [mask] if isinstance(mask, kind) else []


def array_leaves(mask: Mask | None) -> list[ArrayMask]:
    """The explicit boolean arrays inside ``mask`` (its :class:`ArrayMask` leaves), left to right."""
    return _leaves_of(mask, ArrayMask)


def example_lead(mask: Mask | None, ndim: int) -> tuple[int, ...]:
    """The leading shape ``(B, 1, ...)`` (rank ``ndim - 2``) that a per-example mask adds to q's, or ``()``.

    ``ndim`` is q's rank; a per-example mask reads q's first axis as the batch, so q needs one.
    """
    leaves = _leaves_of(mask, PerExample)
    if not leaves:
        return ()
    if ndim < 3:
        raise ValueError(f"a per-example mask needs a batch axis in q, got q of rank {ndim}")
    sizes = {leaf.batch for leaf in leaves} - {1}
    if len(sizes) > 1:
        raise ValueError(f"per-example masks must share the batch B, got batches {sorted(sizes)} in {mask!r}")
    return (max(sizes, default=1),) + (1,) * (ndim - 3)


def as_rows(mask: Mask, lead: tuple[int, ...], axis: int = 0) -> Mask:
    """``mask`` with its array leaves as rows ``(R|1, ...)`` of ``lead`` flattened (:meth:`Mask._rows`).

    A per-example leaf's batch is axis ``axis`` of ``lead`` (where q's first axis lands).
    """
    return mask._rows(lead, axis)


def call_lead(mask: Mask, q: Array, k: Array, v: Array | None, bias: Array | None) -> tuple[tuple[int, ...], int]:
    """``(lead, axis)``: the call's leading shape and the axis of it where q's first axis lands.

    ``lead`` broadcasts q, k, v, bias, the mask's arrays (each checked against q and k) and a
    per-example mask's batch, which lies on ``lead[axis]``.
    """
    T, S = q.shape[-2], k.shape[-2]
    check_lengths(mask, T, S)
    lead = broadcast_all(q=q, k=k, v=v, bias=bias)
    leads = [broadcast_all(q=q, k=k, v=v, mask=a.array) for a in array_leaves(mask)]
    batch = example_lead(mask, q.ndim)
    try:
        lead = tuple(np.broadcast_shapes(lead, *leads, batch))
    except ValueError:
        raise ValueError(
            f"leading dimensions do not broadcast: q {q.shape}, k {k.shape}"
            + ("" if v is None else f", v {v.shape}")
            + ("" if bias is None else f", bias {bias.shape}")
            + "".join(f", mask array {a.array.shape}" for a in array_leaves(mask))
            + (f", the mask's batch {batch} (a per-example mask's B on q's first axis)" if batch else "")
        ) from None
    return lead, len(lead) - (q.ndim - 2)


def call_rows(mask: Mask, q: Array, k: Array, v: Array | None, bias: Array | None) -> tuple[tuple[int, ...], Mask]:
    """``(lead, rows)``: the call's leading shape (:func:`call_lead`) and ``mask`` as rows of it flattened."""
    lead, axis = call_lead(mask, q, k, v, bias)
    return lead, as_rows(mask, lead, axis)
