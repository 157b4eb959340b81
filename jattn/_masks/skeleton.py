"""A mask split into a static skeleton and its arrays, and put together again.

A kernel compiled once for a mask's structure takes the mask as a hashable skeleton, each array
leaf replaced by a slot (:func:`split_arrays`), and its arrays as operands, which may be sliced
by rows in between; :func:`fill_arrays` rebuilds the mask inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax import Array

from jattn._masks.base import Combination, Leaf, Mask
from jattn._masks.predicates import PredicateKind

__all__ = ["fill_arrays", "is_slot", "map_slots", "shared_arrays", "split_arrays"]


@dataclasses.dataclass(frozen=True)
class _Slot(Mask):
    """Where an array leaf stood in a static skeleton (see :func:`split_arrays`)."""

    index: int  # its first array in the list
    kind: Any  # makes the leaf from its arrays: ArrayMask, RowPadding, RowSegments or a PredicateKind
    shapes: tuple[tuple[int, ...], ...]

    has_arrays = True


def split_arrays(mask: Mask) -> tuple[Mask, tuple[Array, ...]]:
    """``(skeleton, arrays)``: a hashable mask with each array leaf replaced by a slot, and the arrays.

    The skeleton's static :meth:`Mask.block_kinds` treats the slots as unknown (every tile
    partial); :func:`fill_arrays` puts the arrays back.
    """
    arrays: list[Array] = []

    def split(m: Mask) -> Mask:
        if isinstance(m, Leaf):
            leaves = m.leaves()
            arrays.extend(leaves)
            return _Slot(len(arrays) - len(leaves), m.rebuilder(), tuple(x.shape for x in leaves))
        return m._with_parts([split(p) for p in m._parts()]) if isinstance(m, Combination) else m

    return split(mask), tuple(arrays)


def fill_arrays(skeleton: Mask, arrays: Sequence[Array]) -> Mask:
    """The inverse of :func:`split_arrays` (arrays may be reshaped, e.g. split by rows, in between)."""
    return map_slots(skeleton, lambda slot: slot.kind(*arrays[slot.index : slot.index + len(slot.shapes)]))


def map_slots(skeleton: Mask, fn: Callable[[Mask], Mask]) -> Mask:
    """The skeleton with each slot (:func:`is_slot`) replaced by ``fn(slot)``: e.g. a kernel's tile-local form of the leaf."""
    if isinstance(skeleton, _Slot):
        return fn(skeleton)
    if isinstance(skeleton, Combination):
        return skeleton._with_parts([map_slots(p, fn) for p in skeleton._parts()])
    return skeleton


def is_slot(m: Mask) -> bool:
    """Whether ``m`` (a part of a skeleton) stands for an array leaf: its ``kind`` makes the leaf, its arrays start at ``index``."""
    return isinstance(m, _Slot)


def shared_arrays(skeleton: Mask | None) -> tuple[int, ...]:
    """Indices, in :func:`split_arrays`'s list, of the arrays every row shares (a predicate's consts)."""
    if isinstance(skeleton, _Slot):
        if not isinstance(skeleton.kind, PredicateKind):
            return ()
        return tuple(range(skeleton.index + 2, skeleton.index + len(skeleton.shapes)))  # after batch, head
    if isinstance(skeleton, Combination):
        return tuple(i for p in skeleton._parts() for i in shared_arrays(p))
    return ()
