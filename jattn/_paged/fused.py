"""The fused CPU path of paged attention: :func:`jattn._blockwise.fused_cpu.paged_forward` on the checked operands."""

from __future__ import annotations

from jax import Array

from jattn._blockwise import fused_cpu
from jattn._masks.positions import key_interval
from jattn._paged.checks import Paged
from jattn._platform import cpu_threads

__all__ = ["SPLIT_KV", "TILE_KV", "available", "forward"]

TILE_KV, SPLIT_KV = fused_cpu.BLOCK_KV, fused_cpu.SPLIT_KV


def available() -> bool:
    """Whether the fused CPU kernels run here (:func:`jattn._blockwise.fused_cpu.available`)."""
    return fused_cpu.available()


def forward(p: Paged) -> tuple[Array, Array]:
    """``out (Q, N, E)`` and ``lse (Q, N)``, float32, from the fused CPU kernel; the mask one key interval a query."""
    window = key_interval(p.mask)
    assert window is not None, "the caller checks the mask"
    return fused_cpu.paged_forward(
        p.q, p.k_pages, p.v_pages, p.page_table, p.kv_lens, p.cu_q_lens,
        window=window, scale=p.scale, threads=cpu_threads(),
    )  # fmt: skip
