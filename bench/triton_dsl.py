"""jattn's GPU forward written once in Triton's own DSL: the kernel the jax_triton route would launch.

The route measured for when JAX removes Pallas' Triton backend (``python -m bench.jax_triton_route``): the
same algorithm as the Pallas kernel (:mod:`jattn._gpu.kernels`), one program per (query block, batch x head):
the tile kinds come from outside (``kinds (nq, nk)``: 0 empty, skipped; 1 partial, masked here by position;
2 full, unmasked), the scores are ``q kᵀ`` on the tensor cores, the softmax is online in base 2, GQA reads
kv head ``bn // G`` with no copy, and the row's log-sum-exp is written beside the output. This file imports
Triton only (no jax): it runs in Triton's interpreter for values and is compiled by Triton's CUDA backend.

Dimension key: BN batch x query heads, T queries, S keys, D head depth (q, k, v alike here), G query heads per
kv head, BQ x BK the tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["EMPTY", "FULL", "PARTIAL", "forward"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def forward(
    q_ptr,  # (BN, T, D)
    k_ptr,  # (BN // G, S, D)
    v_ptr,  # (BN // G, S, D)
    kinds_ptr,  # (nq, NK) int32: EMPTY, PARTIAL (causal, bottom-right aligned) or FULL
    scale,
    T,
    S,
    NK,
    o_ptr,  # (BN, T, D), q's dtype (the outputs last: jax_triton passes them after the operands)
    lse_ptr,  # (BN, T) float32, natural log; -inf on a row that sees no key
    G: tl.constexpr,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
):
    i, bn = tl.program_id(0), tl.program_id(1)
    rows, d = i * BQ + tl.arange(0, BQ), tl.arange(0, D)
    q = tl.load(q_ptr + bn * T * D + rows[:, None] * D + d[None, :], mask=rows[:, None] < T, other=0.0)
    k_base, v_base = k_ptr + (bn // G) * S * D, v_ptr + (bn // G) * S * D
    m = tl.full((BQ,), float("-inf"), tl.float32)
    total = tl.zeros((BQ,), tl.float32)
    acc = tl.zeros((BQ, D), tl.float32)
    for j in range(0, NK):
        kind = tl.load(kinds_ptr + i * NK + j)
        if kind != 0:
            cols = j * BK + tl.arange(0, BK)
            k = tl.load(k_base + cols[:, None] * D + d[None, :], mask=cols[:, None] < S, other=0.0)
            v = tl.load(v_base + cols[:, None] * D + d[None, :], mask=cols[:, None] < S, other=0.0)
            s = tl.dot(q, tl.trans(k)) * (scale * _LOG2E)
            keep = (cols[None, :] < S) & ((kind == 2) | (cols[None, :] <= rows[:, None] + (S - T)))
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - shift[:, None])
            alpha = tl.exp2(m - shift)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
    seen = total > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    tl.store(o_ptr + bn * T * D + rows[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=rows[:, None] < T)
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, total, 1.0))) / _LOG2E, float("-inf"))
    tl.store(lse_ptr + bn * T + rows, lse, mask=rows < T)
