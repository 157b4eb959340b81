"""The Mosaic GPU version of the paged kernel (Hopper sm_90): :mod:`jattn._paged.pallas`' grid and math on ``wgmma``.

The same query blocks, block table, splits of :data:`jattn._paged.fused.SPLIT_KV` keys and log-sum-exp merge as
the Triton kernel (imported from :mod:`jattn._paged.pallas`); the program of block ``i``, kv head ``h`` and split
``s`` holds the group's ``G·t`` rows (the Triton kernel's less its power-of-two padding) padded to a multiple of
64 (``wgmma`` blocks of one warpgroup), copies its query rows into shared memory by TMA once, then walks the
split's pages in key order: each
step reads the page id from ``page_table`` in global memory and TMA copies that page's k and v tiles (a dynamic
page index and a column offset ``h·D`` of the pool viewed as ``(P, Z, K·D)``, no copy of the pool) into
shared memory, where ``wgmma`` forms the scores and ``p v`` in float32 registers (online softmax, as
:mod:`jattn._gpu.mosaic_forward`). Rows' positions are iotas of the block's first position, so no row array is
read. bfloat16 and float16 only (float32 is refused by name: the Triton kernel takes it); head depths multiples
of 64 up to 256, pages of a multiple of 64 tokens. Interpreted on CPU from jax 0.12 (``jattn._gpu.mosaic_launch``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._gpu import mosaic_launch
from jattn._gpu import mosaic_load as load
from jattn._gpu import mosaic_swizzled as swizzled
from jattn._masks import UNBOUNDED, key_interval
from jattn._paged.blocks import BLOCK_Q, block_queries, no_rows
from jattn._paged.checks import Paged
from jattn._paged.pallas import block_table, merge, split_pages

__all__ = ["forward", "refusal"]

#: jax 0.12's interpreter runs Mosaic GPU kernels on CPU; 0.10's lacks register layouts (as jattn._gpu's kernels).
INTERPRETS = jax.__version_info__ >= (0, 12)
#: Whether the interpreter checks the kernel's shared memory for data races (slower; a test switches it on).
DETECT_RACES = False
#: The rows of one ``wgmma`` block (a warpgroup).
ROWS = 64
#: The largest float32 accumulator a warpgroup holds in registers (rows times E: 64 x 256, 128 per thread).
MAX_ACC = 64 * 256
#: The shared memory a block may ask on sm_90, bytes (227 KiB: Mosaic GPU's lowering checks it, and raises past it).
SMEM_LIMIT = 227 * 1024
#: Bytes Mosaic GPU adds to the kernel's own tiles (alignment, its barriers' and rows' padding): 2,560-2,816 measured
#: over Z 64-256, D = E 64-256, 64 and 128 rows (by lowering; tests/test_paged_mosaic.py checks what it refuses).
SMEM_RESERVE = 3 * 1024
_NEG = -float("inf")


assert BLOCK_Q & (BLOCK_Q - 1) == 0, "a row's position within its block is its row index & (BLOCK_Q - 1)"


def _rows(p: Paged) -> int:
    """A program's rows: the group's ``G·t`` rounded up to a multiple of :data:`ROWS` (one or more wgmma blocks)."""
    return -(-p.group * BLOCK_Q // ROWS) * ROWS


def refusal(p: Paged, interpret: bool) -> str | None:
    """Why the Mosaic GPU kernel cannot take the call (after :func:`jattn._paged.pallas.refusal`'s own), or None."""
    dtype = jnp.dtype(p.q.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{dtype} inputs (the Mosaic GPU kernel takes bfloat16 and float16: wgmma multiplies float32 as tf32)"
    if interpret and not INTERPRETS:
        return f"the Mosaic GPU kernel is interpreted from jax 0.12 (jax {jax.__version__}'s interpreter cannot)"
    Z, D, E = p.k_pages.shape[1], p.q.shape[2], p.v_pages.shape[3]
    if Z % 64:
        return f"pages of Z = {Z} tokens (the Mosaic GPU kernel takes multiples of 64)"
    if any(n % 64 or n > 256 for n in (D, E)):
        return f"head depths D = {D}, E = {E} (the Mosaic GPU kernel takes multiples of 64 up to 256)"
    if _rows(p) * E > MAX_ACC:
        return f"{_rows(p)} rows of E = {E} (a group of {p.group}: over a warpgroup's {MAX_ACC} accumulators)"
    if (need := shared_bytes(_rows(p), Z, D, E) + SMEM_RESERVE) > SMEM_LIMIT:
        return (
            f"pages of Z = {Z} tokens at D = {D}, E = {E} with {_rows(p)} rows (the Mosaic GPU kernel's tiles need "
            f"about {need} bytes of shared memory, over a block's {SMEM_LIMIT})"
        )
    return None


def shared_bytes(rows: int, Z: int, D: int, E: int) -> int:
    """The kernel's own shared memory, bytes: the query block, a page of k and of v (16-bit), the float32 output."""
    return 2 * (rows * D + Z * D + Z * E) + 4 * (rows * E + rows) + 3 * 8


def forward(p: Paged, *, interpret: bool) -> tuple[Array, Array]:
    """``out (Q, N, E)`` and ``lse (Q, N)``, float32, as :func:`jattn._paged.pallas.forward`, on Mosaic GPU."""
    Q, N, D = p.q.shape
    E = p.v_pages.shape[3]
    out, lse = no_rows(p)
    if Q == 0 or p.page_table.shape[0] == 0:
        return out, lse
    request, token, q_pos, q = block_queries(p)
    (B, t), K, G = token.shape, p.k_pages.shape[2], p.group
    bq = _rows(p)
    q = q.reshape(B, K, G * t, D)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, bq - G * t), (0, 0)))  # rows g·t + row; padding rows at the end
    pos = jnp.where(token >= 0, q_pos, -1)
    table = block_table(p, request, pos)
    used = token >= 0
    row = lax.broadcasted_iota(jnp.int32, (B, t), 1)
    lo_row = jnp.min(jnp.where(used, row, t), axis=1)
    hi_row = jnp.max(jnp.where(used, row + 1, 0), axis=1)
    rows = jnp.stack([q_pos[:, 0], lo_row, hi_row], axis=1).astype(jnp.int32)  # (B, 3): first position, used rows
    o, row_lse = merge(*_call(p, q, jnp.concatenate([table, rows], axis=1), bq, interpret))
    o = o[:, :, : G * t].reshape(B, K, G, t, E)
    row_lse = row_lse[:, :, : G * t].reshape(B, K, G, t)
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B * t, N, E)
    row_lse = jnp.transpose(row_lse, (0, 3, 1, 2)).reshape(B * t, N)
    dest = jnp.where(used, token, Q).reshape(B * t)  # Q: dropped
    return out.at[dest].set(o, mode="drop"), lse.at[dest].set(row_lse, mode="drop")


def _call(p: Paged, q: Array, table: Array, bq: int, interpret: bool) -> tuple[Array, Array]:
    """The kernel on ``q (B, K, bq, D)`` and ``table (B, 7)``: each split's ``o (B, K, n, bq, E)``, ``lse``."""
    B, K, _, D = q.shape
    P, Z, _, E = p.v_pages.shape
    M = p.page_table.shape[1]
    per_split = split_pages(Z)
    n = -(-M // per_split)
    k = p.k_pages.reshape(P, Z, K * D)  # free: a page's kv head h is columns h·D..(h+1)·D
    v = p.v_pages.reshape(P, Z, K * E)
    left, right = key_interval(p.mask)
    scratch = [  # shared_bytes counts them
        swizzled((bq, D), q.dtype),
        swizzled((Z, D), q.dtype),
        swizzled((Z, E), q.dtype),
        plgpu.SMEM((bq, E), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        *(plgpu.Barrier(num_arrivals=1) for _ in range(3)),
    ]
    kernel = functools.partial(_kernel, float(p.scale), left, right, per_split, P)
    return mosaic_launch(
        kernel,
        name="jattn_mosaic_paged",
        out_type=[
            jax.ShapeDtypeStruct((B, K, n, bq, E), jnp.float32),
            jax.ShapeDtypeStruct((B, K, n, bq), jnp.float32),
        ],
        scratch_types=scratch,
        grid=(B, K, n),
        grid_names=("i", "h", "s"),
        interpret=interpret,
        detect_races=DETECT_RACES,
    )(table, p.page_table.astype(jnp.int32), q, k.astype(q.dtype), v.astype(q.dtype))


def _masked(x: Array, mine: Array, pos: Array, kv_pos: Array, kv_len: Array, left: int, right: int) -> Array:
    """Scores ``x (bq, Z)``, -inf where the row does not see the key.

    A row sees its block's keys below ``kv_len`` within ``pos - left <= kv_pos <= pos + right``.
    """
    keep = mine & (kv_pos < kv_len)
    if left < UNBOUNDED:
        keep = keep & (kv_pos >= pos - min(left, 2**30))
    if right < UNBOUNDED:
        keep = keep & (kv_pos <= pos + min(right, 2**30))
    return jnp.where(keep, x, _NEG)


def _zero_stale(v_s, fill: Array, layout) -> None:
    """Zeroes the value tile's slots from ``fill`` on, in shared memory, on a request's last page when part filled.

    Those slots are stale (any bits), and a weight of 0 times NaN is NaN.
    """
    Z, E = v_s.shape

    @pl.when(fill < Z)
    def _():
        slot = plgpu.broadcasted_iota(jnp.int32, (Z, E), 0, layout=layout)
        v_s[...] = jnp.where(slot < fill, load(v_s, layout), jnp.zeros((), v_s.dtype))
        plgpu.commit_smem()  # the stores seen by wgmma (async proxy), all the warpgroup's threads


def _kernel(scale, left, right, per_split, P, blocks_ref, pages_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch):
    """One query block, kv head and split: :func:`jattn._paged.pallas._kernel`'s online softmax on ``wgmma``."""
    q_s, k_s, v_s, o_s, lse_s, bar_q, bar_k, bar_v = scratch
    i, h, s = lax.axis_index("i"), lax.axis_index("h"), lax.axis_index("s")
    bq, D = q_s.shape
    Z, E = v_s.shape
    L = plgpu.Layout.WGMMA
    r, kv_len = blocks_ref[i, 0], blocks_ref[i, 1]
    first, lo_row, hi_row = blocks_ref[i, 4], blocks_ref[i, 5], blocks_ref[i, 6]
    plgpu.copy_gmem_to_smem(q_ref.at[i, h], q_s, bar_q)
    plgpu.barrier_wait(bar_q)
    row = jnp.bitwise_and(plgpu.broadcasted_iota(jnp.int32, (bq, Z), 0, layout=L), BLOCK_Q - 1)  # rows g·t + row
    col = plgpu.broadcasted_iota(jnp.int32, (bq, Z), 1, layout=L)
    pos = first + row
    mine = (row >= lo_row) & (row < hi_row)

    def step(j, carry):
        m, den, acc = carry
        page = jnp.clip(pages_ref[r, j], 0, P - 1)  # past a broken table: a page in range (its rows are NaN)
        plgpu.copy_gmem_to_smem(k_ref.at[page, :, pl.ds(h * D, D)], k_s, bar_k)
        plgpu.copy_gmem_to_smem(v_ref.at[page, :, pl.ds(h * E, E)], v_s, bar_v)
        plgpu.barrier_wait(bar_k)

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_s, k_s.T)
            return acc_ref[...]

        x = pl.run_scoped(scores, plgpu.ACC((bq, Z), jnp.float32)) * scale
        x = _masked(x, mine, pos, j * Z + col, kv_len, left, right)
        top = jnp.maximum(m, x.max(axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)  # a row masked so far: its weights are 0, not NaN
        w = jnp.exp(x - lax.broadcast_in_dim(safe, x.shape, [0]))
        alpha = jnp.exp(m - safe)
        plgpu.barrier_wait(bar_v)
        _zero_stale(v_s, kv_len - j * Z, L)  # the page's slots below kv_len: 1..Z (it holds a key below kv_len)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, w.astype(v_s.dtype), v_s)

        acc = pl.run_state(pv)(plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [0])))
        return top, alpha * den + w.sum(axis=1), acc

    init = (
        plgpu.layout_cast(jnp.full((bq,), _NEG, jnp.float32), L.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), L.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), L),
    )
    start = jnp.maximum(blocks_ref[i, 2], s * per_split)
    end = jnp.maximum(jnp.minimum(blocks_ref[i, 3], (s + 1) * per_split), start)
    m, den, acc = lax.fori_loop(start, end, step, init)
    seen = den > 0
    safe = jnp.where(seen, den, 1.0)
    o_s[...] = acc / lax.broadcast_in_dim(safe, acc.shape, [0])
    lse_s[...] = jnp.where(seen, m + jnp.log(safe), _NEG)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[i, h, s])
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[i, h, s])
    plgpu.wait_smem_to_gmem(0)
