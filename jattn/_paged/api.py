"""``jattn.paged_attention``: validate, choose a path, apply the sinks, return.

Paged names beside the core's dimension key (:mod:`jattn._core`): ``Q`` query tokens of the ragged batch,
``R`` requests, ``P`` pages of the pool, ``Z`` tokens a page (page_size), ``M`` pages a request's table can
name (max_pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn._checks import check_score_mod
from jattn._masks import Mask, causal, key_interval
from jattn._paged import fused, mosaic, pallas, xla
from jattn._paged.checks import Paged, bad_requests, check_paged

__all__ = ["PAGED_IMPLEMENTATIONS", "SPLIT_KV", "TILE_KV", "paged_attention"]

#: The paths of :func:`paged_attention` (``implementation=``).
PAGED_IMPLEMENTATIONS = ("fused", "xla", "pallas")
TILE_KV = fused.TILE_KV
"""Keys of one tile: one step of the fused CPU path's online softmax, at multiples of 512 from key 0."""
SPLIT_KV = fused.SPLIT_KV
"""Keys of one split, merged into a row's total by log-sum-exp in key order: the unit of split-KV.

Tiles and splits start at multiples of themselves from key 0 on every fused CPU forward (paged or
:func:`jattn.attention`'s), whatever the batch, the chunking or the task's rows: what makes a request's bits
independent of them."""


def paged_attention(
    q: ArrayLike,
    k_pages: ArrayLike,
    v_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lens: ArrayLike,
    cu_q_lens: ArrayLike,
    *,
    mask: Mask | None = causal(),  # noqa: B008  (a frozen dataclass: immutable)
    scale: float | None = None,
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> Array | tuple[Array, Array]:
    r"""Attention of a flat ragged batch of query tokens against a paged KV pool (forward only).

    Shapes (dimension key in :mod:`jattn._core`; ``Q`` query tokens, ``R`` requests, ``P`` pages of ``Z``
    tokens, ``M`` pages a request)::

        q           (Q, N, D)     the query tokens of every request, request r's at cu_q_lens[r]:cu_q_lens[r+1]
        k_pages     (P, Z, K, D)  the key pool: page p holds Z consecutive tokens of one request
        v_pages     (P, Z, K, E)  the value pool, paged as k_pages
        page_table  (R, M) int    request r's keys 0..kv_lens[r]-1 are at page_table[r, j // Z], slot j % Z
        kv_lens     (R,) int      each request's keys, its new tokens included
        cu_q_lens   (R + 1,) int  0 = cu_q_lens[0] <= ... <= cu_q_lens[R] <= Q (FlashAttention's cu_seqlens_q)
        sinks       (N,)          one logit per query head
        out         (Q, N, E)     in q's dtype; rows past cu_q_lens[R] (padding) are 0
        lse         (Q, N)        float32

    Request r's ``q_len = cu_q_lens[r+1] - cu_q_lens[r]`` queries are its last ``q_len`` positions:
    query i sits at position ``kv_lens[r] - q_len + i`` and key j at position j, the positions ``mask`` and
    ``score_mod`` see. A decode step is ``q_len = 1``, a prefill chunk any ``q_len``; one call mixes them.
    Query head n reads kv head ``n // (N // K)`` (grouped heads: no copies). The new tokens' keys and values
    are written into their pages before the call (by ``.at[pages, slots].set``, beside it: the pool is the
    caller's state and a functional write returns a new pool, which a call returning attention cannot hand
    back without a copy).

    .. math::
        \mathrm{out}_t = \sum_{j < \mathrm{kv\_lens}[r]} \frac{e^{x_{tj}}}{\sum_{j'} e^{x_{tj'}} + e^{\mathrm{sink}}} v_j,
        \quad x_{tj} = \mathrm{score\_mod}(\mathrm{scale}\; q_t \cdot k_j), \text{ masked keys left out}

    Batch invariance: on the fused CPU path a request's output and lse are bitwise the same whatever else is
    in the batch, wherever it sits, wherever its pages are and however its tokens arrive (one prefill, any
    chunking, token by token), and equal to :func:`jattn.attention`'s fused forward (``implementation=
    'blockwise'`` on a CPU, float32) over the whole sequence: every path splits a row's keys at the same
    absolute multiples of :data:`TILE_KV` and :data:`SPLIT_KV`. Splits of a long request run in parallel
    (split-KV) and are merged by log-sum-exp in key order, so the number of splits never changes a bit.

    Args:
      q, k_pages, v_pages: one floating dtype.
      page_table, kv_lens, cu_q_lens: integer tables (int32 on device).
      mask: a predicate of positions (``masks.causal()``, the default; ``sliding_window``, ``global_tokens``,
        ``chunked``, ``prefix_lm`` and their combinations), or None for every key below ``kv_lens``.
      scale: logit scale; default ``1 / sqrt(D)``.
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score`` as for :func:`jattn.attention`, with
        ``batch`` the request index (``score_mods.softcap``, ``score_mods.alibi``).
      sinks: one logit per query head, added to each row's denominator without a value.
      return_lse: also return the lse ``(Q, N)``.
      implementation: ``'fused'`` (the fused CPU kernel: float32 compute, masks of one key interval per
        query, no score_mod), ``'xla'`` (XLA's tiles, any mask and score_mod, every platform), ``'pallas'`` (a
        Pallas GPU kernel, Triton; masks of one key interval a query, no score_mod; in interpret mode on a CPU;
        refused on TPU) or None: pallas on a GPU where it takes the call, else fused where it does, else xla.

    Returns:
      ``out``, or ``(out, lse)`` with ``return_lse``.

    Raises:
      TypeError: non-floating or mixed q, k_pages, v_pages; non-integer tables.
      ValueError: shapes that disagree (named with what they got); eagerly, a page index out of range, a
        ``kv_lens`` beyond the request's pages, a ``cu_q_lens`` that does not increase, a q length longer than
        its kv length. Under ``jit`` those requests' rows are NaN instead (all rows where ``cu_q_lens`` does not
        increase). An implementation that cannot take the call names the argument and the path that can.
    """
    p = check_paged(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, mask, scale)
    check_score_mod(score_mod)
    sinks = _sinks(sinks, p)
    path = _choose(implementation, p, score_mod)

    @jax.custom_jvp
    def run(q, k_pages, v_pages, sinks):
        checked = dataclasses.replace(p, q=q, k_pages=k_pages, v_pages=v_pages)
        out, lse = _with_sinks(*_forward(path, checked, score_mod), sinks)
        return out.astype(q.dtype), lse

    run.defjvp(_no_derivatives)
    out, lse = run(p.q, p.k_pages, p.v_pages, sinks)
    return (out, lse) if return_lse else out


def _no_derivatives(primals, tangents):
    """``jvp``, ``grad`` and every other derivative of :func:`paged_attention`: a TypeError naming what differentiates."""
    raise TypeError(
        "paged_attention is forward only (serving and rollouts): it has no derivatives under jax.grad, jax.jvp or "
        "any other transformation that differentiates; differentiate jattn.attention over the contiguous sequence "
        "(its fused CPU forward gives the same bits, implementation='blockwise')"
    )


def _sinks(sinks: ArrayLike | None, p: Paged) -> Array | None:
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    N = p.q.shape[1]
    if not jnp.issubdtype(sinks.dtype, jnp.floating) or sinks.shape not in ((N,), ()):
        raise ValueError(f"paged_attention: sinks must be floating, (N,) = ({N},) or a scalar, got {sinks.dtype} "
                         f"with shape {sinks.shape}")  # fmt: skip
    return jnp.broadcast_to(sinks.astype(jnp.float32), (N,))


def _choose(implementation: str | None, p: Paged, score_mod) -> str:
    """The path: ``implementation`` where it can take the call (else a ValueError naming why), or the first that can."""
    if implementation is not None and implementation not in PAGED_IMPLEMENTATIONS:
        raise ValueError(f"paged_attention: implementation must be one of {PAGED_IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")  # fmt: skip
    if implementation == "pallas" or (implementation is None and jax.default_backend() == "gpu"):
        why = _pallas_kernel(p, score_mod)[1]
        if implementation == "pallas" and why:
            raise ValueError(f"paged_attention: implementation='pallas' cannot take this call: {why}; "
                             "implementation='xla' takes it")  # fmt: skip
        if not why:
            return "pallas"
    why = _fused_refusal(p, score_mod)
    if implementation == "fused" and why:
        raise ValueError(f"paged_attention: implementation='fused' cannot take this call: {why}; "
                         "implementation='xla' takes it")  # fmt: skip
    return implementation or ("xla" if why else "fused")


def _pallas_kernel(p: Paged, score_mod) -> tuple[str | None, str | None]:
    """The Pallas kernel that takes the call: ``(kernel, None)``, or ``(None, why)`` where none does.

    The first of :func:`jattn._paged.pallas.backends` (on sm_90 Mosaic GPU, then Triton) that takes it; each
    kernel's reason named when more than one was tried.
    """
    interpret = _interpreted()
    why = pallas.shared_refusal(p, score_mod)
    if why:
        return None, why
    reasons = {}
    for kernel in pallas.backends(interpret):
        reasons[kernel] = (mosaic.refusal if kernel == "mosaic_gpu" else pallas.triton_refusal)(p, interpret)
        if reasons[kernel] is None:
            return kernel, None
    if len(reasons) == 1:
        return None, next(iter(reasons.values()))
    return None, "; ".join(f"{kernel}: {why}" for kernel, why in reasons.items())


def _interpreted() -> bool:
    """Whether the Pallas path runs in Pallas interpret mode (exact, slow: on a CPU, asked for by name)."""
    return jax.default_backend() != "gpu"


def _fused_refusal(p: Paged, score_mod) -> str | None:
    """Why the fused CPU path cannot take the call, or None."""
    if jax.default_backend() != "cpu" or not fused.available():
        return "the fused CPU kernel runs on a CPU where it is built (jattn._blockwise.fused_cpu_available())"
    if p.q.dtype == jnp.float64:
        return "float64 inputs (it computes in float32)"
    if score_mod is not None:
        return "a score_mod"
    if key_interval(p.mask) is None:
        return f"mask {p.mask!r} (it takes masks of one key interval a query: causal, sliding windows, None)"
    return None


def _forward(path: str, p: Paged, score_mod) -> tuple[Array, Array]:
    """``out (Q, N, E)`` float32 (float64 for float64 inputs) and ``lse (Q, N)``; broken requests' rows NaN."""
    if path == "fused":
        out, lse = fused.forward(p)
    elif path == "pallas":
        kernel = mosaic if _pallas_kernel(p, score_mod)[0] == "mosaic_gpu" else pallas
        out, lse = kernel.forward(p, interpret=_interpreted())
    else:
        out, lse = xla.forward(p, score_mod)
    Q, R = p.q.shape[0], p.page_table.shape[0]
    if R == 0:
        return out, lse
    bad = bad_requests(p)
    request = jnp.searchsorted(p.cu_q_lens, jnp.arange(Q, dtype=jnp.int32), side="right") - 1  # -1 or R: padding
    nan = jnp.where((request >= 0) & (request < R), bad[jnp.clip(request, 0, R - 1)], False) | bad.all()
    return jnp.where(nan[:, None, None], jnp.nan, out), jnp.where(nan[:, None], jnp.nan, lse)


def _with_sinks(out: Array, lse: Array, sinks: Array | None) -> tuple[Array, Array]:
    """``e^sink`` added to each row's denominator: out scaled by ``e^(lse - lse')``, ``lse' = logaddexp(lse, sink)``."""
    if sinks is None:
        return out, lse
    total = jnp.logaddexp(lse, sinks[None, :].astype(lse.dtype))
    factor = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), jnp.exp(lse - total))
    return out * factor[..., None].astype(out.dtype), total
