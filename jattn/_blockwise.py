"""Memory-efficient blockwise attention: an online softmax over key blocks, query blocks in turn.

Shapes follow :mod:`jattn._core` (after broadcasting, leading dimensions are flattened to one
axis ``B``): q ``(B, T, D)``, k ``(B, S, D)``, v ``(B, S, E)``. Queries are tiled into blocks of
``block_q`` rows and keys into blocks of ``block_kv``. A mask predicate classifies every
(query block, key block) pair statically as empty, partial or full
(:meth:`jattn.masks.Mask.block_kinds`): empty blocks are never computed, full blocks skip the
mask, partial blocks apply it. Each query block loops over the list of its non-empty key blocks
only (:meth:`_Plan.sweep`; on CPU its FULL ones first, in a loop without a branch), so causal
attention costs about half of full attention and a sliding window of width w costs O(T·w). A
partial tile whose top-right quarter is empty (the causal diagonal) is computed as its two
non-empty parts, top rows against the first half of its keys and bottom rows against all of
them: 3/4 of the tile; one whose first quarters of rows are empty (the diagonal of a tall tile)
as its last quarters only (:data:`SPLIT_MIN`); a big square one as a staircase of four parts,
each quarter of rows against its keys: 10/16 (:data:`STAIRS_MIN`).

Masks read from arrays are classified on device, per row of the flattened leading axis B: an
array mask, ``padding`` lengths and ``segment_ids`` (packed documents: a tile whose query ids
and key ids have disjoint ranges ``[min, max]`` is empty, one where both hold a single equal id
is full) become row forms ``(B|1, ...)`` (:meth:`jattn._masks.Mask._rows`), their tile kinds
``(B|1, nq, width)`` refine the static schedule, and each group of rows skips a tile that is
empty for all its rows (``lax.switch``). On CPU a group is a few heads (4 at 512 x 512 float32
tiles on several threads, one at the 1-thread tiles), of one example where the heads divide
evenly, so each example's documents cost what their own tiles cost.

An additive bias ``(B|1, T|1, S|1)`` is read tile by tile (:meth:`_Plan.biased`) and its gradient
accumulated tile by tile into one buffer of its shape; a score modification (``score_mod``,
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
:data:`TILE_BYTES` (an eighth of it on one thread, :func:`cpu_threads`), and the groups run one
after another (:func:`jattn._platform.group_size`); GPU and TPU tile
all of B at once. Under ``jax.vmap`` the mapped axis is folded into B (:func:`_folding`), so a
vmapped call has the tiles of an explicit batch.

On CPU the forward of a call whose mask gives each query one interval of keys
(:func:`jattn._masks.key_interval`), without a modification, sinks, bias, dropout or precision,
is one custom call to the fused kernel of :mod:`jattn._fused_cpu` (:func:`fused_forward`) when the
core passes ``fused=True`` (no explicit ``block_size``); it returns the same out, lse and max
logit, so the backward above runs on XLA's tiles as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn import _fused_cpu, _platform
from jattn._checks import broadcast_all, check_sinks
from jattn._dropout import keep_mask, keep_scale, row_seeds
from jattn._masks import (
    EMPTY,
    FULL,
    KeyBelow,
    Mask,
    call_rows,
    fill_arrays,
    key_interval,
    query_offset,
    reduce_kinds,
    row_kinds,
    shared_arrays,
    split_arrays,
)
from jattn._online import (
    LOWER,
    SPLIT_AREA,
    STAIRS,
    TOP_EMPTY,
    Tree,
    accumulate,
    backward_rows,
    bind_mod,
    compute_dtype,
    convert_mod,
    empty_state,
    finish,
    flat_lead,
    head_rows,
    per_block,
    scaled_scores,
    score_grads,
    sink_grads,
    sum_to,
    tile_grads,
    transposed,
    vary,
)
from jattn._tiles import schedule, static_kinds

__all__ = [
    "blockwise_attention",
    "fused_forward",
]


def _pad(x: Array, axis: int, multiple: int) -> Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _flash(
    q, k, v, rows, seeds, sinks, consts, bias, run: _Run, plan: _Plan, back: _Plan, precision
) -> tuple[Array, Array, Array]:
    """``out (B, T, E)``, ``lse (B, T)`` and the row max logit ``(B, T)`` of padded q, k, v.

    ``q (B, T, D)``, ``k (B, S, D)``, ``v (B, S, E)``; ``rows (B, 2)`` int32 (batch, head) of each
    row for the score modification, ``seeds (B,)`` uint32 the dropout seed of each row (read only
    with ``plan.dropout``), ``sinks (B,)`` (read only with ``plan.sinks``), ``consts`` the
    modification's arrays; ``bias`` ``()`` or ``(bias (B|1, T|1, S|1),)`` padded like q and k.
    ``back`` is the backward's plan: ``plan`` itself, or the same call on tiles that divide
    ``plan``'s (the backward reads only per-row residuals, out and lse, so any tile recomputes them).
    """
    forward, _ = _kernels(plan, precision)
    return forward(q, k, v, rows, seeds, sinks, run.kind, run.arrays + bias, consts)[0]


@functools.lru_cache(maxsize=256)
def _kernels(plan: _Plan, precision):
    """The forward and backward of one plan, group by group, each folding ``vmap`` into B (:func:`_folding`)."""

    def forward(q, k, v, rows, seeds, sinks, kind, arrays, consts):
        if plan.fused is not None:  # one custom call over all of B (jattn._fused_cpu)
            offsets = dict(q_offset=plan.q_offset, kv_offset=plan.kv_offset)
            window = dict(window=plan.fused, scale=plan.scale, threads=plan.threads)
            outs = _fused_cpu.forward(q, k, v, length=plan.S, **offsets, **window)
            return vary(outs, q, k, v), ()  # under shard_map, varying as q, k, v (a custom call's results are not)

        def body(xs, a, group):
            *big, rows, seeds, sinks = xs
            rows, seeds, sinks = map(group.of, (rows, seeds, sinks))
            return _forward(*big, rows, seeds, sinks, _group_kinds(a[0]), a[1:], consts, plan, precision, group), ()

        return _by_group(plan, body, (q, k, v, rows, seeds, sinks), (kind, *arrays))

    def backward(q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays, consts):
        def body(xs, a, group):  # ((dq, dk, dv), own db), (dc, shared db)
            *big, lse, delta, rows, seeds = xs
            lse, delta, rows, seeds = map(group.of, (lse, delta, rows, seeds))
            return _backward(*big, lse, delta, rows, seeds, _group_kinds(a[0]), a[1:], consts, plan, precision, group)

        # delta for all of B before the groups: computed inside a group, XLA fuses its reduction
        # into the tile's dO vᵀ product, 1.5x slower (T = 2048 on 2 threads, one tile a head)
        lse, delta = backward_rows(out, d_out, lse, plan.compute, d_lse)
        return _by_group(plan, body, (q, k, v, d_out, lse, delta, rows, seeds), (kind, *arrays))

    foldable = plan.mod is None and not plan.bias
    return _folding(forward, foldable, plan.shared), _folding(backward, foldable, plan.shared)


def _group_kinds(kinds: Array) -> Array:
    """A group's rows' kinds ``(b|1, ...)`` as one (:func:`jattn._masks.reduce_kinds`), a split kind kept where a row has it.

    A tile's rows share its static split kind, or are EMPTY on device (:meth:`_Plan.run`).
    """
    split = jnp.max(jnp.where(kinds >= LOWER, kinds, jnp.int8(EMPTY)), axis=0)
    return jnp.where(split != EMPTY, split, reduce_kinds(kinds))


def _folding(kernel, foldable: bool = True, shared: tuple[int, ...] = ()):
    """``kernel(*xs, kind, arrays, consts)`` whose ``vmap`` folds the mapped axis into B.

    Each of ``xs`` is ``(B, ...)``, and the tile kinds and each mask array ``(B|1, ...)``; under
    ``vmap`` of size n they become ``(n·B, ...)`` (broadcast where unmapped), so the tiles are
    those of an explicit batch of n·B rather than n-fold larger ones, and a mapped mask keeps its
    per-row tile kinds. With a score modification (``foldable=False``) it batches element by
    element: the converted function is specialised to the tile shapes, and the gradients of the
    arrays it closes over belong to each mapped element; so too where a mask array every row shares
    (``shared``: the arrays a ``masks.predicate`` closes over) is mapped.
    """
    folding = jax.custom_batching.custom_vmap(kernel)

    @folding.def_vmap
    def rule(n, in_batched, *args):
        *xs, kind, arrays, consts = args
        *xs_batched, kind_batched, arrays_batched, _ = in_batched
        if not foldable or any(arrays_batched[i] for i in shared):
            axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
            outs = jax.vmap(kernel, in_axes=axes)(*args)
            return outs, jax.tree.map(lambda _: True, outs)

        def fold(x, batched, b):  # (n, b, ...) or (b, ...) -> (n·b, ...)
            x = x if batched else jnp.broadcast_to(x, (n, *x.shape))
            return jnp.broadcast_to(x, (n, b, *x.shape[2:])).reshape(n * b, *x.shape[2:])

        def fold_rows(m, batched, b):  # a (b|1, ...) array: kept when shared by every row
            return fold(m, batched, b) if batched or m.shape[0] != 1 else m

        b = xs[0].shape[1] if xs_batched[0] else xs[0].shape[0]
        flat = tuple(fold(x, batched, b) for x, batched in zip(xs, xs_batched, strict=True))
        masks = tuple(fold_rows(m, batched, b) for m, batched in zip(arrays, arrays_batched, strict=True))
        outs = folding(*flat, fold_rows(kind, kind_batched, b), masks, consts)
        outs = jax.tree.map(lambda y: y.reshape(n, b, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folding


_SHARED, _OWN = 1, 2  # a bias (1, T|1, S|1) shared by every row of B, or one (B, T|1, S|1)


class _Run(NamedTuple):
    """The traced part of a plan: the mask's arrays and the run-time kinds of the scheduled tiles.

    ``kind (B|1, nq, width)`` refines the static schedule's kinds, row by row, with what the
    arrays say (EMPTY tiles are skipped on device); ``arrays`` are the mask's array leaves in row
    form (:meth:`jattn._masks.Mask._rows`), each ``(B|1, ...)``: boolean ``(B|1, T|1, S|1)``,
    padding lengths ``(B|1,)``, segment ids ``(B|1, T)`` and ``(B|1, S)``; empty without them.
    """

    kind: Array
    arrays: tuple[Array, ...]


class _Plan:
    """Static facts of one call: sizes, blocks, the mask's skeleton and its block schedule (hashable).

    Array leaves of the mask are slots here (:func:`jattn._masks.split_arrays`): statically
    every tile they touch is scheduled, and :class:`_Run` carries their arrays and run-time kinds.
    """

    def __init__(
        self,
        T, S, bq, bk, mask, q_offset, kv_offset, scale, compute, platform, threads, mod=None, sinks=False, bias=False,
        dropout=0.0, fused=None,
    ):  # fmt: skip
        self.fused = fused  # (left, right): the forward is the fused CPU kernel's for this key interval (or None)
        self.T, self.S, self.bq, self.bk, self.platform, self.threads = T, S, bq, bk, platform, threads
        self.mod, self.sinks = mod, sinks  # the closure-converted score_mod (or None); whether rows have sinks
        self.dropout = dropout  # the dropout rate (0.0: none)
        self.bias = bias  # 0, or the last of the kernels' arrays is a bias with _SHARED or _OWN rows
        self.nq, self.nk = -(-T // bq), -(-S // bk)
        self.mask, self.q_offset, self.kv_offset = mask, q_offset, kv_offset
        self.scale, self.compute = scale, compute
        # Keys past S (block padding) are masked by a "key position < kv_offset + S" predicate.
        limit = KeyBelow(kv_offset + S)
        self.predicate = limit if mask is None else mask & limit
        kinds = static_kinds(mask, T, S, bq, bk, q_offset, kv_offset, halve=mod is None and not bias and not dropout)
        self.splits = tuple(k for k in SPLIT_AREA if np.any(kinds == k))  # the kinds computed in parts
        self.index, self.kind = schedule(kinds)  # per query block: its key blocks
        self.count = (self.kind != EMPTY).sum(1).astype(np.int32)  # per query block: its scheduled key blocks
        self.full = (self.kind == FULL).sum(1).astype(np.int32)  # per query block: its FULL ones, scheduled first
        same = self.kind[0, 0] if np.all(self.kind == self.kind[0, 0]) else EMPTY
        self.uniform = None if same == EMPTY else int(same)  # every scheduled tile of one kind
        self.kinds = tuple(int(x) for x in np.unique(self.kind))  # the kinds that occur (EMPTY: padding)
        # On CPU, with static kinds, a loop without a branch takes each query block's FULL tiles (sweep).
        self.lead = platform == "cpu" and self.uniform is None and bool(self.full.any())
        self._key = (
            T, S, bq, bk, mask, q_offset, kv_offset, scale, compute, platform, threads, mod, sinks, bias, dropout, fused,
        )  # fmt: skip
        self.shared = shared_arrays(mask)  # mask arrays every row shares: they never fold under vmap

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Plan) and self._key == other._key

    def group(self, b: int) -> int:
        """Rows of a leading axis of ``b`` per tile on this plan's platform and threads (:func:`jattn._platform.group_size`)."""
        return _platform.group_size(b, self.bq, self.bk, jnp.dtype(self.compute).itemsize, self.platform, self.threads)

    def predicate_with(self, arrays: tuple[Array, ...]) -> Mask:
        """The mask with its arrays put back and placed at this call's offsets."""
        return fill_arrays(self.predicate, arrays)._bind(self.q_offset, self.kv_offset)

    def positions(self, i: Array, j: Array) -> tuple[Array, Array]:
        """Absolute positions ``(bq,)`` of query block i and ``(bk,)`` of key block j (int32, traced)."""
        rows = self.q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
        return rows, self.kv_offset + j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)

    def split(self, arrays: tuple[Array, ...]) -> tuple[tuple[Array, ...], Array | None]:
        """The kernels' arrays as the mask's arrays and the bias ``(b|1, T|1, S|1)`` (or None)."""
        return (arrays[:-1], arrays[-1]) if self.bias else (arrays, None)

    def bias_window(self, bias: Array, i: Array, j: Array) -> tuple[tuple, tuple]:
        """Start and size of tile (i, j) in a bias ``(b|1, T|1, S|1)`` (a unit axis is read whole)."""
        start = (0, i * self.bq if bias.shape[1] > 1 else 0, j * self.bk if bias.shape[2] > 1 else 0)
        start = tuple(jnp.asarray(x, jnp.int32) for x in start)  # one index type (i may be int64 under x64)
        size = (bias.shape[0], self.bq if bias.shape[1] > 1 else 1, self.bk if bias.shape[2] > 1 else 1)
        return start, size

    def biased(self, s: Array, bias: Array | None, i: Array, j: Array) -> Array:
        """Scores ``s (b, bq, bk)`` plus the bias's tile (i, j)."""
        if bias is None:
            return s
        start, size = self.bias_window(bias, i, j)
        return s + jax.lax.dynamic_slice(bias, start, size).astype(self.compute)

    def modifier(self, i: Array, j: Array, rows: Array):
        """``mod(s, consts)`` of tile (i, j) for the rows ``(B, 2)`` (:func:`jattn._online.bind_mod`), or None."""
        return None if self.mod is None else bind_mod(self.mod, rows, *self.positions(i, j), self.compute)

    def dropped(self, i: Array, j: Array, seeds: Array) -> Array | None:
        """Dropout's factor ``(b, bq, bk)`` on tile (i, j) of the rows with ``seeds (b,)``, or None without dropout.

        The bits come from the tile's indices in the ``(T, S)`` grid, not its block numbers, so any
        tiling (and the dense path) gives the same ones (:mod:`jattn._dropout`).
        """
        if not self.dropout:
            return None
        t = i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
        s = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
        keep = keep_mask(seeds[:, None, None], t[None, :, None], s[None, None, :], self.dropout)
        return keep_scale(keep, self.dropout, self.compute)

    def allowed(self, i: Array, j: Array, arrays: tuple[Array, ...]) -> Array:
        """``(1|B, bq, bk)`` mask of query block i against key block j (block indices, traced)."""
        rows, cols = self.positions(i, j)
        keep = self.predicate_with(arrays).allowed(rows[:, None], cols[None, :])
        keep = keep.reshape((1,) * (3 - keep.ndim) + keep.shape)  # a mask of keys alone is (1, 1, bk)
        return jnp.broadcast_to(keep, (keep.shape[0], self.bq, self.bk))  # whole, so LOWER tiles can cut it

    def prescale(self, q: Array) -> tuple[Array, float]:
        """A query block ``q (B, bq, D)`` with the logit scale folded in, and the scale left for the scores.

        Folding it into q saves a pass over every score tile, and keeps the scores one rounded dot
        product: a scale multiplied onto them can fuse with the max subtraction into one
        multiply-add (XLA on CPU), leaving the row maximum's exponent below 0 (see jattn._core).
        A 16-bit q is upcast first, so its scaled values are not rounded again.
        """
        return q.astype(self.compute) * jnp.asarray(self.scale, self.compute), 1.0

    def scores(self, qb: Array, kb: Array, i: Array, j: Array, masked: bool, precision, arrays=(), scale=None) -> tuple:
        """Scaled scores ``(B, bq, bk)`` and, for a partial block, its mask ``(1|B, bq, bk)``.

        ``scale`` (default the plan's) is what :meth:`prescale` left for the scores.
        """
        s = scaled_scores(qb, kb, self.scale if scale is None else scale, self.compute, precision)
        return s, (self.allowed(i, j, arrays) if masked else None)

    def run(self, arrays: tuple[Array, ...]) -> _Run:
        """The traced schedule kinds: the static ones, refined on device per row where the mask has arrays."""
        if not arrays:
            return _Run(jnp.asarray(self.kind)[None], ())
        kinds = row_kinds(
            self.predicate_with(arrays),
            self.nq * self.bq,
            self.nk * self.bk,
            self.bq,
            self.bk,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
        )  # (B|1, nq, nk)
        rows = np.arange(self.index.shape[0])[:, None]  # padding entries of the schedule stay EMPTY
        static = jnp.asarray(self.kind)[None]  # (1, nq, width)
        kind = kinds[:, rows, self.index]  # (B|1, nq, width)
        kind = jnp.where((static >= LOWER) & (kind != EMPTY), static, kind)  # a split tile is never FULL
        return _Run(jnp.where(static == EMPTY, jnp.int8(EMPTY), kind), arrays)

    def branches(self, arrays: tuple[Array, ...]) -> tuple[int | None, tuple[int, ...] | None]:
        """:func:`jattn._online.per_block`'s ``uniform`` and ``kinds``: static only without mask arrays.

        FULL is left out where :meth:`sweep` takes those tiles in a loop of their own.
        """
        if arrays:
            return None, None
        return self.uniform, tuple(k for k in self.kinds if not (self.lead and k == FULL))

    def sweep(
        self,
        key_block: Callable[[Tree, tuple[Array, Array | int]], tuple[Tree, None]],
        carry: Tree,
        i: Array,
        index,
        kind,
        static: bool,
    ) -> Tree:
        """``key_block(carry, (j, kind))`` over query block i's scheduled key blocks, in order.

        On CPU, where query blocks have different numbers of key blocks (causal, windows), the
        loop runs that block's count, not the schedule's padded width (whose EMPTY entries would
        each still cost a branch). Elsewhere a loop of unknown trip count would read its
        condition back to the host every step: the padded scan is kept. With ``static`` kinds
        (no mask arrays) a CPU loop takes a block's leading FULL tiles first with ``kind`` the
        int FULL, no branch: a branch's result is copied into the loop's state every step (the
        forward's accumulator, 6.5 us of a 270 us 1024 x 128 tile on one thread).
        """
        lead = self.lead and static  # FULL tiles first, unbranched
        if not lead and not (self.platform == "cpu" and np.any(self.count != self.count[0])):
            return jax.lax.scan(key_block, carry, (index[i], kind[i]))[0]

        def loop(start, stop, carry, full: bool) -> Tree:
            def step(n: Array, carry: Tree) -> Tree:
                return key_block(carry, (index[i, n], FULL if full else kind[i, n]))[0]

            return jax.lax.fori_loop(start, stop, step, carry)

        count = jnp.asarray(self.count)
        if not lead:
            return loop(0, count[i], carry, full=False)
        full = jnp.asarray(self.full)
        return loop(full[i], count[i], loop(0, full[i], carry, full=True), full=False)

    def parts(self, kind: int) -> tuple[tuple[slice, slice | None], ...]:
        """A split tile's rows, in order, each with the keys it is computed against (None: not computed).

        LOWER: top rows x first keys, bottom rows x all keys; TOP_EMPTY: the empty quarters of rows
        x none, the rest x all keys; STAIRS: quarter r of the rows x the first r + 1 quarters of keys.
        """
        if kind == LOWER:
            return (slice(0, self.bq // 2), slice(0, self.bk // 2)), (slice(self.bq // 2, None), slice(None))
        if kind == STAIRS:
            q4, k4 = self.bq // 4, self.bk // 4
            return tuple((slice(r * q4, (r + 1) * q4), slice(0, (r + 1) * k4)) for r in range(4))
        top = (TOP_EMPTY.index(kind) + 1) * self.bq // 4
        return (slice(0, top), None), (slice(top, None), slice(None))


class _Rows(NamedTuple):
    """One group's rows ``start .. start + size`` of the flattened leading axis B, read from the whole arrays.

    The group's blocks are sliced from ``(B, ...)`` inside the loops, so no group or blocked
    copy of q, k, v (or of out and its cotangent) is ever made (T=32768: 5 copies of 32 MiB).
    """

    start: Array | int
    size: int

    def of(self, x: Array) -> Array:
        """``x (B, ...)`` -> the group's ``(size, ...)``."""
        return x if x.shape[0] == self.size else jax.lax.dynamic_slice_in_dim(x, self.start, self.size)

    def block(self, x: Array, n: Array, length: int) -> Array:
        """Block n ``(size, length, ...)`` of the group's rows of ``x (B, n·length, ...)``."""
        starts = tuple(jnp.asarray(i, jnp.int32) for i in (self.start, n * length, *(0,) * (x.ndim - 2)))
        return jax.lax.dynamic_slice(x, starts, (self.size, length, *x.shape[2:]))


def _put(x: Array, n: Array, size: int, block: Array) -> Array:
    """``x (b, L, ...)`` with its block n ``(b, size, ...)`` replaced by ``block`` (in place in a loop)."""
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), n * size, axis=1)


def _by_group(plan: _Plan, body, xs: tuple[Array, ...], arrays: tuple[Array, ...]):
    """``body(xs, arrays, group)`` over groups of ``plan.group(B)`` rows of B, one group after another.

    Each of ``xs`` is ``(B, ...)`` and passed whole, ``group`` (:class:`_Rows`) says which rows are
    the group's; mask ``arrays`` are ``(B|1, ...)`` (shared when 1) and passed as the group's rows.
    ``body`` returns ``(rows, summed)``: the leaves of ``rows`` are ``(group, ...)`` and come back as
    ``(B, ...)``; those of ``summed`` (gradients of shared arrays) are summed over the groups.
    """
    b = xs[0].shape[0]
    h = plan.group(b)
    if h == b:
        return body(xs, arrays, _Rows(0, b))

    def one(start):
        group = _Rows(start, h)
        return body(xs, tuple(group.of(a) if a.shape[0] != 1 else a for a in arrays), group)

    out, summed = jax.lax.map(one, jnp.arange(0, b, h, dtype=jnp.int32))
    return jax.tree.map(lambda y: y.reshape(b, *y.shape[2:]), out), jax.tree.map(lambda y: y.sum(0), summed)


def _add_block(xt: Array, n: Array, size: int, block: Array) -> Array:
    """``xt (b, X, L)`` with ``block (b, X, size)`` added to its columns ``n·size ..`` (in place in a loop)."""
    start = n * size
    return jax.lax.dynamic_update_slice_in_dim(xt, jax.lax.dynamic_slice_in_dim(xt, start, size, 2) + block, start, 2)


def _forward(
    q, k, v, rows, seeds, sinks, kind: Array, arrays: tuple[Array, ...], consts, plan: _Plan, precision, group: _Rows
):
    """``out (b, nq·bq, E)``, ``lse`` and max logit ``(b, nq·bq)`` of the group's b rows of B.

    Per query block, a loop over its key blocks (:meth:`_Plan.sweep`); q, k, v are whole
    ``(B, ...)``, the rest the group's.
    """
    inputs = (q, k, v, rows, seeds, sinks, *arrays, *consts)

    def fresh(tree):  # a loop's initial state, varying as the inputs do under shard_map
        return vary(tree, *inputs)

    arrays, bias = plan.split(arrays)
    index = jnp.asarray(plan.index)
    b, e = group.size, v.shape[-1]

    def query_block(outs, i):
        qb, scale = plan.prescale(group.block(q, i, plan.bq))  # per query block: no scaled copy of all of q

        def key_block(carry, jk):
            j, kd = jk

            def update(carry, masked):
                s, keep = plan.scores(qb, group.block(k, j, plan.bk), i, j, masked, precision, arrays, scale)
                s = plan.biased(s, bias, i, j)
                mod = plan.modifier(i, j, rows)
                s = s if mod is None else mod(s, consts)
                drop = plan.dropped(i, j, seeds)
                return accumulate(carry, s, keep, group.block(v, j, plan.bk), precision, plan.compute, drop)

            def split(carry, kind):  # a tile as its parts, each row's state updated by its own part (or kept)
                kb, vb, keep = group.block(k, j, plan.bk), group.block(v, j, plan.bk), plan.allowed(i, j, arrays)
                parts = []
                for r, c in plan.parts(kind):
                    state = tuple(x[:, r] for x in carry)
                    if c is not None:
                        s = scaled_scores(qb[:, r], kb[:, c], scale, plan.compute, precision)
                        state = accumulate(state, s, keep[:, r, c], vb[:, c], precision, plan.compute)
                    parts.append(state)
                return tuple(jnp.concatenate(xs, axis=1) for xs in zip(*parts, strict=True))

            splits = {kind: functools.partial(split, kind=kind) for kind in plan.splits}
            return per_block(kd, update, carry, *plan.branches(arrays), splits), None

        init = fresh(empty_state(b, plan.bq, e, plan.compute))
        state = plan.sweep(key_block, init, i, index, kind, static=not arrays)
        sink = sinks[:, None].astype(plan.compute) if plan.sinks else None
        done = finish(state, plan.compute, sink)  # float32 (or 64): the backward's delta needs it unrounded
        return tuple(_put(x, i, plan.bq, y) for x, y in zip(outs, done, strict=True)), None

    t = plan.nq * plan.bq
    outs = fresh((jnp.zeros((b, t, e), plan.compute), jnp.zeros((b, t), plan.compute), jnp.zeros((b, t), plan.compute)))
    outs, _ = jax.lax.scan(query_block, outs, jnp.arange(plan.nq, dtype=jnp.int32))  # written block by block
    return outs


def _backward(
    q, k, v, d_out, lse, delta, rows, seeds, kind: Array, arrays, consts, plan: _Plan, precision, group: _Rows
):
    """``(dq (b, T, D), dk (b, S, D), dv (b, S, E))`` and the consts' gradients of the group's b rows of B.

    One sweep over the group's tiles; q, k, v and d_out are whole ``(B, ...)``, the rest the
    group's: ``lse`` and ``delta`` ``(b, T)`` as :func:`jattn._online.backward_rows` gives them.

    Per query block, a loop over its non-empty key blocks recomputes ``p`` from the saved
    ``lse`` and adds each tile's shares (:func:`jattn._online.tile_grads`): dq in the small carry,
    dk and dv, transposed, into their key block of the group's ``(b, D|E, S)`` accumulators, in place.
    """
    compute = plan.compute
    inputs = (q, k, v, d_out, lse, delta, rows, seeds, *arrays, *consts)

    def fresh(tree):  # a loop's initial state, varying as the inputs do under shard_map
        return vary(tree, *inputs)

    arrays, bias = plan.split(arrays)
    index, scale = jnp.asarray(plan.index), jnp.asarray(plan.scale, compute)
    b = group.size
    whole = _Rows(0, b)  # lse and delta are the group's already

    def query_block(carry, i):
        qb, dob = group.block(q, i, plan.bq), group.block(d_out, i, plan.bq)  # (b, bq, D|E)
        lse_i, delta_i = whole.block(lse, i, plan.bq), whole.block(delta, i, plan.bq)  # (b, bq)
        qb_scaled, s_scale = plan.prescale(qb)  # per query block: no scaled copy of all of q
        qt, dot = transposed(qb), transposed(dob)  # (b, D|E, bq), for tile_grads

        def key_block(carry, jk):
            j, kd = jk
            dq, dk, dv, dc, db = carry
            kb, vb = group.block(k, j, plan.bk), group.block(v, j, plan.bk)  # (b, bk, D|E)
            window = None if bias is None else plan.bias_window(bias, i, j)

            def update(_, masked):
                s, keep = plan.scores(qb_scaled, kb, i, j, masked, precision, arrays, s_scale)
                s = plan.biased(s, bias, i, j)
                mod = plan.modifier(i, j, rows)
                p, ds, gc, dx = score_grads(
                    s, keep, lse_i, dob, vb, delta_i, scale, precision, compute, mod, consts,
                    plan.dropped(i, j, seeds),
                )  # fmt: skip
                if bias is None:
                    gb = ()
                else:  # the tile's dx summed over the axes where the bias broadcasts
                    axes = tuple(a for a, n in enumerate(window[1]) if n == 1 and dx.shape[a] != 1)
                    gb = jnp.sum(dx, axes, keepdims=True) if axes else dx
                return (*tile_grads(p, ds, qt, kb, dot, precision, compute), gc, gb)

            def split(zeros, kind):  # a tile as its parts (no modification, bias or dropout here)
                keep, gq, (zq, gk, gv, gc, gb) = plan.allowed(i, j, arrays), [], zeros
                for r, c in plan.parts(kind):
                    if c is None:  # rows not computed: no share of dq
                        gq.append(zq[:, r])
                        continue
                    s = scaled_scores(qb_scaled[:, r], kb[:, c], s_scale, compute, precision)
                    p, ds, _, _ = score_grads(
                        s, keep[:, r, c], lse_i[:, r], dob[:, r], vb[:, c], delta_i[:, r], scale, precision, compute
                    )
                    dq_r, dk_c, dv_c = tile_grads(p, ds, qt[..., r], kb[:, c], dot[..., r], precision, compute)
                    gq.append(dq_r)
                    gk, gv = gk.at[..., c].add(dk_c), gv.at[..., c].add(dv_c)
                return jnp.concatenate(gq, axis=1), gk, gv, gc, gb

            zeros = fresh((
                jnp.zeros_like(dq), jnp.zeros((*dk.shape[:2], plan.bk), compute),
                jnp.zeros((*dv.shape[:2], plan.bk), compute),
                jax.tree.map(jnp.zeros_like, dc),
                () if bias is None else jnp.zeros(window[1], compute),
            ))  # fmt: skip
            splits = {kind: functools.partial(split, kind=kind) for kind in plan.splits}
            gq, gk, gv, gc, gb = per_block(kd, update, zeros, *plan.branches(arrays), splits)
            dc = jax.tree.map(jnp.add, dc, gc)
            if bias is not None:
                db = jax.lax.dynamic_update_slice(db, jax.lax.dynamic_slice(db, *window) + gb, window[0])
            dk, dv = _add_block(dk, j, plan.bk, gk), _add_block(dv, j, plan.bk, gv)
            return (dq + gq, dk, dv, dc, db), None

        dq_all, *carry = carry
        init = (fresh(jnp.zeros((b, plan.bq, q.shape[-1]), compute)), *carry)
        dq, dk, dv, dc, db = plan.sweep(key_block, init, i, index, kind, static=not arrays)
        return (_put(dq_all, i, plan.bq, dq), dk, dv, dc, db), None

    db = () if bias is None else jnp.zeros(bias.shape, compute)
    carry = fresh(
        (
            jnp.zeros((b, *q.shape[1:]), compute),
            jnp.zeros((b, k.shape[2], k.shape[1]), compute),
            jnp.zeros((b, v.shape[2], v.shape[1]), compute),
            jax.tree.map(jnp.zeros_like, consts),
            db,
        )
    )  # fmt: skip  dk and dv transposed, (b, D|E, S), as tile_grads gives them
    (dq, dk, dv, dc, db), _ = jax.lax.scan(query_block, carry, jnp.arange(plan.nq, dtype=jnp.int32))
    grads = dq.astype(q.dtype), transposed(dk).astype(k.dtype), transposed(dv).astype(v.dtype)
    db = () if bias is None else (db.astype(bias.dtype),)
    own = plan.bias == _OWN  # a bias with rows of its own comes back by rows, a shared one summed over groups
    return ((grads, db), (dc, ())) if own else ((grads, ()), (dc, db))


def _flash_fwd(q, k, v, rows, seeds, sinks, consts, bias, run, plan, back, precision):
    forward, _ = _kernels(plan, precision)
    (out, lse, mx), _ = forward(q, k, v, rows, seeds, sinks, run.kind, run.arrays + bias, consts)
    return (out, lse, mx), (q, k, v, rows, seeds, sinks, consts, bias, run, out, lse)


def _flash_bwd(plan: _Plan, back: _Plan, precision, res, cotangents):
    """The flash-attention backward: one sweep over ``back``'s non-empty tiles per group (:func:`_backward`)."""
    q, k, v, rows, seeds, sinks, consts, bias, run, out, lse = res
    d_out, d_lse, _ = cotangents  # the max logit is a monitor without a gradient (jattn.attention)

    _, backward = _kernels(back, precision)
    kind = run.kind if back is plan else back.run(run.arrays).kind
    arrays = run.arrays + bias
    ((dq, dk, dv), own), (dconsts, shared) = backward(
        q, k, v, out, lse, d_out, d_lse, rows, seeds, kind, arrays, consts
    )
    dsinks = jnp.zeros_like(sinks)
    if plan.sinks:
        _, delta = backward_rows(out, d_out, lse, plan.compute, d_lse)
        dsinks = sink_grads(sinks[:, None].astype(plan.compute), lse, delta).sum(-1).astype(sinks.dtype)
    grads = sum_to((dq, dk, dv, dsinks, dconsts, own + shared), (q, k, v, sinks, consts, bias))  # for shard_map
    dq, dk, dv, dsinks, dconsts, dbias = grads
    return dq, dk, dv, None, None, dsinks, dconsts, dbias, None


_flash.defvjp(_flash_fwd, _flash_bwd)


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
) -> tuple[Array, Array, Array]:
    """Blockwise attention of validated ``q (..., T, D)``, ``k (..., S, D)``, ``v (..., S, E)``.

    ``mask`` is a position predicate, possibly with array leaves ``(..., T, S)`` that broadcast
    against the leading dimensions. ``score_mod`` and ``sinks`` (broadcastable to the leading
    dimensions), ``dropout_rate`` and ``dropout_rng`` are as for :func:`jattn.attention`. Returns ``out (..., T, E)``, ``lse (..., T)``
    and the row max logit ``(..., T)``; see the module docstring. The platform
    (:func:`platform`) and, on CPU, the threads (:func:`cpu_threads`) pick the tiling of the leading
    axis (:func:`jattn._platform.group_size`). ``backward_block`` (optional) tiles the backward where the forward's
    tiles are of several kinds (not all FULL), its sides divide the forward's and there is no
    ``score_mod``; else the backward takes the forward's tiles. ``fused``: on CPU, the forward may
    be the fused kernel (:func:`fused_forward`), its tiles its own.
    """
    T, S = q.shape[-2], k.shape[-2]
    lead = broadcast_all(q=q, k=k, v=v, bias=bias)
    if mask is not None:
        lead, mask = call_rows(mask, q, k, v, bias)  # every array leaf as rows (B|1, ...) of lead flattened
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
    bias_t, kind = (), 0
    if bias is not None:  # (B|1, T|1, S|1), padded like q and k where it has those axes
        bias_f = _flat_mask(bias, lead)
        bias_f = _pad(bias_f, 1, bq) if bias_f.shape[1] > 1 else bias_f
        bias_t, kind = (
            (_pad(bias_f, 2, bk) if bias_f.shape[2] > 1 else bias_f,),
            _OWN if bias_f.shape[0] > 1 else _SHARED,
        )
    facts = (
        skeleton, int(q_offset), int(kv_offset), float(scale), compute, *where, mod, sinks is not None, kind,
        float(dropout_rate),
    )  # fmt: skip
    window = key_interval(skeleton) if fused and not arrays else None
    plain = score_mod is None and sinks is None and bias is None and not dropout_rate and precision is None
    use = window is not None and plain and fused_forward(compute, where[0])
    plan = back = _Plan(T, S, bq, bk, *facts, fused=window if use else None)
    if use:  # the backward keeps XLA's tiles (the forward's or backward_block's)
        back = _Plan(T, S, bq, bk, *facts)
    if backward_block is not None and score_mod is None and plan.uniform is None:  # mod: converted for plan's tiles
        bqb, bkb = min(backward_block[0], bq), min(backward_block[1], bk)
        if (bqb, bkb) != (bq, bk) and bq % bqb == 0 and bk % bkb == 0:  # q, k, v padded for both
            back = _Plan(T, S, bqb, bkb, *facts)
    run = plan.run(arrays)
    padded = _pad(qf, 1, bq), _pad(kf, 1, bk), _pad(vf, 1, bk)
    flat = jnp.arange(b, dtype=jnp.int32)  # each row's flat leading index
    seeds = row_seeds(dropout_rng, flat) if dropout_rate else jnp.zeros((b,), jnp.uint32)
    out, lse, mx = _flash(*padded, head_rows(lead), seeds, sinks_f, consts, bias_t, run, plan, back, precision)
    out = out[:, :T].reshape(*lead, T, v.shape[-1]).astype(v.dtype)
    return out, lse[:, :T].reshape(*lead, T), mx[:, :T].reshape(*lead, T)


def fused_forward(compute, platform: str) -> bool:
    """Whether a forward computing in ``compute`` on ``platform`` can be the fused CPU kernel (:mod:`jattn._fused_cpu`).

    On CPU, float32 (16-bit inputs upcast), where the kernel is built for an AVX-512 CPU and not
    switched off (``JATTN_FUSED_CPU=0``); the call must also have a key interval mask (none,
    causal, sliding windows) and no score_mod, sinks, bias, dropout or precision.
    """
    return platform == "cpu" and compute == jnp.float32 and _fused_cpu.available()


def _flat_mask(m: Array, lead: tuple[int, ...]) -> Array:
    """A mask array ``(..., T|1, S|1)`` as ``(1, ...)`` when it has no leading extent, else ``(B, ...)``."""
    if all(n == 1 for n in m.shape[:-2]):
        return m.reshape(1, *m.shape[-2:])
    return flat_lead(m, lead)
