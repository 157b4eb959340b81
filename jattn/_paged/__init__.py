"""Paged attention for serving: a flat ragged batch of queries against a paged KV pool.

:func:`jattn.paged_attention` (:mod:`jattn._paged.api`) validates (:mod:`jattn._paged.checks`) and
dispatches to the fused CPU kernel reading pages through the table (:mod:`jattn._paged.fused`) or XLA's
tiles reading one page of every query block a step (:mod:`jattn._paged.xla`).
"""

from jattn._paged.api import PAGED_IMPLEMENTATIONS, SPLIT_KV, TILE_KV, paged_attention

__all__ = ["PAGED_IMPLEMENTATIONS", "SPLIT_KV", "TILE_KV", "paged_attention"]
