"""The Pallas GPU path of paged attention: flash-decoding over pages, lowered by Triton (interpret mode on a CPU).

Shapes follow :mod:`jattn._core` with the paged names of :func:`jattn.paged_attention` (``Q`` query tokens,
``R`` requests, ``P`` pages of ``Z`` tokens, ``M`` pages a request); ``B`` counts query blocks, ``t`` a block's
positions, ``Gp`` the group ``G`` rounded up to a power of two and ``b = Gp·t`` a program's rows.

A query block is up to :data:`BLOCK_Q` consecutive positions of one request, aligned to absolute multiples of
it (the table is built outside the kernel with jnp, as :mod:`jattn._paged.xla` builds its own). The grid is
``(B, K, n)``: the program of block ``i``, kv head ``h`` and split ``s`` holds the ``G`` query heads that read
kv head ``h`` as rows (``g·t + row``: grouped heads without copies of k and v), reads its request's page ids
from ``page_table`` inside the kernel and walks the keys ``[s·SPLIT_KV, (s+1)·SPLIT_KV)`` of the request one
page at a time (a tile of ``Z`` keys, at multiples of ``Z`` from key 0, in key order) with an online softmax in
float32. Keys at or past the request's ``kv_len`` are masked, and so is each query's outside its one key
interval (:func:`jattn._masks.key_interval`: causal, sliding windows). Pages wholly outside every row's
interval are skipped: for a row they mask wholly, a page is an exact no-op. The ``n`` splits (as many as the
table's width holds) are merged by log-sum-exp one after the other in key order outside the kernel, where a
split without keys is an exact no-op too. So a row's bits depend on its own keys alone (batch invariance),
never on the block's other rows, the batch, the table's width or where the pages sit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn import _platform
from jattn._gpu import answer_triton_deprecation, backend_for
from jattn._masks import UNBOUNDED, key_interval
from jattn._paged.blocks import block_queries, no_rows
from jattn._paged.checks import Paged
from jattn._paged.fused import SPLIT_KV

__all__ = [
    "backends",
    "block_table",
    "forward",
    "merge",
    "pow2",
    "refusal",
    "shared_refusal",
    "split_pages",
    "triton_refusal",
]

#: The largest head depth D or value depth E the Triton kernel takes (its tiles hold a page's keys whole).
MAX_DEPTH = 256
#: Shared memory a launch may ask for on the chips of a compute capability from the key on (bytes: sm_80's
#: serves sm_86 and sm_89 too, 99 KiB; sm_90, 227 KiB). The kernel asks for about its two stages of a page's keys
#: and values, ``2 Z (D + E)`` elements (``make compile-check``: 123,008 B for float32, Z 64, D = E = 128; 119,296 B
#: for bfloat16 at D = E = 256; 61,952 B for bfloat16 at 128).
SMEM_LIMIT = {80: 101376, 90: 232448}
#: The largest page of float32 keys (``Z`` times the larger of D, E) whose tile stays within 1 KiB of spills
#: (``make compile-check``, Z = 64: 16 B at D = 64; 1,012 B on sm_80 and 1,240 B on sm_90 at D = 128).
F32_TILE = 64 * 64
_NEG = -float("inf")


def pow2(n: int) -> int:
    """The smallest power of two ``>= n``."""
    return 1 << max(0, int(n) - 1).bit_length()


def refusal(p: Paged, score_mod, interpret: bool) -> str | None:
    """Why the Triton kernel cannot take the call (the reason, to be followed by the path that can), or None.

    :func:`shared_refusal`'s, then lowered for a GPU, pages and head depths the Triton tiles cannot hold.
    """
    return shared_refusal(p, score_mod) or triton_refusal(p, interpret)


def shared_refusal(p: Paged, score_mod) -> str | None:
    """What no Pallas paged kernel takes (Triton's nor Mosaic GPU's), or None.

    A TPU (JAX's ragged paged attention reads another layout), a score_mod, float64, a mask of more than one
    key interval a query.
    """
    if _platform.platform() == "tpu":
        return (
            "on TPU there is no Pallas paged kernel of jattn's layout: JAX's ragged paged attention takes k and v "
            "interleaved in one pool (kv_pages), a different layout"
        )
    if score_mod is not None:
        return "a score_mod"
    if p.q.dtype == jnp.float64:
        return "float64 inputs (it computes in float32)"
    if key_interval(p.mask) is None:
        return f"mask {p.mask!r} (it takes masks of one key interval a query: causal, sliding windows, None)"
    return None


def backends(interpret: bool) -> tuple[str, ...]:
    """The Pallas paged kernels tried in order, the first that takes the call running it (:mod:`jattn._paged.api`).

    On an sm_90 GPU the Mosaic GPU one (:mod:`jattn._paged.mosaic`), then Triton, as
    :func:`jattn._paths.pallas.gpu_backends`; Triton alone elsewhere and in interpret mode (tests choose the Mosaic
    GPU one).
    """
    if not interpret and backend_for(_platform.compute_capability()) == "mosaic_gpu":
        return ("mosaic_gpu", "triton")
    return ("triton",)


def triton_refusal(p: Paged, interpret: bool) -> str | None:
    """Why the Triton kernel cannot take a call :func:`shared_refusal` lets through, or None."""
    if interpret:
        return None
    if not _platform.has_pallas_triton():
        return f"it lowers on Pallas' Triton backend, which jax {jax.__version__} no longer has"
    Z, D, E = p.k_pages.shape[1], p.q.shape[2], p.v_pages.shape[3]
    if Z < 16 or pow2(Z) != Z:
        return f"pages of Z = {Z} tokens (the Triton kernel's key tile is one page: a power of two, at least 16)"
    if any(n < 16 or pow2(n) != n or n > MAX_DEPTH for n in (D, E)):
        return f"head depths D = {D}, E = {E} (the Triton kernel takes powers of two from 16 to {MAX_DEPTH})"
    return _tile_refusal(Z, D, E, jnp.dtype(p.q.dtype))


def _tile_refusal(Z: int, D: int, E: int, dtype: jnp.dtype) -> str | None:
    """Why a page of ``Z`` keys is too large a tile for this GPU's shared memory or registers, or None."""
    cc = _platform.compute_capability()
    limit = SMEM_LIMIT[max(a for a in SMEM_LIMIT if a <= max(cc, min(SMEM_LIMIT)))]
    need = 2 * Z * (D + E) * (4 if dtype == jnp.float32 else 2)
    if need > limit:
        return (
            f"pages of Z = {Z} tokens at D = {D}, E = {E} in {dtype} (its tile asks for about {need} B of shared "
            f"memory; sm_{cc} gives {limit} B): smaller pages take it"
        )
    if dtype == jnp.float32 and Z * max(D, E) > F32_TILE:
        return f"float32 pages of Z = {Z} tokens at D = {D}, E = {E} (they spill; Z x D up to {F32_TILE} take it)"
    return None


def forward(p: Paged, *, interpret: bool) -> tuple[Array, Array]:
    """``out (Q, N, E)`` and ``lse (Q, N)``, float32, from the Pallas kernel (``interpret``: Pallas interpret mode).

    Padding tokens (past ``cu_q_lens[R]``) and rows without an allowed key give out 0 and lse ``-inf``.
    """
    Q, N, _ = p.q.shape
    E = p.v_pages.shape[3]
    out, lse = no_rows(p)
    if Q == 0 or p.page_table.shape[0] == 0:
        return out, lse
    request, token, q_pos, q = block_queries(p)
    (B, t), K, G = token.shape, p.k_pages.shape[2], p.group
    Gp = pow2(G)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0), (0, 0)))
    pos = jnp.where(token >= 0, q_pos, -1)  # (B, t): -1 for rows of no token
    table = block_table(p, request, pos)
    if not interpret:
        answer_triton_deprecation(_platform.compute_capability())
    o, row_lse = merge(*_call(p, q.reshape(B, K, Gp * t, -1), jnp.tile(pos, (1, Gp)), table, interpret))
    o = jnp.transpose(o.reshape(B, K, Gp, t, E)[:, :, :G], (0, 3, 1, 2, 4)).reshape(B * t, N, E)
    row_lse = jnp.transpose(row_lse.reshape(B, K, Gp, t)[:, :, :G], (0, 3, 1, 2)).reshape(B * t, N)
    dest = jnp.where(token >= 0, token, Q).reshape(B * t)  # Q: dropped
    return out.at[dest].set(o, mode="drop"), lse.at[dest].set(row_lse, mode="drop")


def block_table(p: Paged, request: Array, pos: Array) -> Array:
    """``(B, 4)`` int32 a block: its request, its ``kv_len``, and the first page it reads and one past the last.

    The pages are those holding a key some row of the block may see: below ``kv_len`` and within the rows' key
    interval. A block without a token reads none.
    """
    Z, M = p.k_pages.shape[1], p.page_table.shape[1]
    left, right = key_interval(p.mask)
    kv_len = jnp.clip(p.kv_lens[request], 0, M * Z)
    used = pos >= 0
    first = jnp.min(jnp.where(used, pos, 2**30), axis=1)
    last = jnp.max(jnp.where(used, pos, -1), axis=1)
    lo = jnp.zeros_like(kv_len) if left >= UNBOUNDED else jnp.maximum(first - min(left, 2**30), 0)
    hi = kv_len if right >= UNBOUNDED else jnp.minimum(kv_len, last + min(right, 2**30) + 1)
    any_used = jnp.any(used, axis=1)
    lo_page = jnp.where(any_used, lo // Z, 0)
    hi_page = jnp.where(any_used & (hi > lo), (hi + Z - 1) // Z, lo_page)
    return jnp.stack([request, kv_len, lo_page, jnp.maximum(hi_page, lo_page)], axis=1).astype(jnp.int32)


def split_pages(Z: int) -> int:
    """Pages of one split: :data:`SPLIT_KV` keys (at least one page)."""
    return max(1, SPLIT_KV // Z)


def _call(p: Paged, q: Array, pos: Array, table: Array, interpret: bool) -> tuple[Array, Array]:
    """The kernel on ``q (B, K, b, D)`` and each row's position ``pos (B, b)`` (-1: no token).

    Returns each split's ``o (B, K, n, b, E)`` (normalised) and ``lse (B, K, n, b)``, float32, ``n`` the splits of
    :data:`SPLIT_KV` keys a request's table can hold (a split without keys: o 0, lse ``-inf``).
    """
    B, K, b, D = q.shape
    Z, M, E = p.k_pages.shape[1], p.page_table.shape[1], p.v_pages.shape[3]
    per_split = split_pages(Z)
    n = -(-M // per_split)
    left, right = key_interval(p.mask)
    kernel = functools.partial(_kernel, p.scale, left, right, per_split)
    whole = [pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in (table, p.page_table, p.k_pages, p.v_pages)]
    return pl.pallas_call(
        kernel,
        grid=(B, K, n),
        in_specs=[
            *whole[:2],
            pl.BlockSpec((None, None, b, D), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((None, b), lambda i, h, s: (i, 0)),
            *whole[2:],
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, b, E), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, b), lambda i, h, s: (i, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, n, b, E), jnp.float32),
            jax.ShapeDtypeStruct((B, K, n, b), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="jattn_paged_forward",
    )(table, p.page_table, q, pos, p.k_pages, p.v_pages)


def _dot(a: Array, b: Array, ca: int, cb: int) -> Array:
    """``a`` contracted with ``b`` over ``a``'s axis ``ca`` and ``b``'s ``cb``, float32 (float32 inputs: exact dots)."""
    how = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=how, preferred_element_type=jnp.float32)


def _kernel(scale, left, right, per_split, blocks_ref, pages_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, lse_ref):
    """One query block, kv head and split: an online softmax over the split's pages, one page a step, in key order.

    ``blocks_ref (B, 4)`` (request, kv_len, first page, end page), ``pages_ref (R, M)``, ``q_ref (b, D)``,
    ``pos_ref (b,)``, ``k_ref (P, Z, K, D)``, ``v_ref (P, Z, K, E)``; writes ``o_ref (b, E)``, ``lse_ref (b,)``.
    """
    i, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r, kv_len = blocks_ref[i, 0], blocks_ref[i, 1]
    P, Z = k_ref.shape[:2]
    q, pos = q_ref[...], pos_ref[...]
    b, E = o_ref.shape

    def step(j, carry):
        m, den, acc = carry
        page = jnp.clip(pages_ref[r, j], 0, P - 1)  # past a broken table: a page in range (its rows are NaN)
        kb, vb = k_ref[page, :, h, :], v_ref[page, :, h, :]  # (Z, D), (Z, E)
        kv_pos = j * Z + lax.broadcasted_iota(jnp.int32, (Z,), 0)
        real = kv_pos < kv_len
        vb = jnp.where(real[:, None], vb, jnp.zeros((), vb.dtype))  # stale slots may hold anything
        keep = real[None, :] & (pos[:, None] >= 0)
        if left < UNBOUNDED:
            keep = keep & (kv_pos[None, :] >= pos[:, None] - min(left, 2**30))
        if right < UNBOUNDED:
            keep = keep & (kv_pos[None, :] <= pos[:, None] + min(right, 2**30))
        x = jnp.where(keep, _dot(q, kb, 1, 1) * scale, _NEG)
        top = jnp.maximum(m, jnp.max(x, axis=1))
        safe = jnp.where(top == _NEG, 0.0, top)  # a row masked so far: its weights are 0, not NaN
        w, alpha = jnp.exp(x - safe[:, None]), jnp.exp(m - safe)
        pv = _dot(w.astype(vb.dtype), vb, 1, 0)
        return top, alpha * den + jnp.sum(w, axis=1), alpha[:, None] * acc + pv

    init = (jnp.full((b,), _NEG, jnp.float32), jnp.zeros((b,), jnp.float32), jnp.zeros((b, E), jnp.float32))
    start = jnp.maximum(blocks_ref[i, 2], s * per_split)
    end = jnp.maximum(jnp.minimum(blocks_ref[i, 3], (s + 1) * per_split), start)
    m, den, acc = lax.fori_loop(start, end, step, init)
    seen = den > 0
    safe = jnp.where(seen, den, 1.0)
    o_ref[...] = acc / safe[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), _NEG)


def merge(o: Array, lse: Array) -> tuple[Array, Array]:
    """The splits ``o (B, K, n, b, E)``, ``lse (B, K, n, b)`` merged by log-sum-exp in key order.

    Returns ``o (B, K, b, E)`` and ``lse (B, K, b)``.

    One split after the other (never a reduction XLA may reorder); a split without keys (lse ``-inf``) changes no
    bit, so the count of splits (the table's width) does not either.
    """
    out, total = o[:, :, 0], lse[:, :, 0]
    for s in range(1, o.shape[2]):
        new = jnp.logaddexp(total, lse[:, :, s])
        a = jnp.where(total == _NEG, 0.0, jnp.exp(total - jnp.where(new == _NEG, 0.0, new)))
        c = jnp.where(lse[:, :, s] == _NEG, 0.0, jnp.exp(lse[:, :, s] - jnp.where(new == _NEG, 0.0, new)))
        out, total = out * a[..., None] + o[:, :, s] * c[..., None], new
    return out, total
