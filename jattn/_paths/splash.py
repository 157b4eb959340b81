"""``implementation='pallas'`` on TPU: jattn's arguments translated to splash attention.

The kernel is JAX's :mod:`jax.experimental.pallas.ops.tpu.splash_attention` (layout
``(H, L, D)`` per example, vmapped over the batch; blocks multiples of 128, its lanes). On CPU it
runs in Pallas *interpret* mode, which is how jattn tests this translation (dimension key in
:mod:`jattn._core`):

* Leading dimensions ``...`` are broadcast and split into the kernel's batch ``Bk`` (B of a
  per-example mask, else 1) and heads ``H``; lengths are padded to multiples of the blocks.
* Static predicates become splash masks: ``causal()`` and ``sliding_window()`` their native
  ``CausalMask``/``LocalMask`` (placed by ``offset = q_offset - kv_offset``, combined by
  ``LogicalAnd``), any other static predicate one ``NumpyMask`` evaluated on the host.
* ``padding()`` and ``segment_ids()`` (and the keys padded to the block) become splash's segment
  ids: queries get ``2·id`` (0 without ids), visible keys ``2·id``, hidden keys 1, so a hidden
  key matches no query.
* Rows that see no key return 0 (splash leaves NaN or the mean of v there); q is scaled before
  the kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._checks import KernelRefusalError
from jattn._masks import Causal, Mask, Padding, SegmentIds, SlidingWindow, conjuncts, query_offset
from jattn._softmax import zero_empty_rows

__all__ = ["SPLASH_BLOCK", "splash_attention"]

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


def _terms(mask: Mask | None) -> tuple[Mask | None, list[Mask], Padding | None, SegmentIds | None]:
    """``(static, natives, padding, segment_ids)`` of a conjunction; raises for a term splash cannot express.

    ``static`` is the ``&`` of the position predicates, ``natives`` the same terms as a list.
    """
    static: Mask | None = None
    pad, seg = None, None
    natives = []
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Padding) and pad is None:
            pad = term
        elif isinstance(term, SegmentIds) and seg is None:
            seg = term
        elif term.per_example or term.has_arrays:
            raise KernelRefusalError(
                f"implementation='pallas' on TPU expresses position predicates, padding(), segment_ids() and their '&', "
                f"got {term!r} in {mask!r}; use 'dense' or 'blockwise'"
            )
        else:
            static = term if static is None else static & term
            natives.append(term)
    return static, natives, pad, seg


def _native_mask(natives: list[Mask], T: int, S: int, Tp: int, Sp: int, d: int, segments: bool):
    """``(splash_mask, dense, first)`` of causal() and sliding_window() terms, placed by ``d = q_offset - kv_offset``.

    ``first`` ``(T,)`` is each row's first key (S for none); ``dense`` ``(T, S)``, the band, is
    formed only for segment ids (None otherwise).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    kinds = [sm.FullMask((Tp, Sp))]
    for t in natives:
        window = (None, 0) if isinstance(t, Causal) else (t.left, t.right)
        kinds.append(sm.CausalMask((Tp, Sp), offset=d) if isinstance(t, Causal) else sm.LocalMask((Tp, Sp), window, d))
    # Row t sees the band t + d - left <= s <= t + d + right: its first key without a (T, S) array.
    left = min((t.left for t in natives if isinstance(t, SlidingWindow)), default=T + S)
    right = min((0 if isinstance(t, Causal) else t.right for t in natives), default=T + S)
    lo, hi = np.maximum(np.arange(T) + d - left, 0), np.minimum(np.arange(T) + d + right, S - 1)
    first = np.where(lo <= hi, lo, S)
    dense = None  # formed below only for segment ids (and only then of the band)
    if segments and natives:
        dense = (np.arange(S) >= lo[:, None]) & (np.arange(S) <= hi[:, None])
    splash_mask = kinds[0]
    for m in kinds[1:]:
        splash_mask = sm.LogicalAnd(splash_mask, m)
    return splash_mask, dense, first


def _static_mask(
    static: Mask | None, natives: list[Mask], T: int, S: int, Tp: int, Sp: int, q0: int, k0: int, segments: bool
):
    """``(splash_mask, dense, first)`` of the static predicate over the padded ``(Tp, Sp)`` (see :func:`_native_mask`).

    Causal and sliding windows natively; anything else: the predicate itself, on the host, as one NumpyMask.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if all(isinstance(t, Causal | SlidingWindow) for t in natives):
        return _native_mask(natives, T, S, Tp, Sp, q0 - k0, segments)
    dense, first = _host_rows(static, T, S, q0, k0)
    return sm.NumpyMask(np.pad(dense, ((0, Tp - T), (0, Sp - S)))), dense, first


def _seen_and_ids(
    first: np.ndarray, dense: np.ndarray | None, pad: Padding | None, seg: SegmentIds | None, T: int, S: int
):
    """``(seen (B|1, T), kv_valid (B|1, S), q_ids (B|1, T), kv_ids (B|1, S))``: rows that see a key, keys to show, ids.

    ``first`` ``(T,)`` is each row's first key under the static predicate (S for none) and
    ``dense`` its ``(T, S)`` where formed; ids are ``2·id`` (0 without segment ids).
    """
    t_idx, s_idx = jnp.arange(T, dtype=jnp.int32)[None], jnp.arange(S, dtype=jnp.int32)[None]  # (1, T), (1, S)
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
    return seen, kv_valid, q_ids, kv_ids


def _splash_kernel(mask, H: int, bq: int, bk: int, interpret: bool):
    """The splash MHA kernel of ``mask`` (the same for each of the ``H`` heads) with blocks ``bq`` x ``bk``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return sk.make_splash_mha(
        sm.MultiHeadMask([mask] * H),
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


def _run(kernel_args: tuple, qf: Array, kf: Array, vf: Array, ids: tuple[Array, Array, Array] | None) -> Array:
    """The kernel (:func:`_splash_kernel` of ``kernel_args``) on ``(Bk, H, Lp, ·)`` inputs, vmapped over Bk.

    ``ids`` is ``(q_ids (B|1, T), kv_ids (B|1, S), kv_valid (B|1, S))`` (:func:`_seen_and_ids`) to
    pass as splash's segment ids, hidden and padded keys with id 1; None for none.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    with jax.numpy_dtype_promotion("standard"):  # the kernel mixes dtypes internally; callers may run strict
        kernel = _splash_kernel(*kernel_args)
        if ids is None:
            return jax.vmap(kernel)(qf, kf, vf)
        q_ids, kv_ids, kv_valid = ids
        (Bk, _, Tp, _), Sp = qf.shape, kf.shape[2]
        T, S = q_ids.shape[-1], kv_ids.shape[-1]
        kv_ids = jnp.where(kv_valid, kv_ids, 1)
        q_ids = jnp.pad(jnp.broadcast_to(q_ids, (Bk, T)), ((0, 0), (0, Tp - T)))
        kv_ids = jnp.pad(jnp.broadcast_to(kv_ids, (Bk, S)), ((0, 0), (0, Sp - S)), constant_values=1)
        return jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=sk.SegmentIds(qi, ki)))(
            qf, kf, vf, q_ids, kv_ids
        )


def _heads(x: Array, lead: tuple[int, ...], Bk: int, H: int, Lp: int) -> Array:
    """``(..., L, h) -> (Bk, H, Lp, h)``: broadcast to ``lead``, split into batch and heads, padded with zero rows."""
    L = x.shape[-2]
    x = jnp.broadcast_to(x, (*lead, L, x.shape[-1])).reshape(Bk, H, L, x.shape[-1])
    return jnp.pad(x, ((0, 0), (0, 0), (0, Lp - L), (0, 0)))


def splash_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Mask | None,
    scale,
    q_offset,
    kv_offset,
    blocks,
    interpret: bool,
    lead: tuple[int, ...],
    axis: int,
) -> Array:
    """Splash attention for jattn's arguments: q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` -> ``(..., T, E)``.

    ``mask`` is a conjunction of position predicates, ``padding()`` and ``segment_ids()``; the
    translation is the module docstring's. ``scale`` is a value; offsets are static; ``blocks``
    ``(block_q, block_kv)`` (rounded up to multiples of 128) defaults to square
    ``min(SPLASH_BLOCK, max(T, S))``. ``lead`` is the call's leading shape, a per-example mask's
    batch on ``lead[axis]`` (:class:`jattn._checks.Operands`), which must be its first axis here.
    """
    T, S, E = q.shape[-2], k.shape[-2], v.shape[-1]
    static, natives, pad, seg = _terms(mask)
    per_example = pad is not None or seg is not None
    if per_example and axis != 0:
        raise KernelRefusalError(
            f"implementation='pallas' on TPU puts a per-example mask's batch on the call's first axis: q {q.shape} "
            f"has fewer leading axes than the call's {lead}; give q every leading axis, or use 'blockwise'"
        )
    q0 = query_offset(q_offset, kv_offset, T, S)
    if blocks is None:
        b = min(SPLASH_BLOCK, -(-max(T, S) // 128) * 128)
        blocks = (b, b)
    bq, bk = (-(-x // 128) * 128 for x in blocks)  # splash computes keys in lanes of 128
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    splash_mask, dense, first = _static_mask(static, natives, T, S, Tp, Sp, q0, kv_offset, seg is not None)

    n_lead = len(lead)
    Bk = lead[0] if per_example else 1
    H = math.prod(lead) // Bk
    q = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype)  # splash takes q pre-scaled
    qf, kf, vf = _heads(q, lead, Bk, H, Tp), _heads(k, lead, Bk, H, Sp), _heads(v, lead, Bk, H, Sp)
    seen, kv_valid, q_ids, kv_ids = _seen_and_ids(first, dense, pad, seg, T, S)
    use_ids = per_example or Sp > S
    out = _run((splash_mask, H, bq, bk, interpret), qf, kf, vf, (q_ids, kv_ids, kv_valid) if use_ids else None)
    out = out[:, :, :T].reshape(*lead, T, E).astype(q.dtype)
    seen = jnp.asarray(seen)  # (B|1, T)
    seen = jnp.broadcast_to(seen.reshape(-1, *(1,) * (n_lead - 1), T) if n_lead else seen.reshape(T), (*lead, T))
    return zero_empty_rows(out, seen)[0]
