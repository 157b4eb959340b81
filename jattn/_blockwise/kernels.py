"""The kernels of one blockwise plan: forward, backward and tangent, group by group, and their ``vmap`` folding.

Shapes follow :mod:`jattn._core` with leading dimensions flattened to ``B`` (:mod:`jattn._blockwise.attention`).
Each kernel runs over groups of rows of B (:func:`jattn._blockwise.tile_loops.by_group`): the forward
(:mod:`jattn._blockwise.forward`), the backward (:mod:`jattn._blockwise.backward`) and the tangent
(:mod:`jattn._blockwise.tangent`), or, where the plan is fused, one custom call of :mod:`jattn._blockwise.fused_cpu`
for all of B (forward, backward, tangent, forward and tangent in one pass). The forward is
wrapped so that ``vmap`` folds the mapped axis into B (:func:`folding`); the backward and the
tangent are the two primitives of :mod:`jattn._blockwise.rules`, which fold by their own rule.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import Array
from jax.interpreters import mlir

from jattn._arrays import vary
from jattn._blockwise import fused_cpu as _fused_cpu
from jattn._blockwise.backward import backward as group_backward
from jattn._blockwise.forward import forward as group_forward
from jattn._blockwise.fused_rows import row_bounds
from jattn._blockwise.plan import Plan
from jattn._blockwise.tangent import tangent as group_tangent
from jattn._blockwise.tile_loops import Rows, by_group
from jattn._masks import EMPTY, LOWER, reduce_kinds
from jattn._online import backward_rows

__all__ = [
    "backward_kernel",
    "folding",
    "forward_kernel",
    "fused_backward_kernel",
    "fused_forward_tangent",
    "fused_tangent_kernel",
    "regrouped",
    "tangent_kernel",
    "ungrouped",
]


@functools.lru_cache(maxsize=256)
def forward_kernel(plan: Plan, precision):
    """The forward of one plan, ``(q, k, v, rows, seeds, sinks, kind, arrays, consts) -> ((out, lse, max), ())``, folding ``vmap``."""
    forward = functools.partial(_forward, plan=plan, precision=precision)
    return folding(forward, plan.mod is None and not plan.bias, plan.shared)


def _forward(q, k, v, rows, seeds, sinks, kind, arrays, consts, *, plan: Plan, precision) -> tuple:
    """``((out (B, T, E), lse (B, T), max logit (B, T)), ())``: the fused CPU kernel's, or group by group."""
    # one custom call over all of B (jattn._blockwise.fused_cpu), XLA's tiles under jax.export
    if plan.fused is not None:
        outs = _FUSED.bind(q, k, v, rows, seeds, sinks, kind, *arrays, plan=plan, precision=precision)
        # under shard_map, varying as its operands do (a custom call's results are not)
        return vary(tuple(outs), q, k, v, *arrays), ()
    (k, v), plan = ungrouped(plan, k, v)
    body = functools.partial(_forward_group, consts=consts, plan=plan, precision=precision)
    return by_group(plan, body, (q, k, v, rows, seeds, sinks), (kind, *arrays))


def _kernel_call(plan: Plan, arrays: tuple[Array, ...], T: int) -> dict:
    """The keyword arguments of :mod:`jattn._blockwise.fused_cpu`'s calls for a fused ``plan``.

    Keys, offsets, interval, scale, threads, and the per-example mask's row operands from the mask's
    ``arrays`` (:func:`jattn._blockwise.fused_rows.row_bounds`; ``T`` the kernels' padded query length).
    """
    return dict(length=plan.S, q_offset=plan.q_offset, kv_offset=plan.kv_offset, window=plan.fused, scale=plan.scale,
                threads=plan.threads, rows=row_bounds(plan.mask, arrays, T, plan.S), group=plan.kv_group)  # fmt: skip


def ungrouped(plan: Plan, *kv: Array) -> tuple[tuple[Array, ...], Plan]:
    """Rows of k and v (or of their tangents) for each row of q, and ``plan`` without groups (XLA's tiles take those).

    A grouped plan's k and v have a row per ``plan.kv_group`` rows of q (:attr:`jattn._blockwise.plan.Plan.kv_group`).
    """
    if plan.kv_group == 1:
        return kv, plan
    return tuple(jnp.repeat(x, plan.kv_group, axis=0) for x in kv), replace(plan, kv_group=1)


def regrouped(plan: Plan, *grads: Array) -> tuple[Array, ...]:
    """Gradients of :func:`ungrouped`'s rows summed back to a row per ``plan.kv_group`` rows of q."""
    return tuple(x.reshape(-1, plan.kv_group, *x.shape[1:]).sum(1) for x in grads)


def _fused(q, k, v, rows, seeds, sinks, kind, *arrays, plan: Plan, precision) -> list:
    """The fused CPU kernel's ``[out, lse, max logit]`` for ``plan`` (:func:`jattn._blockwise.fused_cpu.forward`)."""
    return list(_fused_cpu.forward(q, k, v, **_kernel_call(plan, arrays, q.shape[1])))


def _tiles(q, k, v, rows, seeds, sinks, kind, *arrays, plan: Plan, precision) -> list:
    """The same on XLA's tiles (what :func:`jax.export` serializes: no custom call it cannot carry)."""
    return list(
        _forward(q, k, v, rows, seeds, sinks, kind, arrays, (), plan=replace(plan, fused=None), precision=precision)[0]
    )


def _kernel_primitive(name: str, fused, tiles, avals) -> jex.core.Primitive:
    """One fused CPU kernel as a primitive: evaluated and lowered as ``fused`` (its custom call).

    Where the program is lowered for :func:`jax.export` it is ``tiles`` (XLA's): a portable artifact
    cannot carry the custom call. ``fused``, ``tiles`` and ``avals`` take the operands and ``plan=``, ``precision=``; only evaluated (the
    derivatives are :mod:`jattn._blockwise.rules`', which also batches them).
    """
    primitive = jex.core.Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(fused)
    primitive.def_abstract_eval(avals)

    def lowering(ctx, *args, plan: Plan, precision):
        impl = tiles if ctx.module_context.lowering_parameters.for_export else fused
        return mlir.lower_fun(impl, multiple_results=True)(ctx, *args, plan=plan, precision=precision)

    mlir.register_lowering(primitive, lowering)
    return primitive


def _fused_types(q, k, v, *_, plan: Plan, precision) -> list:
    """float32 ``out (B, T, E)``, ``lse`` and max logit ``(B, T)``."""
    (b, t, _), e = q.shape, v.shape[-1]
    return [jax.core.ShapedArray((b, t, e), jnp.float32), *(jax.core.ShapedArray((b, t), jnp.float32),) * 2]


#: The fused forward, batched by the forward's folding (:func:`folding`).
_FUSED = _kernel_primitive("jattn_fused_forward", _fused, _tiles, _fused_types)


def _fused_tangent(q, k, v, dq, dk, dv, out, lse, rows, seeds, kind, *arrays, plan: Plan, precision) -> list:
    """The fused CPU tangent's ``[d out, d lse]`` for ``plan`` (:func:`jattn._blockwise.fused_cpu.tangent`)."""
    return list(_fused_cpu.tangent(q, k, v, dq, dk, dv, out, lse, **_kernel_call(plan, arrays, q.shape[1])))


def _tiles_tangent(q, k, v, dq, dk, dv, out, lse, rows, seeds, kind, *arrays, plan: Plan, precision) -> list:
    """The same on XLA's tiles (under :func:`jax.export`)."""
    (k, v, dk, dv), plan = ungrouped(plan, k, v, dk, dv)
    xs = (q, k, v, dq, dk, dv, out, lse, jnp.zeros_like(lse[:, 0]), jnp.zeros_like(lse[:, 0]))
    plan = replace(plan, fused=None)
    return list(tangent_kernel(xs, rows, seeds, kind, arrays, (), (), (), plan=plan, precision=precision))


#: The fused tangent (forward mode where the forward is the fused kernel's), inside the tangent of the pair.
_FUSED_TANGENT = _kernel_primitive(
    "jattn_fused_tangent",
    _fused_tangent,
    _tiles_tangent,
    lambda *a, plan, precision: [jax.core.ShapedArray(x.shape, jnp.float32) for x in a[6:8]],
)


def fused_tangent_kernel(
    q, k, v, dq, dk, dv, out, lse, rows, seeds, kind, arrays, *, plan: Plan, precision
) -> tuple[Array, Array]:
    """``(d out (B, T, E), d lse (B, T))`` where ``plan``'s forward is the fused kernel's: its tangent, one custom call."""
    args = (q, k, v, dq, dk, dv, out, lse, rows, seeds, kind, *arrays)
    return tuple(_FUSED_TANGENT.bind(*args, plan=plan, precision=precision))


def _fused_backward(q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, *arrays, plan: Plan, precision) -> list:
    """The fused CPU backward's ``[dq, dk, dv]`` in q, k, v's dtypes (:func:`jattn._blockwise.fused_cpu.backward`)."""
    _, delta = backward_rows(out, d_out, lse, jnp.float32, d_lse)
    grads = _fused_cpu.backward(q, k, v, d_out, lse, delta, **_kernel_call(plan, arrays, q.shape[1]))
    return [g.astype(x.dtype) for g, x in zip(grads, (q, k, v), strict=True)]


def _tiles_backward(q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, *arrays, plan: Plan, precision) -> list:
    """The same on XLA's tiles (under :func:`jax.export`)."""
    (k, v), flat = ungrouped(plan, k, v)
    args = (q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays, ())
    ((dq, dk, dv), _), _ = backward_kernel(*args, plan=replace(flat, fused=None), precision=precision)
    return [dq, *regrouped(plan, dk, dv)]


#: The fused backward (first-order reverse mode where the forward is the fused kernel's), inside the pair's backward.
_FUSED_BACKWARD = _kernel_primitive(
    "jattn_fused_backward",
    _fused_backward,
    _tiles_backward,
    lambda q, k, v, *_, plan, precision: [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)],
)


def fused_backward_kernel(
    q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays, *, plan: Plan, precision
) -> tuple:
    """``(dq, dk, dv)`` where ``plan``'s forward is the fused kernel's: its backward, one custom call."""
    args = (q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, *arrays)
    return tuple(_FUSED_BACKWARD.bind(*args, plan=plan, precision=precision))


def fused_forward_tangent(q, k, v, dq, dk, dv, arrays, *, plan: Plan) -> list:
    """``[out, lse, max logit, d out, d lse]`` of the fused kernel in one pass (:func:`jattn._blockwise.fused_cpu.forward_tangent`).

    Bound inside :mod:`jattn._blockwise.rules`' one-pass jvp, which lowers it (and folds its ``vmap``).
    """
    outs = _fused_cpu.forward_tangent(q, k, v, dq, dk, dv, **_kernel_call(plan, arrays, q.shape[1]))
    return list(vary(tuple(outs), q, k, v, dq, dk, dv, *arrays))


def _forward_group(xs: tuple, a: tuple, group: Rows, *, consts, plan: Plan, precision) -> tuple:
    """The forward of ``group``'s rows (:func:`jattn._blockwise.forward.forward`): ``xs`` whole, ``a`` the group's kinds and arrays."""
    *big, rows, seeds, sinks = xs
    rows, seeds, sinks = map(group.of, (rows, seeds, sinks))
    return group_forward(*big, rows, seeds, sinks, _group_kinds(a[0]), a[1:], consts, plan, precision, group), ()


def backward_kernel(q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays, consts, *, plan: Plan, precision):
    """``(((dq, dk, dv), own db), (dconsts, shared db))`` group by group (:func:`jattn._blockwise.backward.backward`)."""
    # delta for all of B before the groups: computed inside a group, XLA fuses its reduction
    # into the tile's dO vᵀ product, 1.5x slower (T = 2048 on 2 threads, one tile a head)
    lse, delta = backward_rows(out, d_out, lse, plan.compute, d_lse)
    body = functools.partial(_backward_group, consts=consts, plan=plan, precision=precision)
    return by_group(plan, body, (q, k, v, d_out, lse, delta, rows, seeds), (kind, *arrays))


def _backward_group(xs: tuple, a: tuple, group: Rows, *, consts, plan: Plan, precision) -> tuple:
    """The backward of ``group``'s rows: ``xs`` whole, ``a`` the group's kinds and arrays."""
    *big, lse, delta, rows, seeds = xs
    lse, delta, rows, seeds = map(group.of, (lse, delta, rows, seeds))
    return group_backward(*big, lse, delta, rows, seeds, _group_kinds(a[0]), a[1:], consts, plan, precision, group)


def tangent_kernel(xs: tuple, rows, seeds, kind, arrays, d_bias, consts, d_consts, *, plan: Plan, precision):
    """``(d out (B, T, E), d lse (B, T))`` group by group (:func:`jattn._blockwise.tangent.tangent`).

    ``xs = (q, k, v, dq, dk, dv, out, lse, sinks, d_sinks)``, each ``(B, ...)``; ``arrays`` the
    mask's and the bias (:meth:`jattn._blockwise.plan.Plan.split`), ``d_bias`` ``()`` or the bias's tangent.
    """
    whole, own = xs[:6], xs[6:]

    def body(ys: tuple, a: tuple, group: Rows):
        kind, *rest = a
        arrays, d_bias = (tuple(rest[:-1]), rest[-1]) if plan.bias else (tuple(rest), None)
        mine = tuple(group.of(x) for x in ys[6:])
        return group_tangent((*ys[:6], *mine), group.of(rows), group.of(seeds), _group_kinds(kind), arrays, d_bias,
                             consts, d_consts, plan, precision, group), ()  # fmt: skip

    return by_group(plan, body, (*whole, *own), (kind, *arrays, *d_bias))[0]


def _group_kinds(kinds: Array) -> Array:
    """A group's rows' kinds ``(b|1, ...)`` as one (:func:`jattn._masks.kinds.reduce_kinds`), a split kind kept where a row has it.

    A tile's rows share its static split kind, or are EMPTY on device (:meth:`jattn._blockwise.plan.Plan.run`).
    """
    split = jnp.max(jnp.where(kinds >= LOWER, kinds, jnp.int8(EMPTY)), axis=0)
    return jnp.where(split != EMPTY, split, reduce_kinds(kinds))


def folding(kernel, foldable: bool = True, shared: tuple[int, ...] = ()):
    """``kernel(*xs, kind, arrays, consts)`` whose ``vmap`` folds the mapped axis into B.

    Each of ``xs`` is ``(B, ...)``, and the tile kinds and each mask array ``(B|1, ...)``; under
    ``vmap`` of size n they become ``(n·B, ...)`` (broadcast where unmapped), so the tiles are
    those of an explicit batch of n·B rather than n-fold larger ones, and a mapped mask keeps its
    per-row tile kinds. With a score modification (``foldable=False``) it batches element by
    element: the converted function is specialised to the tile shapes, and the gradients of the
    arrays it closes over belong to each mapped element; so too where a mask array every row shares
    (``shared``: the arrays a ``masks.predicate`` closes over) is mapped.
    """
    folded = jax.custom_batching.custom_vmap(kernel)

    @folded.def_vmap
    def rule(n, in_batched, *args):
        *xs, kind, arrays, consts = args
        *xs_batched, kind_batched, arrays_batched, _ = in_batched
        if not foldable or any(arrays_batched[i] for i in shared):
            axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
            outs = jax.vmap(kernel, in_axes=axes)(*args)
            return outs, jax.tree.map(lambda _: True, outs)
        b = xs[0].shape[1] if xs_batched[0] else xs[0].shape[0]
        flat = tuple(fold(x, batched, n) for x, batched in zip(xs, xs_batched, strict=True))
        masks = tuple(fold_rows(m, batched, n, b) for m, batched in zip(arrays, arrays_batched, strict=True))
        outs = folded(*flat, fold_rows(kind, kind_batched, n, b), masks, consts)
        outs = jax.tree.map(lambda y: y.reshape(n, -1, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folded


def fold(x: Array, batched: bool, n: int, b: int | None = None) -> Array:
    """``x`` ``(n, b, ...)`` (``batched``) or ``(b, ...)`` as ``(n·b, ...)`` (``b``: its own rows where None)."""
    x = x if batched else jnp.broadcast_to(x, (n, *x.shape))
    b = x.shape[1] if b is None else b
    return jnp.broadcast_to(x, (n, b, *x.shape[2:])).reshape(n * b, *x.shape[2:])


def fold_rows(m: Array, batched: bool, n: int, b: int) -> Array:
    """A ``(b|1, ...)`` array folded as :func:`fold`, or kept where every row shares it (unbatched, 1 row)."""
    return fold(m, batched, n, b) if batched or m.shape[0] != 1 else m
