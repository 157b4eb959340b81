"""``implementation='pallas'`` on TPU: jattn's arguments translated to splash attention.

The kernel is JAX's :mod:`jax.experimental.pallas.ops.tpu.splash_attention`, its MHA kernel with
grouped kv heads (q ``(K·G, L, D)``, k and v ``(K, L, ·)`` per example, vmapped over the batch;
blocks multiples of 128, its lanes). Compiled on a TPU; elsewhere :func:`jax.lax.platform_dependent`
runs it in Pallas *interpret* mode, so the CPU tests the translation while a program lowered for
TPU on the same CPU holds the Mosaic kernel (``tpu_custom_call``). The translation (dimension key
in :mod:`jattn._core`):

* Leading dimensions ``...``: the axes k and v both broadcast over (size 1 in both, e.g. G of
  q ``(B, K, G, T, D)`` against k ``(B, K, 1, S, D)``) become the G query heads of each kv head,
  which splash reads without a copy of k or v (query head h reads kv head ``h // G``); the others
  are the kv heads K, after the batch ``Bk`` of a per-example mask (else ``Bk = 1``). Lengths are
  padded to multiples of the blocks.
* Static predicates become splash masks: ``causal()`` and ``sliding_window()`` their native
  ``CausalMask``/``LocalMask`` (placed by ``offset = q_offset - kv_offset``, combined by
  ``LogicalAnd``), any other static predicate one ``NumpyMask`` evaluated on the host.
* ``padding()`` and ``segment_ids()`` (and the keys padded to the block) become splash's segment
  ids: queries get ``2·id`` (0 without ids), visible keys ``2·id``, hidden keys 1, so a hidden
  key matches no query.
* ``score_mod=jattn.score_mods.softcap(c)`` is splash's ``attn_logits_soft_cap=c`` (read from the
  function's ``.softcap``).
* Rows that see no key return 0 (splash leaves NaN or the mean of v there); q is scaled before
  the kernel.

Where the rest goes. Raised here, per call, as :class:`jattn._checks.KernelRefusalError` before
anything is built (``implementation=None`` then tries the platform's next path, XLA's tiles;
named, the caller gets it as the ``ValueError`` it is): any other ``score_mod``; a mask term with
arrays, of the batch and head (``masks.predicate``), or per example outside the top ``&`` (e.g.
``padding() | causal()``); a per-example mask where q lacks the call's first (batch) axis; traced
offsets; ``dropout_rate``, ``sinks``, ``return_lse`` and ``return_max_logit`` (by
:func:`jattn._paths.pallas.pallas_attention`, the GPU kernel takes them). Refused by
:data:`jattn.SUPPORT` before this module is reached: array masks, ``bias``, ``precision``, float64.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._masks import Causal, Mask, Padding, SegmentIds, SlidingWindow, conjuncts, query_offset
from jattn._paths.choice import kernel_refusal
from jattn._softmax import zero_empty_rows

__all__ = ["SPLASH_BLOCK", "splash_attention"]

SPLASH_BLOCK = 512  # largest block of the splash kernel; blocks are multiples of 128 (its lanes)

# The SUPPORT row of a mask term splash cannot take, by (has arrays, of the batch and head).
_MASK_ROWS = {
    (True, False): "mask (array, any leading dims, 1-D)",
    (True, True): "mask (array, any leading dims, 1-D)",
    (False, True): "mask (predicate of batch and head: masks.predicate)",
    (False, False): "mask (per-example predicate: padding, segment_ids)",
}


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
        elif term.per_example or term.has_arrays or term.per_row:
            raise kernel_refusal(
                "pallas",
                _MASK_ROWS[term.has_arrays, term.per_row],
                f"on TPU splash takes position predicates, padding(), segment_ids() and their '&', got {term!r} in {mask!r}",
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


@dataclasses.dataclass(frozen=True)
class _Heads:
    """How the call's leading shape ``lead`` becomes the kernel's ``(Bk, K·G)`` query and ``(Bk, K)`` kv heads.

    ``perm`` orders lead's axes as (the per-example batch, the kv-head axes, the group axes); the
    group axes are those k and v broadcast over (size 1 in both), the kernel's G query heads per kv
    head, which splash reads without a copy of k or v. ``kv_lead`` is ``lead`` with the group axes 1.
    """

    perm: tuple[int, ...]
    kv_lead: tuple[int, ...]
    Bk: int  # the kernel's batch, vmapped: a per-example mask's B, else 1
    K: int  # kv heads a kernel call reads
    G: int  # query heads per kv head


def _grouped_heads(lead: tuple[int, ...], k_lead: tuple[int, ...], v_lead: tuple[int, ...], per_example: bool):
    """The :class:`_Heads` of a call of leading shape ``lead`` whose k and v have leading shapes ``k_lead``, ``v_lead``."""
    n = len(lead)
    k_lead, v_lead = (1,) * (n - len(k_lead)) + k_lead, (1,) * (n - len(v_lead)) + v_lead
    batch = [0] if per_example else []
    group = [i for i in range(n) if k_lead[i] == v_lead[i] == 1 < lead[i] and i not in batch]
    heads = [i for i in range(n) if i not in group and i not in batch]
    kv_lead = tuple(1 if i in group else lead[i] for i in range(n))
    size = lambda axes: math.prod(lead[i] for i in axes)  # noqa: E731
    return _Heads(tuple(batch + heads + group), kv_lead, size(batch), size(heads), size(group))


def _to_kernel(x: Array, lead: tuple[int, ...], heads: _Heads, h: int, L: int) -> Array:
    """``(..., n, e) -> (Bk, h, L, e)``: broadcast to ``lead``, its axes in ``heads.perm`` order, zero rows to L."""
    r, (n, e) = len(lead), x.shape[-2:]
    x = jnp.broadcast_to(x, (*lead, n, e))
    x = jnp.transpose(x, (*heads.perm, r, r + 1)).reshape(heads.Bk, h, n, e)
    return jnp.pad(x, ((0, 0), (0, 0), (0, L - n), (0, 0)))


def _from_kernel(out: Array, lead: tuple[int, ...], heads: _Heads, T: int) -> Array:
    """``(Bk, K·G, Lp, E) -> (*lead, T, E)``: the inverse of :func:`_to_kernel` for the queries."""
    n = len(lead)
    out = out[:, :, :T].reshape(*(lead[i] for i in heads.perm), T, out.shape[-1])
    return jnp.transpose(out, (*np.argsort(heads.perm).tolist(), n, n + 1))


def _kernel(mask, heads: int, bq: int, bk: int, cap: float | None):
    """The compiled (Mosaic) splash kernel of ``mask`` for ``heads`` query heads, blocks ``bq`` x ``bk``, soft-cap ``cap``.

    Splash's MHA kernel: k and v may carry fewer heads K (a divisor of ``heads``), query head h
    reading kv head ``h // G`` (grouped-query attention without copies; K = 1 is its MQA).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    return sk.make_splash_mha(
        sm.MultiHeadMask([mask] * heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        attn_logits_soft_cap=cap,
        interpret=False,
    )


def _interpreted(kernel):
    """``kernel`` in Pallas interpret mode, sharing its processed mask."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    masks = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
    return sk.SplashAttentionKernel(*masks, **{**kernel.kwargs, "interpret": True})


def _kernel_ids(q_ids: Array, kv_ids: Array, kv_valid: Array, Bk: int, Tp: int, Sp: int) -> tuple[Array, Array]:
    """Splash's segment ids ``(Bk, Tp)``, ``(Bk, Sp)`` from :func:`_seen_and_ids`': hidden and padded keys get 1."""
    T, S = q_ids.shape[-1], kv_ids.shape[-1]
    kv_ids = jnp.where(kv_valid, kv_ids, 1)
    q_ids = jnp.pad(jnp.broadcast_to(q_ids, (Bk, T)), ((0, 0), (0, Tp - T)))
    kv_ids = jnp.pad(jnp.broadcast_to(kv_ids, (Bk, S)), ((0, 0), (0, Sp - S)), constant_values=1)
    return q_ids, kv_ids


def _run(kernel, interpret: bool, qf: Array, kf: Array, vf: Array, ids: tuple[Array, Array] | None) -> Array:
    """``kernel`` on qf ``(Bk, K·G, Tp, D)``, kf ``(Bk, K, Sp, D)``, vf ``(Bk, K, Sp, E)``, vmapped over Bk.

    ``ids`` are :func:`_kernel_ids` (None for none). Compiled (``interpret=False``) the kernel alone;
    else :func:`jax.lax.platform_dependent` picks it where the program is lowered for TPU and its
    interpreted twin elsewhere, so a TPU program lowered on a CPU holds the Mosaic kernel.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    def apply(kern):
        if ids is None:
            return lambda q, k, v: jax.vmap(kern)(q, k, v)
        return lambda q, k, v, qi, ki: jax.vmap(lambda *a: kern(*a[:3], segment_ids=sk.SegmentIds(*a[3:])))(
            q, k, v, qi, ki
        )

    args = (qf, kf, vf) if ids is None else (qf, kf, vf, *ids)
    with jax.numpy_dtype_promotion("standard"):  # the kernel mixes dtypes internally; callers may run strict
        if not interpret:
            return apply(kernel)(*args)
        return jax.lax.platform_dependent(*args, tpu=apply(kernel), default=apply(_interpreted(kernel)))


def _soft_cap(score_mod: Callable[..., Array] | None) -> float | None:
    """Splash's ``attn_logits_soft_cap`` for ``score_mod``: its cap for :func:`jattn.score_mods.softcap`, else refused."""
    if score_mod is None:
        return None
    cap = getattr(score_mod, "softcap", None)
    if cap is None:
        raise kernel_refusal(
            "pallas", "score_mod", f"on TPU splash takes jattn.score_mods.softcap(cap) only, got {score_mod!r}"
        )
    return float(cap)


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
    score_mod: Callable[..., Array] | None = None,
) -> Array:
    """Splash attention for jattn's arguments: q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` -> ``(..., T, E)``.

    ``mask`` is a conjunction of position predicates, ``padding()`` and ``segment_ids()``;
    ``score_mod`` None or :func:`jattn.score_mods.softcap`; the translation is the module
    docstring's, whose other cases raise :class:`jattn._checks.KernelRefusalError` before anything
    is built. ``scale`` is a value; offsets static ints; ``blocks`` ``(block_q, block_kv)``
    (rounded up to multiples of 128) defaults to square ``min(SPLASH_BLOCK, max(T, S))``. ``lead``
    is the call's leading shape, a per-example mask's batch on ``lead[axis]``
    (:class:`jattn._checks.Operands`), which must be its first axis here. ``interpret``: see :func:`_run`.
    """
    T, S = q.shape[-2], k.shape[-2]
    cap = _soft_cap(score_mod)
    static, natives, pad, seg = _terms(mask)
    per_example = pad is not None or seg is not None
    if per_example and axis != 0:
        raise kernel_refusal(
            "pallas",
            "mask (per-example predicate: padding, segment_ids)",
            f"on TPU its batch goes on the call's first axis, and q {q.shape} has fewer leading axes than the call's {lead}",
        )
    if not all(isinstance(o, numbers.Integral) for o in (0 if q_offset is None else q_offset, kv_offset)):
        raise kernel_refusal("pallas", "q_offset / kv_offset (arrays, per example)", "on TPU splash's masks are static")
    q0 = query_offset(q_offset, kv_offset, T, S)
    if blocks is None:
        b = min(SPLASH_BLOCK, -(-max(T, S) // 128) * 128)
        blocks = (b, b)
    bq, bk = (-(-x // 128) * 128 for x in blocks)  # splash computes keys in lanes of 128
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    splash_mask, dense, first = _static_mask(static, natives, T, S, Tp, Sp, q0, kv_offset, seg is not None)

    heads = _grouped_heads(lead, k.shape[:-2], v.shape[:-2], per_example)
    q = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype)  # splash takes q pre-scaled
    qf = _to_kernel(q, lead, heads, heads.K * heads.G, Tp)
    kf, vf = (_to_kernel(x, heads.kv_lead, heads, heads.K, Sp) for x in (k, v))
    seen, kv_valid, q_ids, kv_ids = _seen_and_ids(first, dense, pad, seg, T, S)
    ids = _kernel_ids(q_ids, kv_ids, kv_valid, heads.Bk, Tp, Sp) if per_example or Sp > S else None
    out = _run(_kernel(splash_mask, heads.K * heads.G, bq, bk, cap), interpret, qf, kf, vf, ids)
    out = _from_kernel(out, lead, heads, T).astype(q.dtype)
    n_lead, seen = len(lead), jnp.asarray(seen)  # (B|1, T)
    seen = jnp.broadcast_to(seen.reshape(-1, *(1,) * (n_lead - 1), T) if n_lead else seen.reshape(T), (*lead, T))
    return zero_empty_rows(out, seen)[0]
