"""The GPU kernel's derivatives at every order: a custom JVP whose tangent is a linear pair.

:func:`attend` is ``(o, lse, max logit)`` of the padded operands (the forward kernel), a ``jax.custom_jvp``
(the max logit is a monitor: its tangent is 0). Its
rule calls :func:`attend` itself for the primal and :data:`PAIR` (a
:class:`jattn._autodiff.LinearPair`) for the tangent, as the blockwise path does
(:mod:`jattn._blockwise.rules`):

* forward mode (``jvp``, ``jacfwd``) runs the forward and its tangent as one kernel (:data:`ONE_PASS`,
  a :class:`jattn._autodiff.OnePassJvp`), O(T) memory; where JAX splits it (``linearize``, reverse
  mode over it) the forward kernel and the tangent kernel;
* reverse mode transposes the tangent into the dq and dk/dv kernels, the hand-written backward;
* second order (grad of grad, jvp of grad, Hessians) differentiates either in its residuals through
  ``Call.second``, the same call on the reference path (the blockwise path, XLA tiles, differentiable
  to any order in O(T) memory), which reads the score modification's row values and the mask's
  arrays as operands, the kernel's own (so a second derivative reaches the arrays a score mod closes
  over, ALiBi's slopes being learned, and a ``vmap`` folded into the rows maps the mask's arrays with
  them). It is refused by name where there is no reference path.

The pair's operands are flat: ``res = (q, k, v, sinks, *consts, kinds, fb, tb, seeds, *masks, o, lse)``,
the linear ones ``(dq, dk, dv, d sinks, *d floating consts)`` for the tangent, ``(d o, d lse)``
for the backward; :class:`Call` holds the static facts and the counts that split them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._autodiff import LinearPair, OnePassJvp
from jattn._gpu import kernels, mosaic_kernels
from jattn._gpu.kernels import Spec
from jattn._gpu.score_mod import merge

__all__ = ["attend"]

#: The kernels of each ``Spec.backend``: one module each, the same functions and signatures.
KERNELS = {"triton": kernels, "mosaic_gpu": mosaic_kernels, "mosaic_gpu_tcgen05": mosaic_kernels}


class Call(NamedTuple):
    """The static part of one call of the pair: the kernels' :class:`Spec`, the reference path and counts."""

    spec: Spec
    second: Callable | None  # (q, k, v, sinks, seeds, masks, values) -> (o, lse) on the padded operands, to any order
    consts: int  # the score modification's row values

    @property
    def floats(self) -> tuple[bool, ...]:
        """Which row values are floating (they have tangents and gradients)."""
        return () if self.spec.mod is None else self.spec.mod.floats

    def split(self, res: list) -> tuple:
        """``res`` as ``(q, k, v, sinks, consts, (kinds, fb, tb, seeds, masks), o, lse)``."""
        q, k, v, sinks, *rest = res
        consts, (kinds, fb, tb, seeds, *rest) = tuple(rest[: self.consts]), rest[self.consts :]
        return q, k, v, sinks, consts, (kinds, fb, tb, seeds, tuple(rest[:-2])), rest[-2], rest[-1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def attend(spec: Spec, second: Callable | None, q, k, v, sinks, consts, ints) -> tuple[Array, Array, Array]:
    """``(o (b, Tp, Ep), lse (b, Tp), max logit (b, Tp))`` of the padded operands (:func:`jattn._gpu.kernels.forward`).

    ``ints = (kinds, fb, tb, seeds, masks)``: the tile kinds, their bounds over key and query blocks, each
    row's dropout seed (uint32, :func:`jattn._dropout.row_seeds`), the mask's arrays.
    ``second``: the reference path on the same operands (:class:`Call`), or None.
    """
    kinds, fb, _, seeds, masks = ints
    return KERNELS[spec.backend].forward(spec, q, k, v, kinds, fb, sinks, seeds, masks, consts)


@attend.defjvp
def _attend_jvp(spec: Spec, second, primals, tangents):
    q, k, v, sinks, consts, ints = primals
    dq_, dk, dv, dsinks, dconsts, _ = tangents
    kinds, fb, tb, seeds, masks = ints
    call = Call(spec, second, len(consts))
    xs = [q, k, v, sinks, *consts, kinds, fb, tb, seeds, *masks]
    dxs = [dq_, dk, dv, dsinks, *(d for d, f in zip(dconsts, call.floats, strict=True) if f)]
    o, lse, top, d_o, d_lse, d_top = ONE_PASS.bind(call, xs, dxs)
    return (o, lse, top), (d_o, d_lse, d_top)


def _two_pass(call: Call, xs: list, dxs: list) -> list:
    """``[o, lse, max logit, d o, d lse, 0]``: :func:`attend` (so higher orders find its rule) and :data:`PAIR`'s tangent."""
    q, k, v, sinks, consts, ints, _, _ = call.split([*xs, None, None])
    o, lse, top = attend(call.spec, call.second, q, k, v, sinks, consts, ints)
    d_o, d_lse = PAIR.apply(call, [*xs, o, lse], dxs)
    return [o, lse, top, d_o, d_lse, jnp.zeros_like(top)]


def _one_pass(call: Call, xs: list, dxs: list) -> list:
    """``[o, lse, max logit, d o, d lse, 0]`` from one kernel (:func:`jattn._gpu.kernels.forward_tangent`)."""
    q, k, v, sinks, consts, (kinds, fb, _, seeds, masks), _, _ = call.split([*xs, None, None])
    dq_, dk, dv, dsinks, *dconsts = dxs
    args = (q, k, v, dq_, dk, dv, kinds, fb, sinks, seeds, dsinks, masks, consts, dconsts)
    o, lse, top, d_o, d_lse = KERNELS[call.spec.backend].forward_tangent(call.spec, *args)
    return [o, lse, top, d_o, d_lse, jnp.zeros_like(top)]


def _one_pass_avals(call: Call, xs: list, dxs: list) -> list:
    """``o (b, Tp, Ep)`` in v's dtype, ``lse`` and the max logit ``(b, Tp)`` float32, and their tangents (the same types)."""
    q, v = xs[0], xs[2]
    o = v.update(shape=(q.shape[0], q.shape[1], v.shape[2]), weak_type=False)
    lse = q.update(shape=q.shape[:2], dtype=jnp.float32, weak_type=False)
    return [o, lse, lse, o, lse, lse]


def _fast(direction: int, call: Call, res: list, lin: list) -> list:
    """The tangent kernel (direction 0) or the dq and dk/dv kernels (1) at ``res`` on ``lin``."""
    spec = call.spec
    tangent, dq, dkdv = (getattr(KERNELS[spec.backend], n) for n in ("tangent", "dq", "dkdv"))
    q, k, v, sinks, consts, (kinds, fb, tb, seeds, masks), o, lse = call.split(res)
    if direction == 0:
        dq_, dk, dv, dsinks, *dconsts = lin
        args = (kinds, fb, sinks, seeds, dsinks, masks, consts, dconsts)
        return list(tangent(spec, q, k, v, o, lse, dq_, dk, dv, *args))
    do, dlse = lin
    do = do.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse
    dq_, dcs = dq(spec, q, k, v, do, lse, delta, kinds, fb, sinks, seeds, masks, consts)
    dk, dv = dkdv(spec, q, k, v, do, lse, delta, kinds, tb, sinks, seeds, masks, consts)
    dsinks = jnp.zeros_like(sinks)
    if spec.sinks:  # d sink = -sum_t e^(sink - lse_t) delta_t over the rows that see something
        finite = lse > -jnp.inf
        w = jnp.where(finite, jnp.exp(sinks[:, None] - jnp.where(finite, lse, 0.0)), 0.0)
        dsinks = -jnp.sum(w * delta, axis=-1)
    floating = (c for c, f in zip(consts, call.floats, strict=True) if f)
    dconsts = [jnp.sum(d, axis=1).astype(c.dtype) for d, c in zip(dcs, floating, strict=True)]
    return [dq_, dk, dv, dsinks, *dconsts]


def _diff(direction: int, call: Call, res: list, lin: list) -> list:
    """:func:`_fast` through the reference path, reverse-differentiable to any order (second order)."""
    if call.second is None:
        raise ValueError(
            "second-order derivatives (grad of grad, jvp of grad, hessian) of implementation='pallas' with no "
            "reference path: the kernel's derivatives have no derivative there; use 'blockwise' or 'dense'"
        )
    q, k, v, sinks, consts, (*_, seeds, masks), o, _ = call.split(res)

    def second(q, k, v, sinks, floating):
        return call.second(q, k, v, sinks, seeds, masks, merge(consts, call.floats, floating))

    floating = tuple(c for c, f in zip(consts, call.floats, strict=True) if f)
    if direction == 0:
        _, (d_o, d_lse) = jax.jvp(second, (q, k, v, sinks, floating), (*lin[:4], tuple(lin[4:])))
        return [d_o.astype(o.dtype), d_lse.astype(jnp.float32)]
    (o2, _), pull = jax.vjp(second, q, k, v, sinks, floating)
    do, dlse = lin
    *grads, dfloating = pull((do.astype(o2.dtype), dlse.astype(jnp.float32)))
    return [*grads, *dfloating]


def _avals(direction: int, call: Call, res: list, lin: list) -> list:
    """The outputs' types: ``o`` and ``lse`` (the tangent); q, k, v, sinks and the floating values (the backward)."""
    q, k, v, sinks, consts, _, o, lse = call.split(res)
    if direction == 0:
        return [o, lse]
    return [q, k, v, sinks, *(c for c, f in zip(consts, call.floats, strict=True) if f)]


def _pair_rows(call: Call, n_args: int) -> list[str]:
    """What each operand of :data:`PAIR` counts in its leading axis (``"q"``, ``"kv"`` or ``"shared"``).

    ``"q"``: the b rows of q; ``"kv"``: the b / G rows of k and v; ``"shared"``: a mask's R rows, or 1.
    """
    res = [*_xs_rows(call), "q", "q"]
    backward = n_args - len(res) == 2  # (d o, d lse); the tangent's are (dq, dk, dv, d sinks, *d consts)
    return res + (["q", "q"] if backward else _dxs_rows(call))


def _xs_rows(call: Call) -> list[str]:
    """:func:`_pair_rows` of ``(q, k, v, sinks, *consts, kinds, fb, tb, seeds, *masks)``."""
    return ["q", "kv", "kv", "q", *["q"] * call.consts, *["shared"] * 3, "q", *["shared"] * call.spec.n_mask]


def _dxs_rows(call: Call) -> list[str]:
    """:func:`_pair_rows` of the tangents ``(dq, dk, dv, d sinks, *d floating consts)``."""
    return ["q", "kv", "kv", "q", *["q"] * sum(call.floats)]


def _fold(rows: list[str], args: list, dims: list):
    """``vmap``'s mapped axis folded into the kernels' rows: ``n`` copies of every row, one a mapped index.

    ``rows`` says what each operand's leading axis counts (:func:`_pair_rows`). A mapped operand puts
    its axis first and merges it with its rows; an unmapped one is repeated ``n`` times (a mask array
    of one row shared by every row stays one row).
    """
    n = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    q, d = args[0], dims[0]
    b = q.shape[0] if d is None else q.shape[1 if d == 0 else 0]
    folded = []
    for x, d, kind in zip(args, dims, rows, strict=True):
        if d is None and kind == "shared" and x.shape[0] == 1:
            folded.append(x)
            continue
        x = jnp.broadcast_to(x, (n, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        if kind == "shared" and x.shape[1] == 1:
            x = jnp.broadcast_to(x, (n, b, *x.shape[2:]))
        folded.append(x.reshape(-1, *x.shape[2:]))
    return folded, lambda outs: [y.reshape(n, -1, *y.shape[1:]) for y in outs]


PAIR = LinearPair(
    "jattn_gpu",
    fast=_fast,
    diff=_diff,
    avals=_avals,
    fold=lambda call, args, dims: _fold(_pair_rows(call, len(args)), args, dims),
)

#: :func:`attend` and its tangent in one kernel; linearisation splits it into :func:`attend` and :data:`PAIR`.
ONE_PASS = OnePassJvp(
    "jattn_gpu_jvp",
    primals=3,
    fast=_one_pass,
    split=_two_pass,
    avals=_one_pass_avals,
    fold=lambda call, args, dims: _fold(_xs_rows(call) + _dxs_rows(call), args, dims),
)
