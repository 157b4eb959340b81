"""Mask predicates of (query position, key position); combine with ``&``, ``|``, ``~``.

Constructors: ``causal``, ``sliding_window``, ``global_tokens``, ``padding``, ``segment_ids``,
``prefix_lm``, ``chunked``.

See :mod:`jattn._masks` for positions, offsets and block classification.
"""

from jattn._masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    causal,
    chunked,
    global_tokens,
    padding,
    prefix_lm,
    segment_ids,
    sliding_window,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "causal",
    "chunked",
    "global_tokens",
    "padding",
    "prefix_lm",
    "segment_ids",
    "sliding_window",
]
