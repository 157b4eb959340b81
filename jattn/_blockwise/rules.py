"""The derivatives of blockwise attention at every order: a custom JVP whose tangent is a linear pair.

:func:`flash` is ``(out, lse, max logit)`` of padded, flattened operands (:mod:`jattn._blockwise.attention`),
a ``jax.custom_jvp``. Its rule computes the primal by calling :func:`flash` itself (so a derivative
of the rule finds the rule again) and the tangent with :data:`PAIR`
(:class:`jattn._autodiff.linear_pair.LinearPair`): forward mode runs the tangent sweep
(:mod:`jattn._blockwise.tangent`); reverse mode transposes it into the flash backward
(:mod:`jattn._blockwise.backward`), the hand-written one, at its first-order speed; second order
differentiates either in its residuals through their reverse-differentiable forms (the same sweeps
as ``lax.scan`` loops of static length with checkpointed bodies, :attr:`jattn._blockwise.plan.Plan.remat`),
so every order stays O(T) in memory. The max logit is a monitor: its tangent is 0.

The pair's operands are flat: ``res = (q, k, v, rows, seeds, sinks, *consts, *bias, kind, *arrays,
out, lse)`` and the linear ones ``(dq, dk, dv, d sinks, *d consts, *d bias)`` for the tangent,
``(d out, d lse)`` for the backward; :class:`Call` holds the plans and the counts that split them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name

from jattn._arrays import CHECKPOINT_NAMES, sum_to, vary
from jattn._autodiff import LinearPair, OnePassJvp
from jattn._blockwise.kernels import (
    backward_kernel,
    fold,
    fold_rows,
    forward_kernel,
    fused_backward_kernel,
    fused_forward_tangent,
    fused_tangent_kernel,
    regrouped,
    tangent_kernel,
    ungrouped,
)
from jattn._blockwise.plan import Plan, Run
from jattn._online import backward_rows, sink_grads

__all__ = ["flash"]


class Call(NamedTuple):
    """The static part of one call of the pair: the forward's plan, the backward's, precision and counts."""

    plan: Plan
    back: Plan
    precision: Any
    consts: int  # the score modification's arrays
    bias: int  # 0 or 1
    arrays: int  # the mask's arrays

    def split(self, res: list) -> tuple:
        """``res`` as ``(q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, out, lse)``."""
        q, k, v, rows, seeds, sinks, *rest = res
        consts, rest = tuple(rest[: self.consts]), rest[self.consts :]
        bias, (kind, *rest) = tuple(rest[: self.bias]), rest[self.bias :]
        arrays, (out, lse) = tuple(rest[: self.arrays]), rest[self.arrays :]
        return q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, out, lse

    def remat(self) -> Call:
        """The same call on the reverse-differentiable loops (:attr:`jattn._blockwise.plan.Plan.remat`), on XLA's tiles."""
        plan, back = (dataclasses.replace(p, fused=None, remat=True) for p in (self.plan, self.back))
        return self._replace(plan=plan, back=back)


@functools.partial(jax.custom_jvp, nondiff_argnums=(9, 10, 11))
def flash(
    q, k, v, rows, seeds, sinks, consts, bias, run: Run, plan: Plan, back: Plan, precision
) -> tuple[Array, Array, Array]:
    """``out (B, T, E)``, ``lse (B, T)`` and the row max logit ``(B, T)`` of padded q, k, v.

    ``q (B, T, D)``, ``k (B, S, D)``, ``v (B, S, E)``; ``rows (B, 2)`` int32 (batch, head) of each
    row for the score modification, ``seeds (B,)`` uint32 the dropout seed of each row (read only
    with ``plan.dropout``), ``sinks (B,)`` (read only with ``plan.sinks``), ``consts`` the
    modification's arrays; ``bias`` ``()`` or ``(bias (B|1, T|1, S|1),)`` padded like q and k.
    ``back`` is the backward's plan: ``plan`` itself, or the same call on tiles that divide
    ``plan``'s (the backward reads only per-row residuals, out and lse, so any tile recomputes them).
    """
    return forward_kernel(plan, precision)(q, k, v, rows, seeds, sinks, run.kind, run.arrays + bias, consts)[0]


@flash.defjvp
def _flash_jvp(plan: Plan, back: Plan, precision, primals, tangents):
    q, k, v, rows, seeds, sinks, consts, bias, run = primals
    dq, dk, dv, _, _, d_sinks, d_consts, d_bias, _ = tangents
    call = Call(plan, back, precision, len(consts), len(bias), len(run.arrays))
    xs, dxs = (
        [q, k, v, rows, seeds, sinks, *consts, *bias, run.kind, *run.arrays],
        [dq, dk, dv, d_sinks, *d_consts, *d_bias],
    )
    jvp = ONE_PASS.bind if plan.fused is not None else _two_pass  # the fused kernel's forward: both in one pass
    out, lse, top, d_out, d_lse, d_top = jvp(call, xs, dxs)
    return (out, lse, top), (d_out, d_lse, d_top)


def _two_pass(call: Call, xs: list, dxs: list) -> list:
    """``[out, lse, max logit, d out, d lse, 0]``: :func:`flash` (so higher orders find its rule) and :data:`PAIR`'s tangent."""
    q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, _, _ = call.split([*xs, None, None])
    out, lse, top = flash(
        q, k, v, rows, seeds, sinks, consts, bias, Run(kind, arrays), call.plan, call.back, call.precision
    )
    out, lse = (checkpoint_name(x, name) for x, name in zip((out, lse), CHECKPOINT_NAMES, strict=True))
    d_out, d_lse = PAIR.apply(call, [*xs, out, lse], dxs)
    return [out, lse, top, d_out, d_lse, jnp.zeros_like(top)]


def _impl(direction: int, call: Call, res: list, lin: list) -> list:
    """The tangent (direction 0) or the backward (1) of ``call`` at ``res`` on ``lin`` (:class:`jattn._autodiff.linear_pair.LinearPair`)."""
    if call.plan.kv_group > 1 and call.plan.fused is None:  # grouped k, v on XLA's tiles (second order)
        return _ungrouped(direction, call, res, lin)
    q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, out, lse = call.split(res)
    if direction == 0 and call.plan.fused is not None:  # the fused kernel's tangent (no sinks, bias or modification)
        dq, dk, dv, *_ = lin
        args = (q, k, v, dq, dk, dv, out, lse, rows, seeds, kind, arrays)
        outs = fused_tangent_kernel(*args, plan=call.plan, precision=None)
        return list(vary(outs, out, lse))
    if direction == 0:
        plan = call.plan
        dq, dk, dv, d_sinks, *rest = lin
        xs = (q, k, v, dq, dk, dv, out, lse, sinks, d_sinks)
        d_consts, d_bias = tuple(rest[: call.consts]), tuple(rest[call.consts :])
        outs = tangent_kernel(
            xs, rows, seeds, kind, arrays + bias, d_bias, consts, d_consts, plan=plan, precision=call.precision
        )
        return list(vary(outs, out, lse))  # as out and lse vary under shard_map
    return list(_backward(call, q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, out, lse, *lin))


def _backward(call: Call, q, k, v, rows, seeds, sinks, consts, bias, kind, arrays, out, lse, d_out, d_lse) -> tuple:
    """``(dq, dk, dv, d sinks, *d consts, *d bias)``: one sweep over ``call.back``'s tiles per group."""
    plan, back = call.plan, call.back
    if plan.fused is not None:  # the fused kernel's backward (no sinks, bias or modification)
        args = (q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays)
        dq, dk, dv = fused_backward_kernel(*args, plan=plan, precision=None)
        dq, dk, dv = sum_to(vary((dq, dk, dv), q, k, v, d_out, *arrays), (q, k, v))  # as q, k, v vary under shard_map
        return dq, dk, dv, jnp.zeros_like(sinks)
    kind = kind if back == dataclasses.replace(plan, fused=None) else back.run(arrays).kind
    backward = functools.partial(backward_kernel, plan=back, precision=call.precision)
    ((dq, dk, dv), own), (d_consts, shared) = backward(
        q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays + bias, consts
    )
    d_sinks = jnp.zeros_like(sinks)
    if plan.sinks:
        _, delta = backward_rows(out, d_out, lse, plan.compute, d_lse)
        d_sinks = sink_grads(sinks[:, None].astype(plan.compute), lse, delta).sum(-1).astype(sinks.dtype)
    grads = sum_to((dq, dk, dv, d_sinks, d_consts, own + shared), (q, k, v, sinks, consts, bias))  # for shard_map
    dq, dk, dv, d_sinks, d_consts, d_bias = grads
    return dq, dk, dv, d_sinks, *d_consts, *d_bias


def _ungrouped(direction: int, call: Call, res: list, lin: list) -> list:
    """:func:`_impl` with k and v (and their tangents) repeated for every row of q, their gradients summed back."""
    (k, v), plan = ungrouped(call.plan, res[1], res[2])
    res = [res[0], k, v, *res[3:]]
    if direction == 0:
        lin = [lin[0], *ungrouped(call.plan, lin[1], lin[2])[0], *lin[3:]]
    outs = _impl(direction, call._replace(plan=plan, back=dataclasses.replace(call.back, kv_group=1)), res, lin)
    return outs if direction == 0 else [outs[0], *regrouped(call.plan, outs[1], outs[2]), *outs[3:]]


def _diff(direction: int, call: Call, res: list, lin: list) -> list:
    """:func:`_impl` on the reverse-differentiable loops (second order)."""
    return _impl(direction, call.remat(), res, lin)


def _avals(direction: int, call: Call, res: list, lin: list) -> list:
    """The types of the outputs: those of ``out`` and ``lse`` (the tangent), of q, k, v, sinks, consts, bias (the backward)."""
    q, k, v, _, _, sinks, consts, bias, _, _, out, lse = call.split(res)
    return [out, lse] if direction == 0 else [q, k, v, sinks, *consts, *bias]


def _fold(call: Call, args: list, dims: list):
    """``vmap``'s mapped axis folded into B, as the forward folds it (:func:`jattn._blockwise.kernels.folding`).

    Not where a score modification or a bias is given, or an array every row shares is mapped
    (None: the pair maps them element by element).
    """
    plan = call.plan
    nres = 6 + call.consts + call.bias + 1 + call.arrays + 2
    kind_at = 6 + call.consts + call.bias
    arrays = range(kind_at + 1, kind_at + 1 + call.arrays)
    if plan.mod is not None or plan.bias or any(dims[kind_at + 1 + i] is not None for i in plan.shared):
        return None
    n = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    b = next(x.shape[1] if d is not None else x.shape[0] for x, d in zip(args[:nres], dims, strict=False))
    folded = [
        x
        if x is None
        else fold_rows(x, d is not None, n, b)
        if i == kind_at or i in arrays
        else fold(x, d is not None, n)  # its own rows: k and v of a grouped plan have fewer than q
        for i, (x, d) in enumerate(zip(args, dims, strict=True))
    ]  # None: a slot the one-pass jvp does not fill (out and lse)
    return folded, lambda outs: [y.reshape(n, -1, *y.shape[1:]) for y in outs]


PAIR = LinearPair("jattn_blockwise", fast=_impl, diff=_diff, avals=_avals, fold=_fold)


def _one_pass(call: Call, xs: list, dxs: list) -> list:
    """The fused kernel's forward and tangent in one pass (only where the plan is fused: no sinks, bias, modification)."""
    q, k, v, *_, arrays, _, _ = call.split([*xs, None, None])
    dq, dk, dv, *_ = dxs
    out, lse, top, d_out, d_lse = fused_forward_tangent(q, k, v, dq, dk, dv, arrays, plan=call.plan)
    return [out, lse, top, d_out, d_lse, jnp.zeros_like(top)]


def _one_pass_avals(call: Call, xs: list, dxs: list) -> list:
    """float32 ``out (B, T, E)``, ``lse``, max logit ``(B, T)`` and their tangents (the max logit's: 0)."""
    (b, t, _), e = xs[0].shape, xs[2].shape[-1]
    varying = frozenset().union(*(x.manual_axis_type.varying for x in (*xs, *dxs)))  # under shard_map
    like = xs[0].update(
        dtype=jnp.float32, weak_type=False, manual_axis_type=xs[0].manual_axis_type.update(varying=varying)
    )
    out, row = like.update(shape=(b, t, e)), like.update(shape=(b, t))
    return [out, row, row, out, row, row]


def _one_pass_fold(call: Call, args: list, dims: list):
    """``vmap``'s axis folded into B as :func:`_fold` folds the pair's (``out`` and ``lse`` stand in for their slots)."""
    nxs = 6 + call.consts + call.bias + 1 + call.arrays
    stand_in = [None, None]
    folded = _fold(call, [*args[:nxs], *stand_in, *args[nxs:]], [*dims[:nxs], *stand_in, *dims[nxs:]])
    if folded is None:
        return None
    flat, unfold = folded
    return [*flat[:nxs], *flat[nxs + 2 :]], unfold


#: ``flash`` and its tangent in one primitive where the forward is the fused CPU kernel's: jvp in one
#: pass (2.9x the forward, not two sweeps' 3.4x); linearisation splits it into ``flash`` and :data:`PAIR`.
ONE_PASS = OnePassJvp(
    "jattn_blockwise_jvp", primals=3, fast=_one_pass, split=_two_pass, avals=_one_pass_avals, fold=_one_pass_fold
)
