"""Paged attention for serving: a flat ragged batch of queries against a paged KV pool.

:func:`jattn.paged_attention` (:mod:`jattn._paged.api`) validates (:mod:`jattn._paged.checks`) and
dispatches to the fused CPU kernel reading pages through the table (:mod:`jattn._paged.fused`) or XLA's
tiles reading a tile of pages of every query block a step (:mod:`jattn._paged.xla`) or a Pallas kernel on GPU
(:mod:`jattn._paged.pallas`: Triton; interpret mode on CPU).

May import: ``_blockwise``, ``_checks``, ``_gpu``, ``_masks``, ``_online``, ``_platform``, ``_softmax``. The rest of jattn
imports this subpackage through this face only: the names imported below, and nothing else. Its files import
each other directly, never through the face.
"""

from jattn._paged.api import PAGED_IMPLEMENTATIONS, SPLIT_KV, TILE_KV, paged_attention

__all__ = ["PAGED_IMPLEMENTATIONS", "SPLIT_KV", "TILE_KV", "paged_attention"]
