"""Masks from a function of (batch, head, q_pos, kv_pos) (FlexAttention's ``mask_mod``) and their row form.

:class:`Predicate` holds the function as given (its constructor :func:`jattn.masks.predicate` is in
:mod:`jattn._masks.constructors`); inside a call it becomes :class:`PredicateRows`, the closure-converted
function with the (batch, head) of each row of B·N (:func:`lead_rows`) and the arrays it closes
over, which the kernels evaluate on every tile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._masks.base import Leaf, Mask, leaf_dataclass

__all__ = ["Predicate", "PredicateKind", "PredicateRows", "lead_rows"]


def lead_rows(lead: tuple[int, ...]) -> np.ndarray:
    """``(prod(lead), 2)`` int32 (batch, head) of each row of ``lead`` flattened.

    ``batch`` indexes the first leading axis, ``head`` the remaining ones flattened row-major.
    """
    b, n = math.prod(lead), math.prod(lead[1:])
    r = np.arange(b, dtype=np.int32)
    return np.stack([r // n, r % n], 1)


_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Predicate(Mask):
    """``fn(batch, head, q_pos, kv_pos) -> bool`` of scalars (FlexAttention's ``mask_mod``); see :func:`jattn.masks.predicate`."""

    fn: Any

    per_row = True

    def _rows(self, lead, axis=0):
        rows = jnp.asarray(lead_rows(lead))
        # Every array fn closes over (ints too, which jax.closure_convert would leave inside) becomes
        # an explicit argument, so no tracer of an enclosing trace is captured by the kernels.
        closed = jax.make_jaxpr(self.fn)(_INDEX, _INDEX, _INDEX, _INDEX)
        consts = tuple(jnp.asarray(c)[None] for c in closed.consts)
        return PredicateRows(_jaxpr_fn(closed.jaxpr), rows[:, 0], rows[:, 1], consts)

    def allowed(self, i, j):
        raise ValueError(
            "a masks.predicate reads the batch and head: it is evaluated inside attention calls, not on positions alone"
        )


def _jaxpr_fn(jaxpr) -> Any:
    """``fn(batch, head, q_pos, kv_pos, *consts)`` evaluating a predicate's jaxpr with its consts given."""

    def fn(b, h, i, j, *consts):
        return jax.core.eval_jaxpr(jaxpr, consts, b, h, i, j)[0]

    return fn


@dataclasses.dataclass(frozen=True)
class PredicateKind:
    """Rebuilds :class:`PredicateRows` around the converted ``fn`` (hashable: by the function)."""

    fn: Any

    def __call__(self, batch: Array, head: Array, *consts: Array) -> PredicateRows:
        """The rows of ``fn`` with these ``batch``, ``head`` ``(R,)`` and closed-over arrays."""
        return PredicateRows(self.fn, batch, head, consts)


@leaf_dataclass
class PredicateRows(Leaf):
    """:class:`Predicate` as rows: ``batch``, ``head`` ``(R,)`` int32 per row of B·N, and ``fn``'s closed-over arrays.

    ``fn(batch, head, q_pos, kv_pos, *consts)`` is the closure-converted predicate of scalars;
    each const carries a leading unit axis, so the kernels share it between rows of B.
    """

    fn: Any
    batch: Array
    head: Array
    consts: tuple = ()

    def leaves(self):
        return (self.batch, self.head, *self.consts)

    def rebuilder(self):
        return PredicateKind(self.fn)

    def allowed(self, i, j):  # i (t, 1), j (1, s) -> (R, t, s)
        consts = tuple(c[0] for c in self.consts)
        f = lambda b, h, q, kv: self.fn(b, h, q, kv, *consts)  # noqa: E731
        f = jax.vmap(f, (None, None, None, 0))
        f = jax.vmap(f, (None, None, 0, None))
        f = jax.vmap(f, (0, 0, None, None))
        return jnp.asarray(f(self.batch, self.head, i[:, 0], j[0]), bool)
