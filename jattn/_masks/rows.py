"""A mask inside one call: what it adds to the call's leading shape, and its row form.

A call's leading shape ``lead`` (:func:`jattn._checks.call_lead`) broadcasts q, k, v, bias, the
mask's explicit arrays and a per-example mask's batch: :func:`array_leaves` and
:func:`example_lead` find what of the mask adds to it. The blockwise and kernel paths read the
mask per row of ``lead`` flattened (:func:`as_rows`).
"""

from __future__ import annotations

from jattn._masks.base import ArrayMask, Combination, Mask
from jattn._masks.per_example import PerExample

__all__ = [
    "array_leaves",
    "as_rows",
    "example_lead",
]


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
