"""The derivatives of ring attention at every order: a custom JVP whose tangent is a linear pair.

As for the blockwise path (:mod:`jattn._blockwise.rules`): :func:`ring` is a ``jax.custom_jvp`` whose
rule calls it for the primal and :data:`PAIR` (:class:`jattn._autodiff.linear_pair.LinearPair`) for the
tangent: forward mode runs the tangent ring (:func:`jattn._ring.sweeps.tangent`), reverse mode its
transpose, the backward ring (:func:`jattn._ring.sweeps.backward`), and second order both with
each step checkpointed. The operands are flat: ``res = (q, k, v, q_seg, kv_seg, rows, sinks,
*consts, out, lse)``, the linear ones ``(dq, dk, dv, d sinks, *d consts)`` or ``(d out, d lse)``.
Under ``vmap`` the pair maps the call element by element.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name

from jattn._arrays import CHECKPOINT_NAMES
from jattn._autodiff import LinearPair
from jattn._ring.sweeps import Ring, backward, forward, tangent

__all__ = ["ring"]


class Call(NamedTuple):
    """The static part of one call of the pair: the ring, precision and the score modification's array count."""

    ring: Ring
    precision: Any
    consts: int

    def split(self, res: list) -> tuple:
        """``res`` as ``(q, k, v, q_seg, kv_seg, rows, sinks, consts, out, lse)``."""
        *head, out, lse = res
        return (*head[:7], tuple(head[7:]), out, lse)


@functools.partial(jax.custom_jvp, nondiff_argnums=(8, 9))
def ring(q, k, v, q_seg, kv_seg, rows, sinks, consts, ring: Ring, precision) -> tuple[Array, Array, Array]:
    """``out (B, T, E)``, ``lse (B, T)`` and the row max logit ``(B, T)`` (:func:`jattn._ring.sweeps.forward`)."""
    return forward(q, k, v, q_seg, kv_seg, rows, sinks, consts, ring, precision)


@ring.defjvp
def _ring_jvp(ring_: Ring, precision, primals, tangents):
    q, k, v, q_seg, kv_seg, rows, sinks, consts = primals
    out, lse, top = ring(*primals, ring_, precision)
    out, lse = (checkpoint_name(x, name) for x, name in zip((out, lse), CHECKPOINT_NAMES, strict=True))
    dq, dk, dv, _, _, _, d_sinks, d_consts = tangents
    res = [q, k, v, q_seg, kv_seg, rows, sinks, *consts, out, lse]
    d_out, d_lse = PAIR.apply(Call(ring_, precision, len(consts)), res, [dq, dk, dv, d_sinks, *d_consts])
    return (out, lse, top), (d_out, d_lse, jnp.zeros_like(top))


def _impl(direction: int, call: Call, res: list, lin: list, remat: bool = False) -> list:
    """The tangent ring (direction 0) or the backward ring (1) at ``res`` on ``lin``."""
    res = call.split(res)
    if direction == 0:
        dq, dk, dv, d_sinks, *d_consts = lin
        return list(tangent(res, (dq, dk, dv, d_sinks, tuple(d_consts)), call.ring, call.precision, remat))
    dq, dk, dv, d_sinks, d_consts = backward(res, *lin, call.ring, call.precision, remat)
    return [dq, dk, dv, d_sinks, *d_consts]


def _avals(direction: int, call: Call, res: list, lin: list) -> list:
    """The types of the outputs: those of ``out`` and ``lse``, or of q, k, v, sinks and the consts."""
    q, k, v, _, _, _, sinks, consts, out, lse = call.split(res)
    return [out, lse] if direction == 0 else [q, k, v, sinks, *consts]


PAIR = LinearPair(
    "jattn_ring",
    fast=_impl,
    diff=functools.partial(_impl, remat=True),
    avals=_avals,
    fold=lambda call, args, dims: None,  # vmap maps the ring element by element
)
