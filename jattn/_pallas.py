"""``implementation='pallas'``: jattn's arguments translated to a fused Pallas kernel.

On GPU the kernel is JAX's own flash attention,
:func:`jax.experimental.pallas.ops.gpu.attention.mha` (layout ``(B, T, N, D)``, one head dim for
q, k and v, causal top-left, lengths multiples of its blocks). On CPU the same kernel runs in
Pallas *interpret* mode: exact, slow, and how jattn tests the translation (there is no GPU in CI).
On TPU it is splash attention (:func:`_splash`, below), also tested in interpret mode on CPU.
Which kernel: :func:`kernel_platform`.

The GPU translation (dimension key in :mod:`jattn._core`):

* Leading dimensions ``...`` are broadcast (grouped-query kv heads are repeated) and flattened to
  the kernel's batch ``B`` with one head: q ``(B, L, 1, H)``, k and v ``(B, L, 1, H)``.
* Lengths are padded to one ``L``, a multiple of the blocks (the kernel's backward wants as
  many query blocks as key blocks); the head dims are padded with zeros to
  ``H = max(D (+1), E)`` (zero columns change no score; v's extra columns are dropped).
* ``causal()`` placed by the offsets, ``d = q_offset - kv_offset``: with ``d >= 0`` the queries
  are shifted down by ``d`` rows (query t at row ``t + d``), so the kernel's top-left
  ``row >= key`` is jattn's ``s <= t + d``; with ``d < 0`` the first ``-d`` queries see no key
  and are left out (they return 0).
* Keys to hide (beyond ``kv_lengths`` of ``padding()``, or the padding that reaches past S
  where a query could see it) are masked through one extra head column: q gets 1, k gets 0 for
  a visible key and a large negative value for a hidden one, so the kernel's logit of a hidden
  key underflows ``exp`` to exactly 0.
* Queries beyond ``q_lengths`` and padded query rows are dropped: their output is 0 and, as the
  output is cut there, they send no gradient.
* ``scale`` as a Python float is the kernel's ``sm_scale``; a traced scale is folded into q.

Everything else (arrays, windows, segment ids, bias, dropout, ...) raises the ``ValueError`` of
:data:`jattn.SUPPORT` (or, for masks the table calls "partly", this module's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn import _platform
from jattn._checks import broadcast_all
from jattn._masks import (
    Causal,
    Mask,
    Padding,
    SegmentIds,
    SlidingWindow,
    call_lead,
    conjuncts,
    on_batch_axis,
    query_offset,
)
from jattn._softmax import zero_empty_rows

__all__ = ["KERNEL_BLOCK", "kernel_platform", "pallas_attention"]

#: Largest square block the GPU kernel gets (its default forward block); smaller sequences take
#: the next power of two of their length (16 at least).
KERNEL_BLOCK = 128


def kernel_platform() -> tuple[str, bool]:
    """The kernel for this platform and whether it runs in interpret mode.

    ``'tpu'`` (splash attention) where :func:`jattn._platform.platform` says TPU, ``'gpu'``
    otherwise; interpreted unless JAX's backend is that platform (so on CPU; tests switch the
    platform to run the TPU translation on CPU).
    """
    kernel = "tpu" if _platform.platform() == "tpu" else "gpu"
    return kernel, jax.default_backend() != kernel


def _terms(mask: Mask | None) -> tuple[bool, Padding | None]:
    """``(causal, padding)`` of a conjunction of causal() and padding(); raises for anything else."""
    causal, pad = False, None
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Causal):
            causal = True
        elif isinstance(term, Padding) and pad is None:
            pad = term
        else:
            raise ValueError(
                f"implementation='pallas' expresses causal(), padding() and their '&' only, got {term!r} in {mask!r}; "
                "use 'dense' or 'blockwise'"
            )
    return causal, pad


def _static_scale(scale, D: int) -> float | None:
    """The scale as a Python float, or None when it is traced (then it is folded into q)."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, jax.core.Tracer):
        return None
    return float(np.asarray(scale))


def _lengths(x, lead: tuple[int, ...], limit: int, axis: int) -> Array:
    """Per-example lengths ``(B|1,)`` as ``(*lead)`` int32 (batch on ``lead[axis]``), clipped to ``[0, limit]``."""
    return on_batch_axis(jnp.clip(jnp.asarray(x, jnp.int32), 0, limit), lead, axis)


def _row(n: int, ndim: int) -> Array:
    """``arange(n)`` with ``ndim`` unit axes in front (strict rank promotion)."""
    return jnp.arange(n, dtype=jnp.int32).reshape((1,) * ndim + (n,))


def pallas_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale,
    q_offset: int | None,
    kv_offset: int,
    blocks: tuple[int, int] | None,
) -> Array:
    """Attention through the platform's Pallas kernel; q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``.

    Returns ``(..., T, E)`` in the dtype of q. ``mask`` is None or a conjunction of ``causal()``
    and ``padding()`` (anything else raises a ``ValueError``); ``q_offset``/``kv_offset`` are
    static ints; ``blocks`` is the kernel's ``(block_q, block_kv)``, default square
    ``min(KERNEL_BLOCK, next power of two of the padded length)``; compiled for a GPU (not
    interpreted) each is rounded up to a power of two of at least 16, as Triton needs.
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # imported on use: Triton bits

    kernel, interpret = kernel_platform()
    if kernel == "tpu":
        return _splash(q, k, v, mask, scale, q_offset, kv_offset, blocks, interpret)
    T, S, D, E = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    causal, pad = _terms(mask)
    lead, axis = broadcast_all(q=q, k=k, v=v), None
    if pad is not None:
        if q.ndim < 3:
            raise ValueError(f"a per-example mask needs a batch axis in q, got q of shape {q.shape}")
        lead, axis = call_lead(mask, q, k, v, None)  # with the batch on lead[axis], where q's first axis lands
    d = query_offset(q_offset, kv_offset, T, S) - kv_offset
    drop = min(max(-d, 0), T) if causal else 0  # queries that see no key at all
    front = max(d, 0) if causal else 0  # rows above the first query (query t sits at row t + front)
    Tk = T - drop
    if Tk == 0:
        return jnp.zeros((*lead, T, E), q.dtype)
    n = max(Tk + front, S)
    if blocks is None:
        b = min(KERNEL_BLOCK, max(16, pl_next_pow2(n)))
        blocks = (b, b)
    if not interpret:  # Triton's dots want powers of two of at least 16 (the results are the same)
        blocks = tuple(max(16, pl_next_pow2(x)) for x in blocks)
    bq, bk = blocks
    L = -(-n // math.lcm(bq, bk)) * math.lcm(bq, bk)
    # Keys past S are visible where the kernel's causal bound reaches them (every row without causal).
    hide_tail = L > S and (not causal or Tk + front > S)
    column = (pad is not None and pad.kv_lengths is not None) or hide_tail
    H = max(D + column, E, 1 if interpret else 16)  # Triton's dots want 16 at least

    sm = _static_scale(scale, D)
    if sm is None:  # traced scale: into q (in the compute dtype, rounded once to q's dtype)
        q = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype)
        sm = 1.0
    q = jnp.broadcast_to(q[..., drop:, :], (*lead, Tk, D))
    k = jnp.broadcast_to(k, (*lead, S, D))
    v = jnp.broadcast_to(v, (*lead, S, E))
    cols_q = [q]
    cols_k = [k]
    if column:
        # An example without keys shows the kernel its first key (its rows return 0 below, and send no
        # gradient): with every key hidden the kernel's backward divides 0 by 0 (NaN, found by the fuzz).
        kv_len = S if pad is None or pad.kv_lengths is None else jnp.maximum(_lengths(pad.kv_lengths, lead, S, axis), 1)
        kv_len = kv_len if isinstance(kv_len, int) else kv_len[..., None]
        valid = _row(S, len(lead)) < kv_len
        hidden = -float(jnp.finfo(q.dtype).max) / 16 / max(sm, 1.0)
        cols_q.append(jnp.ones((*lead, Tk, 1), q.dtype))
        cols_k.append(jnp.broadcast_to(jnp.where(valid, 0.0, hidden).astype(k.dtype), (*lead, S))[..., None])
    q = jnp.concatenate(cols_q, axis=-1) if column else q
    k = jnp.concatenate(cols_k, axis=-1) if column else k

    def flat(x, before):  # (*lead, l, h) -> (B, L, 1, H), zero rows before/after and zero columns after
        x = x.reshape(-1, *x.shape[-2:])
        x = jnp.pad(x, ((0, 0), (before, L - before - x.shape[1]), (0, H - x.shape[2])))
        return x[:, :, None, :]

    k = flat(k, 0)
    if hide_tail:  # padded keys past S carry the hiding column too
        k = k.at[:, S:, 0, D].set(jnp.asarray(hidden, k.dtype))
    b2 = math.gcd(bq, bk, 32)
    sizes = gpu_attention.BlockSizes(
        block_q=bq, block_k=bk, block_q_dkv=b2, block_kv_dkv=b2, block_q_dq=b2, block_kv_dq=b2
    )
    with jax.numpy_dtype_promotion("standard"):  # the kernel mixes dtypes internally; callers may run strict
        out = gpu_attention.mha(
            flat(q, front), k, flat(v, 0), None, sm_scale=sm, causal=causal, block_sizes=sizes, interpret=interpret
        )
    out = out[:, front : front + Tk, 0, :E].reshape(*lead, Tk, E)
    if pad is not None:  # rows past q_lengths, or of an example without keys, return 0
        seen = jnp.ones((*lead, Tk), bool)
        if pad.q_lengths is not None:
            seen = drop + _row(Tk, len(lead)) < _lengths(pad.q_lengths, lead, T, axis)[..., None]
        if pad.kv_lengths is not None:
            seen = seen & (_lengths(pad.kv_lengths, lead, S, axis) > 0)[..., None]
        out, _ = zero_empty_rows(out, seen)
    if drop:
        out = jnp.concatenate([jnp.zeros((*lead, drop, E), out.dtype), out], axis=-2)
    return out


def pl_next_pow2(n: int) -> int:
    """The smallest power of two ``>= n``."""
    return 1 << max(0, int(n) - 1).bit_length()


# -- TPU: splash attention --------------------------------------------------------------------------

SPLASH_BLOCK = 512  # largest block of the splash kernel; blocks are multiples of 128 (its lanes)


def _host_rows(mask: Mask | None, T: int, S: int, q0: int, k0: int, rows: int = 1024):
    """The static predicate's dense ``(T, S)`` on the host (None when no predicate) and each row's first key.

    Evaluated once at trace time in chunks of rows; ``first[t] == S`` when row t sees no key.
    """
    if mask is None:
        return None, np.zeros(T, np.int64)
    parts = []
    with jax.ensure_compile_time_eval():
        for r in range(0, T, rows):
            n = min(rows, T - r)
            parts.append(np.asarray(mask.dense(n, S, q_offset=q0 + r, kv_offset=k0)).reshape(n, S))
    dense = np.concatenate(parts)
    first = np.where(dense.any(-1), dense.argmax(-1), S)
    return dense, first


def _splash(q, k, v, mask: Mask | None, scale, q_offset, kv_offset, blocks, interpret: bool) -> Array:
    """Splash attention (:mod:`jax.experimental.pallas.ops.tpu.splash_attention`) for jattn's arguments.

    Static predicates become splash masks: causal() and sliding_window() their native
    ``CausalMask``/``LocalMask`` (placed by ``offset = q_offset - kv_offset``, combined by
    ``LogicalAnd``), any other static predicate one ``NumpyMask`` evaluated on the host.
    ``padding()`` and ``segment_ids()`` (and the keys padded to the block) become splash's segment
    ids: queries get ``2·id`` (0 without ids), visible keys ``2·id``, hidden keys 1, so a hidden key
    matches no query. Rows that see no key return 0 (splash leaves NaN or the mean of v there).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    T, S, D, E = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    static: Mask | None = None
    pad, seg = None, None
    natives = []
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Padding) and pad is None:
            pad = term
        elif isinstance(term, SegmentIds) and seg is None:
            seg = term
        elif term.per_example or term.has_arrays:
            raise ValueError(
                f"implementation='pallas' on TPU expresses position predicates, padding(), segment_ids() and their '&', "
                f"got {term!r} in {mask!r}; use 'dense' or 'blockwise'"
            )
        else:
            static = term if static is None else static & term
            natives.append(term)
    lead = broadcast_all(q=q, k=k, v=v)
    per_example = pad is not None or seg is not None
    if per_example:
        if q.ndim < 3:
            raise ValueError(f"a per-example mask needs a batch axis in q, got q of shape {q.shape}")
        arrays = [] if pad is None else [pad.q_lengths, pad.kv_lengths]
        arrays += [] if seg is None else [seg.q_segments, seg.kv_segments]
        B = max(jnp.shape(x)[0] for x in arrays if x is not None)
        lead = jnp.broadcast_shapes(lead, (B, *(1,) * (len(lead) - 1)))
    q0 = query_offset(q_offset, kv_offset, T, S)
    d = q0 - kv_offset
    if blocks is None:
        b = min(SPLASH_BLOCK, -(-max(T, S) // 128) * 128)
        blocks = (b, b)
    bq, bk = (-(-x // 128) * 128 for x in blocks)  # splash computes keys in lanes of 128
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk

    kinds = [sm.FullMask((Tp, Sp))]
    if all(isinstance(t, Causal | SlidingWindow) for t in natives):
        for t in natives:
            window = (None, 0) if isinstance(t, Causal) else (t.left, t.right)
            kinds.append(
                sm.CausalMask((Tp, Sp), offset=d) if isinstance(t, Causal) else sm.LocalMask((Tp, Sp), window, d)
            )
        # Row t sees the band t + d - left <= s <= t + d + right: its first key without a (T, S) array.
        left = min((t.left for t in natives if isinstance(t, SlidingWindow)), default=T + S)
        right = min((0 if isinstance(t, Causal) else t.right for t in natives), default=T + S)
        lo, hi = np.maximum(np.arange(T) + d - left, 0), np.minimum(np.arange(T) + d + right, S - 1)
        first = np.where(lo <= hi, lo, S)
        dense = None  # formed below only for segment ids (and only then of the band)
        if seg is not None and natives:
            dense = (np.arange(S) >= lo[:, None]) & (np.arange(S) <= hi[:, None])
    else:  # anything else: the predicate itself, on the host, as one NumpyMask
        dense, first = _host_rows(static, T, S, q0, kv_offset)
        kinds = [sm.NumpyMask(np.pad(dense, ((0, Tp - T), (0, Sp - S))))]
    splash_mask = kinds[0]
    for m in kinds[1:]:
        splash_mask = sm.LogicalAnd(splash_mask, m)

    n_lead = len(lead)
    Bk = lead[0] if per_example else 1
    H = math.prod(lead) // Bk
    sc = 1.0 / math.sqrt(D) if scale is None else scale
    q = (q.astype(jnp.float32) * jnp.asarray(sc, jnp.float32)).astype(q.dtype)  # splash takes q pre-scaled

    def flat(x, L, Lp):  # (..., L, h) -> (Bk, H, Lp, h)
        x = jnp.broadcast_to(x, (*lead, L, x.shape[-1])).reshape(Bk, H, L, x.shape[-1])
        return jnp.pad(x, ((0, 0), (0, 0), (0, Lp - L), (0, 0)))

    qf, kf, vf = flat(q, T, Tp), flat(k, S, Sp), flat(v, S, Sp)
    t_idx, s_idx = _row(T, 1), _row(S, 1)  # (1, T), (1, S)
    seen = np.asarray(first < S)[None]  # (1, T): the static predicate leaves the row a key
    kv_valid = jnp.ones((1, S), bool)
    q_ids, kv_ids = jnp.zeros((1, T), jnp.int32), jnp.zeros((1, S), jnp.int32)
    if pad is not None:
        if pad.q_lengths is not None:
            seen = seen & (t_idx < jnp.asarray(pad.q_lengths, jnp.int32).reshape(-1, 1))
        if pad.kv_lengths is not None:
            kv_len = jnp.asarray(pad.kv_lengths, jnp.int32).reshape(-1, 1)
            kv_valid = kv_valid & (s_idx < kv_len)
            seen = seen & (jnp.asarray(first)[None] < kv_len)
    if seg is not None:
        q_ids = 2 * jnp.asarray(seg.q_segments, jnp.int32)
        kv_ids = 2 * jnp.asarray(seg.kv_segments, jnp.int32)
        same = q_ids[:, :, None] == kv_ids[:, None, :]  # (B, T, S): the one dense array of this path
        if dense is not None:
            same = same & dense[None]
        seen = seen & jnp.any(same & kv_valid[:, None, :], axis=-1)
    use_ids = per_example or Sp > S
    with jax.numpy_dtype_promotion("standard"):  # the kernel mixes dtypes internally; callers may run strict
        kernel = sk.make_splash_mha(
            sm.MultiHeadMask([splash_mask] * H),
            head_shards=1,
            q_seq_shards=1,
            block_sizes=sk.BlockSizes(
                block_q=bq,
                block_kv=bk,
                block_kv_compute=bk,
                block_q_dkv=bq,
                block_kv_dkv=bk,
                block_kv_dkv_compute=bk,
                block_q_dq=bq,
                block_kv_dq=bk,
            ),
            interpret=interpret,
        )
        if use_ids:
            kv_ids = jnp.where(kv_valid, kv_ids, 1)
            q_ids = jnp.pad(jnp.broadcast_to(q_ids, (Bk, T)), ((0, 0), (0, Tp - T)))
            kv_ids = jnp.pad(jnp.broadcast_to(kv_ids, (Bk, S)), ((0, 0), (0, Sp - S)), constant_values=1)
            out = jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=sk.SegmentIds(qi, ki)))(
                qf, kf, vf, q_ids, kv_ids
            )
        else:
            out = jax.vmap(kernel)(qf, kf, vf)
    out = out[:, :, :T].reshape(*lead, T, E).astype(q.dtype)
    seen = jnp.asarray(seen)  # (B|1, T)
    seen = jnp.broadcast_to(seen.reshape(-1, *(1,) * (n_lead - 1), T) if n_lead else seen.reshape(T), (*lead, T))
    return zero_empty_rows(out, seen)[0]
