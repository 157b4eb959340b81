"""The GPU kernel's entry: a call's refusals and its translation to the kernels' operands.

:func:`gpu_attention` takes jattn's checked operands (dimension key in :mod:`jattn._core`):
q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` broadcast over the call's leading shape
``lead``. The leading dims are flattened to ``b`` rows of q; where k and v have 1 on the last
leading axis and q ``G > 1`` (grouped-query attention, q ``(..., K, G, T, D)``, k ``(..., K, 1, S,
D)``) they keep their ``b / G`` rows and query row ``r`` reads kv row ``r // G``; otherwise they are
broadcast to ``b`` rows. Lengths are padded to the blocks, head dims to powers of two (at least
16). The derivatives at every order are :mod:`jattn._gpu.rules`' (the tangent kernel in forward
mode, the dq and dk/dv kernels in reverse mode, the reference path's in second order). What the
kernel cannot express raises
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

from jattn import _platform
from jattn._arrays import flat_lead, head_rows
from jattn._checks import KernelRefusalError, Operands, Options, check_sinks
from jattn._dropout import row_seeds
from jattn._gpu.deprecation import answer_triton_deprecation
from jattn._gpu.kernels import Spec
from jattn._gpu.mosaic_support import TARGETS, refuse_mosaic, refuse_windows
from jattn._gpu.mosaic_tile import windows
from jattn._gpu.rules import attend
from jattn._gpu.score_mod import backend_name, convert, on_rows, pointwise, unlowerable
from jattn._gpu.tiles import bounds, grid_of, kernel_arrays, row_mask, slot_kinds, tile_kinds
from jattn._gpu.tuning import Choice, choose
from jattn._masks import Mask, RowPadding, RowSegments, as_rows, query_offset, split_arrays

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


def _lowered_on_triton() -> None:
    """Refuses the kernel lowered on Pallas' Triton backend where JAX has none, else answers its deprecation.

    (:mod:`jattn._gpu.deprecation`; only where the kernel is lowered, not interpreted.)
    """
    if not _platform.has_pallas_triton():
        raise KernelRefusalError(
            f"implementation='pallas' (jattn's GPU kernel) lowers on Pallas' Triton backend, which jax {jax.__version__} "
            "no longer has; use implementation='cudnn' or 'blockwise'"
        )
    answer_triton_deprecation(_platform.compute_capability())


def _pow2(n: int) -> int:
    """The smallest power of two ``>= n``."""
    return 1 << max(0, int(n) - 1).bit_length()


def _blocks(
    blocks: tuple[int, int] | None, T: int, S: int, Dp: int, interpret: bool, choice: Choice
) -> tuple[int, int]:
    """``(bq, bk)``: the caller's, or the tuning table's ``choice`` (interpret mode: 64, 32 keys beyond D 128).

    Cut to the lengths; compiled, powers of two of 16 up.
    """
    if blocks is None and interpret:
        blocks = (64, 64 if Dp <= 128 else 32)
    blocks = blocks or choice.blocks
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
    ops: Operands, opts: Options, *, interpret: bool, reference: Callable | None = None, backend: str = "triton"
) -> tuple[Array, Array, Array]:
    """``(out (..., T, E), lse (..., T), max logit (..., T))`` through jattn's GPU kernel (``interpret``: Pallas interpret mode).

    q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` and the rest of a call's :class:`jattn._checks.Operands`
    (``scale`` a value, a traced one folded into q; the mask any position predicate with padding() and
    segment_ids() in any ``&``, ``|``, ``~``; static offsets); of its :class:`jattn._checks.Options`, ``blocks``
    the kernel's ``(bq, bk)``, ``score_mod``, ``sinks`` and dropout as for :func:`jattn.attention` (dropout's bits
    the blockwise path's, from each flat leading row's seed).
    ``reference(q, k, v, sinks, seeds, scale, score_mod, rows) -> (out, lse)``: the same call on another
    path (XLA, differentiable to any order, ``seeds (*lead)`` the rows' dropout seeds, ``score_mod`` the
    modification reading the kernel's row values, ``rows`` the mask the kernel reads, in row form) that
    the backward's own derivative (grad of grad) is taken through; None refuses it.
    ``backend``: ``"triton"`` (sm_80 up), ``"mosaic_gpu"`` (Hopper's wgmma, blocks 64 by 64) or ``"mosaic_gpu_tcgen05"``
    (Blackwell's tcgen05, blocks 128 by 128): :mod:`jattn._gpu.mosaic_kernels`, bfloat16 and float16.
    """
    q, k, v, mask, _, scale, q_offset, kv_offset, lead, axis = ops
    blocks, score_mod, sinks, dropout_rate, dropout_rng = (
        opts.blocks, opts.score_mod, opts.sinks, opts.dropout_rate, opts.dropout_rng
    )  # fmt: skip
    T, S, D, E = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    refuse(mask, q_offset, kv_offset, D, E)
    if backend != "triton" and backend not in TARGETS:
        raise ValueError(f"backend must be 'triton' or one of {sorted(TARGETS)}, got {backend!r}")
    if backend in TARGETS:
        refuse_mosaic(backend, q.dtype, D, E, interpret=interpret, blocks=blocks)
    elif not interpret:
        _lowered_on_triton()
    b = math.prod(lead)
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
    sinks_f = None if sinks is None else jnp.broadcast_to(sinks, lead).reshape(b).astype(jnp.float32)
    if T == 0 or S == 0:
        nothing = jnp.full((*lead, T), -jnp.inf, jnp.float32)
        lse = nothing if sinks_f is None else jnp.broadcast_to(sinks_f[:, None], (b, T)).reshape(*lead, T)
        return jnp.zeros((*lead, T, E), v.dtype), lse, nothing
    skeleton, arrays = (None, ()) if mask is None else split_arrays(as_rows(mask, lead, axis))
    Dp, Ep = (max(16, _pow2(n)) for n in (D, E))
    choice = choose(_platform.compute_capability(), q.dtype, max(Dp, Ep))
    bq, bk = (TARGETS[backend].block,) * 2 if backend in TARGETS else _blocks(blocks, T, S, Dp, interpret, choice)
    grid = grid_of(skeleton, T, S, bq, bk, int(query_offset(q_offset, kv_offset, T, S)), int(kv_offset))
    if any(kind not in (RowPadding, RowSegments) for kind in slot_kinds(grid)):
        raise KernelRefusalError(f"implementation='pallas' (jattn's GPU kernel) cannot read mask {mask!r}; {_TAKE}")
    if isinstance(scale, jax.core.Tracer):  # traced: into q (in float32, rounded once to q's dtype)
        q, scale = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype), 1.0
    mod, consts = convert(score_mod, bq, bk, head_rows(lead))
    if mod is not None and (found := unlowerable(mod, bq, bk, backend)):  # interpreted too: the GPU's answer
        raise KernelRefusalError(
            f"implementation='pallas' (jattn's GPU kernel) cannot take this score_mod: per score it reads "
            f"{', '.join(found)}, which {backend_name(backend)} cannot lower (a table indexed by position, as T5's bias; "
            f"an ALiBi-like function of the row and the positions lowers); {_TAKE}"
        )
    G = _kv_group(k, v, lead)
    qf = _pad(flat_lead(q, lead), grid.t_pad, Dp)
    kvs = (k.reshape(b // G, S, D), v.reshape(b // G, S, E)) if G > 1 else (flat_lead(k, lead), flat_lead(v, lead))
    kf, vf = _pad(kvs[0], grid.s_pad, Dp), _pad(kvs[1], grid.s_pad, Ep)
    kinds = tile_kinds(grid, arrays)
    masks = tuple(x.astype(jnp.int32) for x in kernel_arrays(grid, arrays))
    if backend in TARGETS:
        refuse_windows(backend, D, E, sum(map(bool, windows(grid.mask, len(masks)))))
    spec = Spec(
        grid=grid, Dp=Dp, Ep=Ep, G=G, scale=float(scale), mod=mod, sinks=sinks is not None, interpret=interpret,
        n_mask=len(masks), choice=choice, dropout=float(dropout_rate), backend=backend,
    )  # fmt: skip
    seeds = row_seeds(dropout_rng, jnp.arange(b, dtype=jnp.int32)) if dropout_rate else jnp.zeros((b,), jnp.uint32)
    ints = (kinds, bounds(kinds, -1), bounds(kinds, -2), seeds, masks)
    sink_rows = jnp.zeros((b,), jnp.float32) if sinks_f is None else sinks_f
    sizes, per_score = (T, S, D, E), pointwise(score_mod, mod)
    second = None if reference is None else functools.partial(_padded, reference, lead, sizes, spec, per_score)
    out, lse, top = attend(spec, second, qf, kf, vf, sink_rows, consts, ints)
    return out[:, :T, :E].reshape(*lead, T, E), lse[:, :T].reshape(*lead, T), top[:, :T].reshape(*lead, T)


def _padded(reference: Callable, lead, sizes, spec: Spec, per_score, q, k, v, sinks, seeds, masks, values):
    """``reference`` on the kernel's padded, flattened operands: ``(o (b, Tp, Ep), lse (b, Tp))``, 0 in the padding.

    The kernel's mask arrays ``masks`` (:func:`jattn._gpu.tiles.row_mask`) and the score mod's row
    ``values`` (:func:`jattn._gpu.score_mod.on_rows` of ``per_score``, the score mod's tile part traced for
    one score) are operands here, never closed over. Where ``vmap``
    folded ``n`` copies of the call into the rows (``n b`` of them), ``reference`` is mapped over them.
    """
    T, S, D, E = sizes
    b = math.prod(lead)
    n = q.shape[0] // b
    kv_lead = (*lead[:-1], 1) if spec.G > 1 else lead

    def one(q, k, v, sinks, seeds, masks, values):
        mod = None if per_score is None else on_rows(per_score, math.prod(lead[1:]), values)
        return reference(q, k, v, sinks if spec.sinks else None, seeds, spec.scale, mod, row_mask(spec.grid, masks))

    shared = tuple(x.shape[0] == 1 for x in masks)  # one row for every row: not mapped
    out, lse = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, tuple(None if s else 0 for s in shared), 0))(
        q[:, :T, :D].reshape(n, *lead, T, D),
        k[:, :S, :D].reshape(n, *kv_lead, S, D),
        v[:, :S, :E].reshape(n, *kv_lead, S, E),
        sinks.reshape(n, *lead),
        seeds.reshape(n, *lead),
        tuple(x if s else x.reshape(n, b, *x.shape[1:]) for x, s in zip(masks, shared, strict=True)),
        tuple(x.reshape(n, b, *x.shape[1:]) for x in values),
    )
    out = _pad(out.reshape(q.shape[0], T, E), q.shape[1], v.shape[2])
    return out, jnp.pad(lse.reshape(q.shape[0], T).astype(jnp.float32), ((0, 0), (0, q.shape[1] - T)))
