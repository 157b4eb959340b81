"""Memory-efficient blockwise attention: an online softmax over key blocks, query blocks in turn.

Shapes follow :mod:`jattn._core` (after broadcasting, leading dimensions are flattened to one
axis ``B``): q ``(B, T, D)``, k ``(B, S, D)``, v ``(B, S, E)``. Queries are tiled into blocks of
``block_q`` rows and keys into blocks of ``block_kv``. A mask predicate classifies every
(query block, key block) pair statically as empty, partial or full
(:meth:`jattn.masks.Mask.block_kinds`): empty blocks are never computed, full blocks skip the
mask, partial blocks apply it. Each query block loops over the list of its non-empty key blocks
only (:func:`jattn._blockwise.tile_loops.sweep`; on CPU its FULL ones first, in a loop without a branch), so
causal attention costs about half of full attention and a sliding window of width w costs O(T·w). A
partial tile whose top-right quarter is empty (the causal diagonal) is computed as its two
non-empty parts, top rows against the first half of its keys and bottom rows against all of
them: 3/4 of the tile; one whose first quarters of rows are empty (the diagonal of a tall tile)
as its last quarters only (:data:`jattn._platform.SPLIT_MIN`); a big square one as a staircase of
four parts, each quarter of rows against its keys: 10/16 (:data:`jattn._platform.STAIRS_MIN`).

Masks read from arrays are classified on device, per row of the flattened leading axis B: an
array mask, ``padding`` lengths and ``segment_ids`` (packed documents: a tile whose query ids
and key ids have disjoint ranges ``[min, max]`` is empty, one where both hold a single equal id
is full) become row forms ``(B|1, ...)`` (:meth:`jattn._masks.base.Mask._rows`), their tile kinds
``(B|1, nq, width)`` refine the static schedule, and each group of rows skips a tile that is
empty for all its rows (``lax.switch``). On CPU a group is a few heads (4 at 512 x 512 float32
tiles on several threads, one at the 1-thread tiles), of one example where the heads divide
evenly, so each example's documents cost what their own tiles cost.

An additive bias ``(B|1, T|1, S|1)`` is read tile by tile (:meth:`jattn._blockwise.tile_ops.Tile.biased`) and
its gradient accumulated tile by tile into one buffer of its shape; a score modification (``score_mod``,
closure-converted so the arrays it captures get gradients) acts on each tile after the bias;
sinks join each row's denominator at the end (:func:`jattn._online.finish`); dropout recomputes
each tile's keep bits from the row seeds and the tile's (query, key) indices
(:mod:`jattn._dropout`), in the forward and again in the backward, so no mask is stored and every
block size drops the entries the dense path drops. Under ``vmap`` a
call with a modification or a bias is batched element by element rather than folded.

The maths of one tile (the online-softmax state and its update, the tile gradients) is in
:mod:`jattn._online`, shared with ring attention. The backward pass (``jax.custom_vjp``)
recomputes each tile's weights from the saved output and log-sum-exp and adds its shares of dq,
dk and dv in one sweep over the same non-empty tiles, so training memory is O(T) too: no
``(T, S)`` array is ever formed.

On CPU the leading axis B is cut into groups whose score tile ``(group, bq, bk)`` stays about
:data:`jattn._platform.TILE_BYTES` (an eighth of it on one thread, :func:`jattn._platform.cpu_threads`),
and the groups run one after another (:func:`jattn._platform.group_size`); GPU and TPU tile all of
B at once. Under ``jax.vmap`` the mapped axis is folded into B (:func:`_folding`), so a
vmapped call has the tiles of an explicit batch.

On CPU the forward of a call whose mask gives each query one interval of keys, possibly cut per
example by padding lengths and segment ids (:func:`jattn._blockwise.fused_rows.fused_window`), without a modification, sinks, bias, dropout or precision,
is one custom call to the fused kernel of :mod:`jattn._blockwise.fused_cpu` (:func:`fused_forward`) when the
core passes ``fused=True`` (no explicit ``block_size``); it returns the same out, lse and max
logit, and its first-order backward and its tangents are fused kernels too
(:mod:`jattn._blockwise.rules`); second order and ``jax.export`` run the XLA tiles above.

Here: the entry point, the custom VJP and the kernels of one plan (its groups of rows and its
``vmap`` folding). The plan, its frozen key, is :class:`jattn._blockwise.plan.Plan`, its tile schedule
:class:`jattn._blockwise.tiles.Schedule`; one tile's operations are in :mod:`jattn._blockwise.tile_ops`, the loops in
:mod:`jattn._blockwise.tile_loops`, the forward and the backward of a group of rows in
:mod:`jattn._blockwise.forward` and :mod:`jattn._blockwise.backward`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from jattn import _platform
from jattn._arrays import compute_dtype, flat_lead, head_rows
from jattn._blockwise import fused_cpu as _fused_cpu
from jattn._blockwise.fused_rows import fused_window
from jattn._blockwise.plan import OWN, SHARED, Plan
from jattn._blockwise.rules import flash
from jattn._checks import check_sinks
from jattn._dropout import row_seeds
from jattn._masks import Mask, as_rows, query_offset, split_arrays
from jattn._online import convert_mod

__all__ = [
    "blockwise_attention",
    "fused_forward",
]


def _pad(x: Array, axis: int, multiple: int) -> Array:
    """``x`` padded with zeros at the end of ``axis`` to a multiple of ``multiple`` (a block's size)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def blockwise_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale: float | Array,
    q_offset: int | None,
    kv_offset: int,
    block_q: int,
    block_kv: int,
    precision: jax.lax.PrecisionLike = None,
    score_mod=None,
    sinks: Array | None = None,
    bias: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    backward_block: tuple[int, int] | None = None,
    fused: bool = False,
    lead: tuple[int, ...],
    axis: int,
    dropout_seeds: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Blockwise attention of validated ``q (..., T, D)``, ``k (..., S, D)``, ``v (..., S, E)``.

    ``lead`` is the call's leading shape ``...`` and ``axis`` the axis of it where q's first axis
    lands (:class:`jattn._checks.Operands`).

    ``mask`` is a position predicate, possibly with array leaves ``(..., T, S)`` that broadcast
    against the leading dimensions. ``score_mod`` and ``sinks`` (broadcastable to the leading
    dimensions), ``dropout_rate`` and ``dropout_rng`` are as for :func:`jattn.attention`. Returns
    ``out (..., T, E)``, ``lse (..., T)`` and the row max logit ``(..., T)``; see the module
    docstring. The platform (:func:`jattn._platform.platform`) and, on CPU, the threads
    (:func:`jattn._platform.cpu_threads`) pick the tiling of the leading axis
    (:func:`jattn._platform.group_size`). ``backward_block`` (optional) tiles the backward where the
    forward's tiles are of several kinds (not all FULL), its sides divide the forward's and there
    is no ``score_mod``; else the backward takes the forward's tiles. ``fused``: on CPU, the
    forward may be the fused kernel (:func:`fused_forward`), its tiles its own. ``dropout_seeds
    (*lead)`` uint32, where given, are the rows' dropout seeds in place of ``row_seeds(dropout_rng,
    flat leading index)`` (:mod:`jattn._dropout`; the GPU kernel's reference path).
    """
    T, S = q.shape[-2], k.shape[-2]
    if mask is not None:
        mask = as_rows(mask, lead, axis)  # every array leaf as rows (B|1, ...) of lead flattened
    skeleton, arrays = (None, ()) if mask is None else split_arrays(mask)
    compute = compute_dtype(q.dtype)
    if isinstance(scale, jax.core.Tracer):  # traced (a jit argument, differentiated): into q here, the plan's is 1
        q, scale = q.astype(compute) * jnp.asarray(scale, compute), 1.0  # prescale's product, outside the kernel
    qf, kf, vf = (flat_lead(x, lead) for x in (q, k, v))
    b = qf.shape[0]
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
    sinks_f = jnp.zeros((b,), compute) if sinks is None else jnp.broadcast_to(sinks, lead).reshape(b)
    if T == 0 or S == 0:  # no tiles: every row is empty (a sink alone gives lse = sink)
        out, empty = jnp.zeros((b, T, v.shape[-1]), v.dtype), jnp.full((b, T), -jnp.inf, compute)
        lse = empty if sinks is None else jnp.broadcast_to(sinks_f[:, None].astype(compute), (b, T))
        return out.reshape(*lead, T, v.shape[-1]), lse.reshape(*lead, T), empty.reshape(*lead, T)
    bq, bk = min(block_q, T), min(block_kv, S)
    q_offset = query_offset(q_offset, kv_offset, T, S)
    where = _platform.platform(), _platform.cpu_threads()
    g = _platform.group_size(b, bq, bk, jnp.dtype(compute).itemsize, *where)
    mod, consts = convert_mod(score_mod, g, bq, bk, compute)
    bias_t, bias_kind = (), 0
    if bias is not None:  # (B|1, T|1, S|1), padded like q and k where it has those axes
        bias_f = _bias_rows(bias, lead)
        bias_f = _pad(bias_f, 1, bq) if bias_f.shape[1] > 1 else bias_f
        bias_t, bias_kind = (
            (_pad(bias_f, 2, bk) if bias_f.shape[2] > 1 else bias_f,),
            OWN if bias_f.shape[0] > 1 else SHARED,
        )
    xla = Plan(
        T=T, S=S, bq=bq, bk=bk, mask=skeleton, q_offset=int(q_offset), kv_offset=int(kv_offset), scale=float(scale),
        compute=compute, platform=where[0], threads=where[1], mod=mod, sinks=sinks is not None, bias=bias_kind,
        dropout=float(dropout_rate),
    )  # fmt: skip
    window = fused_window(skeleton) if fused else None  # key intervals, padding, segment ids
    plain = score_mod is None and sinks is None and bias is None and not dropout_rate and precision is None
    use = window is not None and plain and fused_forward(compute, where[0])
    plan, back = _plans(xla, window if use else None, None if score_mod is not None else backward_block)
    group = _kv_group(k, v, lead) if use else 1
    if group > 1:  # grouped heads: k and v unrepeated, a row per `group` rows of q (the fused kernels read them so)
        plan, back = (dataclasses.replace(p, kv_group=group) for p in (plan, back))
        kf, vf = (x.reshape(b // group, *x.shape[-2:]) for x in (k, v))
    run = plan.run(arrays)
    padded = _pad(qf, 1, bq), _pad(kf, 1, bk), _pad(vf, 1, bk)
    flat = jnp.arange(b, dtype=jnp.int32)  # each row's flat leading index
    if dropout_seeds is not None:
        seeds = dropout_seeds.reshape(b)
    else:
        seeds = row_seeds(dropout_rng, flat) if dropout_rate else jnp.zeros((b,), jnp.uint32)
    out, lse, mx = flash(*padded, head_rows(lead), seeds, sinks_f, consts, bias_t, run, plan, back, precision)
    out = out[:, :T].reshape(*lead, T, v.shape[-1]).astype(v.dtype)
    return out, lse[:, :T].reshape(*lead, T), mx[:, :T].reshape(*lead, T)


def _plans(xla: Plan, fused: tuple[int, int] | None, backward_block: tuple[int, int] | None) -> tuple[Plan, Plan]:
    """The forward's plan and the backward's, from the plan ``xla`` of a call on XLA's tiles.

    ``fused`` (a key interval, or None): the forward is the fused CPU kernel's, and so is the
    first-order backward (:mod:`jattn._blockwise.rules`); ``back`` (XLA's tiles: the forward's or
    ``backward_block``'s) serves export and second order. ``backward_block`` (None with a score
    modification, converted for the forward's tiles) tiles the backward where the forward's tiles
    are of several kinds and its sides divide the forward's; else the backward is the forward's plan.
    """
    plan = xla if fused is None else dataclasses.replace(xla, fused=fused)
    back = xla  # the forward's plan itself (the backward reuses its run-time kinds) unless fused
    if backward_block is not None and xla.tiles.uniform is None:
        bq, bk = xla.bq, xla.bk
        bqb, bkb = min(backward_block[0], bq), min(backward_block[1], bk)
        if (bqb, bkb) != (bq, bk) and bq % bqb == 0 and bk % bkb == 0:  # q, k, v padded for both
            back = dataclasses.replace(xla, bq=bqb, bk=bkb)
    return plan, back


def _kv_group(k: Array, v: Array, lead: tuple[int, ...]) -> int:
    """The query rows a row of k and v serves: G where k and v are ``lead`` but 1 on its last axis, else 1.

    Grouped heads: q ``(..., K, G, T, D)``, k and v ``(..., K, 1, S, ·)``; otherwise k and v are
    broadcast to ``lead``.
    """
    grouped = len(lead) >= 1 and lead[-1] > 1 and k.shape[:-2] == v.shape[:-2] == (*lead[:-1], 1)
    return lead[-1] if grouped else 1


def fused_forward(compute, platform: str) -> bool:
    """Whether a forward computing in ``compute`` on ``platform`` can be the fused CPU kernel (:mod:`jattn._blockwise.fused_cpu`).

    On CPU, float32 (16-bit inputs upcast), where the kernels are built for this CPU's vector layer and not
    switched off (``JATTN_FUSED_CPU=0``); the call must also have a key interval mask (none,
    causal, sliding windows) and no score_mod, sinks, bias, dropout or precision.
    """
    return platform == "cpu" and compute == jnp.float32 and _fused_cpu.available()


def _bias_rows(m: Array, lead: tuple[int, ...]) -> Array:
    """A bias ``(..., T|1, S|1)`` as rows: ``(1, T|1, S|1)`` when it has no leading extent, else ``(B, T|1, S|1)``."""
    if all(n == 1 for n in m.shape[:-2]):
        return m.reshape(1, *m.shape[-2:])
    return flat_lead(m, lead)
