"""The GPU kernel's entry: a call's refusals, its translation to the kernels' operands, and the custom VJP.

:func:`gpu_attention` takes jattn's checked operands (dimension key in :mod:`jattn._core`):
q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` broadcast over the call's leading shape
``lead``. The leading dims are flattened to ``b`` rows of q; where k and v have 1 on the last
leading axis and q ``G > 1`` (grouped-query attention, q ``(..., K, G, T, D)``, k ``(..., K, 1, S,
D)``) they keep their ``b / G`` rows and query row ``r`` reads kv row ``r // G``; otherwise they are
broadcast to ``b`` rows. Lengths are padded to the blocks, head dims to powers of two (at least
16). The forward saves ``lse``; the backward (:func:`jax.custom_vjp`) is the dq and dk/dv kernels
of :mod:`jattn._gpu.kernels`, with the sinks' gradient and the score modification's arrays'
gradients summed outside. What the kernel cannot express raises
:class:`jattn._checks.KernelRefusalError` before anything is built (:func:`refuse`).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from jattn._checks import KernelRefusalError, check_sinks
from jattn._gpu.kernels import Spec, dkdv, dq, forward
from jattn._gpu.score_mod import convert, unlowerable
from jattn._gpu.tiles import bounds, grid_of, kernel_arrays, slot_kinds, tile_kinds
from jattn._masks import Mask, RowPadding, RowSegments, as_rows, query_offset, split_arrays
from jattn._online import flat_lead, head_rows

__all__ = ["MAX_DEPTH", "gpu_attention", "refuse"]

#: The largest head depth D or value depth E the kernel takes.
MAX_DEPTH = 256

_TAKE = "use implementation='blockwise' or 'dense'"


def refuse(mask: Mask | None, q_offset, kv_offset, D: int, E: int) -> None:
    """Raises :class:`KernelRefusalError` (a ``ValueError``) naming what the GPU kernel cannot take, else nothing.

    Array masks, predicates of batch and head, traced (per-example) offsets, and head depths above :data:`MAX_DEPTH`.
    """
    where = "implementation='pallas' (jattn's GPU kernel)"
    if mask is not None and mask.has_arrays:
        raise KernelRefusalError(
            f"{where} cannot take mask as an array ({mask!r}): it reads masks as predicates; {_TAKE}"
        )
    if mask is not None and mask.per_row:
        raise KernelRefusalError(f"{where} cannot take mask {mask!r}, a predicate of batch and head; {_TAKE}")
    for name, x in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if x is not None and not isinstance(x, numbers.Integral):
            raise KernelRefusalError(f"{where} takes static int offsets, got {name} {x!r}; {_TAKE}")
    if max(D, E) > MAX_DEPTH:
        raise KernelRefusalError(f"{where} takes head depths D, E up to {MAX_DEPTH}, got D={D}, E={E}; {_TAKE}")


def _pow2(n: int) -> int:
    """The smallest power of two ``>= n``."""
    return 1 << max(0, int(n) - 1).bit_length()


def _blocks(blocks: tuple[int, int] | None, T: int, S: int, Dp: int, interpret: bool) -> tuple[int, int]:
    """``(bq, bk)``: the caller's, or 64 (32 keys beyond D 128) cut to the lengths; compiled, powers of two of 16 up."""
    if blocks is None:
        blocks = (min(64, _pow2(T)), min(64 if Dp <= 128 else 32, _pow2(S)))
    if interpret:
        return max(1, min(blocks[0], T)), max(1, min(blocks[1], S))
    return tuple(max(16, _pow2(min(b, n))) for b, n in zip(blocks, (T, S), strict=True))


def _kv_group(k: Array, v: Array, lead: tuple[int, ...]) -> int:
    """G where k and v are ``lead`` with 1 on its last axis and q has G there (grouped heads), else 1."""
    grouped = len(lead) >= 1 and lead[-1] > 1 and k.shape[:-2] == v.shape[:-2] == (*lead[:-1], 1)
    return lead[-1] if grouped else 1


def _pad(x: Array, rows: int, cols: int) -> Array:
    """``x (n, l, h)`` padded with zeros to ``(n, rows, cols)``."""
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2])))


def gpu_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale,
    q_offset: int | None,
    kv_offset: int,
    blocks: tuple[int, int] | None,
    lead: tuple[int, ...],
    axis: int,
    score_mod=None,
    sinks: Array | None = None,
    interpret: bool,
    reference: Callable | None = None,
) -> tuple[Array, Array]:
    """``(out (..., T, E), lse (..., T) float32)`` through jattn's GPU kernel (``interpret``: Pallas interpret mode).

    q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``; ``lead`` and ``axis`` as in
    :class:`jattn._checks.Operands`; ``scale`` a value (a traced one is folded into q); ``mask``
    any position predicate with padding() and segment_ids() in any ``&``, ``|``, ``~``;
    ``score_mod`` and ``sinks`` as for :func:`jattn.attention`; ``blocks`` the kernel's ``(bq, bk)``.
    ``reference(q, k, v, sinks, scale) -> (out, lse)``: the same call on another path (XLA, differentiable
    to any order) that the backward's own derivative (grad of grad) is taken through; None refuses it.
    """
    T, S, D, E = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    refuse(mask, q_offset, kv_offset, D, E)
    b = math.prod(lead)
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
    sinks_f = None if sinks is None else jnp.broadcast_to(sinks, lead).reshape(b).astype(jnp.float32)
    if T == 0 or S == 0:
        lse = jnp.full((b, T), -jnp.inf, jnp.float32) if sinks_f is None else jnp.broadcast_to(sinks_f[:, None], (b, T))
        return jnp.zeros((*lead, T, E), v.dtype), lse.reshape(*lead, T)
    skeleton, arrays = (None, ()) if mask is None else split_arrays(as_rows(mask, lead, axis))
    Dp, Ep = (max(16, _pow2(n)) for n in (D, E))
    bq, bk = _blocks(blocks, T, S, Dp, interpret)
    grid = grid_of(skeleton, T, S, bq, bk, int(query_offset(q_offset, kv_offset, T, S)), int(kv_offset))
    if any(kind not in (RowPadding, RowSegments) for kind in slot_kinds(grid)):
        raise KernelRefusalError(f"implementation='pallas' (jattn's GPU kernel) cannot read mask {mask!r}; {_TAKE}")
    if isinstance(scale, jax.core.Tracer):  # traced: into q (in float32, rounded once to q's dtype)
        q, scale = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype), 1.0
    mod, consts = convert(score_mod, bq, bk, head_rows(lead))
    if mod is not None and (found := unlowerable(mod, bq, bk)):  # interpreted too: the GPU's answer, on any platform
        raise KernelRefusalError(
            f"implementation='pallas' (jattn's GPU kernel) cannot take this score_mod: per score it reads "
            f"{', '.join(found)}, which Triton cannot lower (a table indexed by position, as T5's bias; "
            f"an ALiBi-like function of the row and the positions lowers); {_TAKE}"
        )
    G = _kv_group(k, v, lead)
    qf = _pad(flat_lead(q, lead), grid.t_pad, Dp)
    kvs = (k.reshape(b // G, S, D), v.reshape(b // G, S, E)) if G > 1 else (flat_lead(k, lead), flat_lead(v, lead))
    kf, vf = _pad(kvs[0], grid.s_pad, Dp), _pad(kvs[1], grid.s_pad, Ep)
    kinds = tile_kinds(grid, arrays)
    masks = tuple(x.astype(jnp.int32) for x in kernel_arrays(grid, arrays))
    spec = Spec(
        grid=grid, Dp=Dp, Ep=Ep, G=G, scale=float(scale), mod=mod, sinks=sinks is not None, interpret=interpret,
        mask_rows=tuple(x.shape[0] for x in masks),
    )  # fmt: skip
    ints = (kinds, bounds(kinds, -1), bounds(kinds, -2), masks)
    sink_rows = jnp.zeros((b,), jnp.float32) if sinks_f is None else sinks_f
    second = None if reference is None else functools.partial(_padded, reference, lead, (T, S, D, E), spec)
    out, lse = _attend(spec, second, qf, kf, vf, sink_rows, consts, ints)
    return out[:, :T, :E].reshape(*lead, T, E), lse[:, :T].reshape(*lead, T)


def _padded(reference: Callable, lead, sizes, spec: Spec, q, k, v, sinks) -> tuple[Array, Array]:
    """``reference`` on the kernel's padded, flattened operands: ``(o (b, Tp, Ep), lse (b, Tp))``, 0 in the padding."""
    T, S, D, E = sizes
    kv_lead = (*lead[:-1], 1) if spec.G > 1 else lead
    q_ = q[:, :T, :D].reshape(*lead, T, D)
    k_, v_ = k[:, :S, :D].reshape(*kv_lead, S, D), v[:, :S, :E].reshape(*kv_lead, S, E)
    out, lse = reference(q_, k_, v_, sinks.reshape(lead) if spec.sinks else None, spec.scale)
    out = _pad(out.reshape(q.shape[0], T, E), q.shape[1], v.shape[2])
    return out, jnp.pad(lse.reshape(q.shape[0], T).astype(jnp.float32), ((0, 0), (0, q.shape[1] - T)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(spec: Spec, second, q, k, v, sinks, consts, ints) -> tuple[Array, Array]:
    """``(o (b, Tp, Ep), lse (b, Tp))`` of the padded operands (:func:`jattn._gpu.kernels.forward`)."""
    kinds, fb, _, masks = ints
    return forward(spec, q, k, v, kinds, fb, sinks, masks, consts)


def _attend_fwd(spec, second, q, k, v, sinks, consts, ints):
    o, lse = _attend(spec, second, q, k, v, sinks, consts, ints)
    return (o, lse), (q, k, v, sinks, consts, ints, o, lse)


def _attend_bwd(spec, second, res, cts):
    q, k, v, sinks, consts, ints, o, lse = res
    do, dlse = cts
    kinds, fb, tb, masks = ints
    do = do.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse
    dq_, dcs, dk, dv = _backward(spec, second, q, k, v, do, lse, delta, kinds, fb, tb, sinks, masks, consts)
    dsinks = jnp.zeros_like(sinks)
    if spec.sinks:  # d sink = -sum_t e^(sink - lse_t) delta_t over the rows that see something
        finite = lse > -jnp.inf
        w = jnp.where(finite, jnp.exp(sinks[:, None] - jnp.where(finite, lse, 0.0)), 0.0)
        dsinks = -jnp.sum(w * delta, axis=-1)
    it = iter(dcs)
    floats = () if spec.mod is None else spec.mod.floats
    dconsts = tuple(
        jnp.sum(next(it), axis=1).astype(c.dtype) if f else None for c, f in zip(consts, floats, strict=True)
    )
    return dq_, dk, dv, dsinks, dconsts, None


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _backward(spec, second, q, k, v, do, lse, delta, kinds, fb, tb, sinks, masks, consts):
    """The dq and dk/dv kernels: ``(dq, dvalues, dk, dv)``; their derivative is ``second``'s (:func:`_second_order`)."""
    dq_, dcs = dq(spec, q, k, v, do, lse, delta, kinds, fb, sinks, masks, consts)
    dk, dv = dkdv(spec, q, k, v, do, lse, delta, kinds, tb, sinks, masks, consts)
    return dq_, dcs, dk, dv


def _second_order(spec, second, primals, tangents):
    """The backward's derivative (grad of grad), through ``second``: the reference path's VJP, differentiated.

    The backward maps ``(q, k, v, sinks, do, delta)`` to ``(dq, dk, dv)`` with ``lse`` and ``o`` the forward's
    (functions of q, k, v, sinks: recomputed by the reference, so their tangents agree); ``delta = rowsum(do o) -
    dlse`` gives back the lse's cotangent. Refused by name where there is no reference, and where the score
    modification reads floating arrays (their gradients are the kernel's own, per row: not derived here).
    """
    q, k, v, do, _, delta, *_, sinks, _, _ = primals
    tq, tk, tv, tdo, _, tdelta, *_, tsinks, _, _ = tangents
    if second is None or (spec.mod is not None and any(spec.mod.floats)):
        why = "a score_mod closing over floating arrays" if second is not None else "no reference path"
        raise ValueError(
            f"second-order reverse mode (grad of grad) of implementation='pallas' with {why}: the kernel's "
            "backward has no derivative there; use 'blockwise' or 'dense'"
        )

    def backward(q, k, v, do, delta, sinks):
        (o, _), pull = jax.vjp(second, q, k, v, sinks)
        dlse = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - delta
        dq_, dk, dv, _ = pull((do.astype(o.dtype), dlse))
        return dq_, dk, dv

    out = _backward(spec, second, *primals)
    _, (dq_t, dk_t, dv_t) = jax.jvp(backward, (q, k, v, do, delta, sinks), (tq, tk, tv, tdo, tdelta, tsinks))
    cast = tuple(t.astype(x.dtype) for t, x in zip((dq_t, dk_t, dv_t), (out[0], out[2], out[3]), strict=True))
    return out, (cast[0], tuple(jnp.zeros_like(c) for c in out[1]), cast[1], cast[2])


_backward.defjvp(_second_order)
