"""The masks: the functions of :mod:`jattn.masks`, the mask classes, tile kinds and a mask's row form.

``constructors`` holds the functions of :mod:`jattn.masks` (this face's ``__all__`` is theirs, and
``jattn.masks`` is ``from jattn._masks import *``); ``base`` the :class:`Mask` base class, its
``&``/``|``/``~`` and the masks read from arrays; ``positions``, ``per_example`` and ``predicates``
the kinds of mask; ``kinds`` the EMPTY / PARTIAL / FULL codes; ``rows`` and ``skeleton`` a mask's
row form and its static skeleton.

May import: ``_scalars``. The rest of jattn imports this subpackage through this face only: the
names imported below, and nothing else. Its files import each other directly, never through the
face.
"""

from jattn._masks.base import ArrayMask, Mask, as_mask, check_lengths, conjuncts, mask_of_array, query_offset
from jattn._masks.constructors import (
    __all__,  # what `from jattn._masks import *` gives
    array,
    causal,
    chunked,
    global_tokens,
    is_mask_function,
    padding,
    predicate,
    prefix_lm,
    segment_ids,
    sliding_window,
    tile_kinds,
)
from jattn._masks.kinds import (
    EMPTY,
    FULL,
    LOWER,
    PARTIAL,
    SPLIT_AREA,
    STAIRS,
    TOP_EMPTY,
    box_kinds,
    reduce_kinds,
    row_kinds,
)
from jattn._masks.per_example import Padding, RowPadding, RowSegments, SegmentIds, on_batch_axis, per_example_steps
from jattn._masks.positions import UNBOUNDED, Causal, KeyBelow, SlidingWindow, key_interval
from jattn._masks.predicates import lead_rows
from jattn._masks.rows import array_leaves, as_rows, example_lead
from jattn._masks.skeleton import fill_arrays, is_slot, map_slots, shared_arrays, split_arrays
