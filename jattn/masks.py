"""Mask predicates of (query position, key position); combine with ``&``, ``|``, ``~``.

Constructors: ``causal``, ``sliding_window``, ``global_tokens``, ``padding``, ``segment_ids``,
``prefix_lm``, ``chunked``; ``predicate`` for a function of (batch, head, q_pos, kv_pos); ``array`` for an explicit boolean array (a plain array combines with
predicates too). ``tile_kinds`` classifies tiles on device, arrays included.

See :mod:`jattn._masks.constructors` for positions, offsets and block classification.
"""

from jattn._masks import *  # noqa: F403  (the names of jattn._masks.constructors's __all__, below)
from jattn._masks import __all__ as __all__
