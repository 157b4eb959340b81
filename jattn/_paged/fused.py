"""The fused CPU path of paged attention: :func:`jattn._blockwise.paged_forward` on the checked operands."""

from __future__ import annotations

from jax import Array

from jattn._blockwise import FUSED_BLOCK_KV, SPLIT_KV, fused_cpu_available, paged_forward
from jattn._masks import key_interval
from jattn._paged.checks import Paged
from jattn._platform import cpu_threads

__all__ = ["SPLIT_KV", "TILE_KV", "available", "forward"]

TILE_KV = FUSED_BLOCK_KV


def available() -> bool:
    """Whether the fused CPU kernels run here (:func:`jattn._blockwise.fused_cpu_available`)."""
    return fused_cpu_available()


def forward(p: Paged) -> tuple[Array, Array]:
    """``out (Q, N, E)`` and ``lse (Q, N)``, float32, from the fused CPU kernel; the mask one key interval a query."""
    window = key_interval(p.mask)
    assert window is not None, "the caller checks the mask"
    return paged_forward(
        p.q, p.k_pages, p.v_pages, p.page_table, p.kv_lens, p.cu_q_lens,
        window=window, scale=p.scale, threads=cpu_threads(),
    )  # fmt: skip
