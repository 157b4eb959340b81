"""Masks as composable predicates of (query position, key position): the functions of :mod:`jattn.masks`.

A :class:`Mask` answers "may the query at absolute position ``i`` attend to the key at absolute
position ``j``?". Queries ``t = 0..T-1`` sit at positions ``q_offset + t`` and keys
``s = 0..S-1`` at ``kv_offset + s``. By default ``kv_offset = 0`` and ``q_offset = S - T``:
queries are aligned **bottom-right**, at the end of the keys, which is where the newest tokens
of a KV cache sit; for ``T == S`` this is the usual alignment. Offsets may be per example
(shape ``(B,)``), as in a ragged batch.

Masks combine with ``&``, ``|`` and ``~``. Each can

* materialise the dense boolean mask (:meth:`Mask.dense`), ``(T, S)`` or, for a mask that
  depends on the example (``padding``, ``segment_ids``, per-example offsets), ``(B, 1, T, S)``
  with the batch on the first axis; and
* classify the blocks of a tiling of ``(T, S)`` as empty, partial or full
  (:meth:`Mask.block_kinds`), statically from the positions alone where the predicate allows
  (example-dependent masks are reported partial here, and classified on device by
  :func:`tile_kinds`, per example), so that a blockwise kernel can skip empty blocks and drop
  the mask on full ones.

An explicit boolean array is a mask too (:func:`array`, or implicitly when combined with a
predicate by ``&``/``|``): it indexes the ``(t, s)`` grid of one call, broadcasts like NumPy
(a 1-D ``(S,)`` array masks keys), and its blocks are classified at run time
(:func:`tile_kinds`), so a blockwise kernel still skips its all-False tiles.

Example: Longformer's global + sliding window is ``sliding_window(w, w) | global_tokens([0])``.

This module holds the constructors and :func:`tile_kinds` (its ``__all__`` is :mod:`jattn.masks`).
The masks themselves: :mod:`jattn._masks.base` (the base class, ``&``/``|``/``~``, arrays),
:mod:`jattn._masks.positions`, :mod:`jattn._masks.per_example`, :mod:`jattn._masks.predicates`; tile
kinds: :mod:`jattn._masks.kinds`; a mask in a call: :mod:`jattn._masks.rows`,
:mod:`jattn._masks.skeleton`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._masks.base import ArrayMask, Mask, broadcast_ranked, check_lengths, mask_of_array
from jattn._masks.kinds import EMPTY, FULL, PARTIAL, reduce_kinds, row_kinds
from jattn._masks.per_example import Padding, SegmentIds
from jattn._masks.positions import Causal, Chunked, GlobalTokens, KeyBelow, SlidingWindow
from jattn._masks.predicates import Predicate
from jattn._masks.rows import array_leaves, as_rows, example_lead
from jattn._scalars import check_int, int_array, is_traced

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "ArrayMask",
    "Mask",
    "array",
    "causal",
    "chunked",
    "global_tokens",
    "padding",
    "predicate",
    "prefix_lm",
    "segment_ids",
    "sliding_window",
    "tile_kinds",
]


_F = TypeVar("_F", bound=Callable[..., Any])


def _public(fn: _F) -> _F:
    """Marks ``fn`` a function of :mod:`jattn.masks`, by an attribute: :func:`is_mask_function` knows it."""
    fn._jattn_masks = True
    return fn


def is_mask_function(fn: Any) -> bool:
    """True for a function of :mod:`jattn.masks` (``masks.causal``...): errors that get one uncalled name it."""
    return inspect.isfunction(fn) and getattr(fn, "_jattn_masks", False)


@_public
def causal() -> Mask:
    """``j <= i``; with ``T != S`` queries align bottom-right (see the module docstring)."""
    return Causal()


@_public
def sliding_window(left: int, right: int = 0) -> Mask:
    """``i - left <= j <= i + right``; ``sliding_window(w)`` is a causal window of ``w + 1`` keys.

    ``left`` and ``right`` are non-negative ints (Python or NumPy integers, not bool).
    """
    return SlidingWindow(check_int("sliding_window left", left, min=0), check_int("sliding_window right", right, min=0))


@_public
def global_tokens(indices: Sequence[int]) -> Mask:
    """The tokens at ``indices`` (absolute positions: non-negative ints) see all and are seen by all."""
    if isinstance(indices, str) or not isinstance(indices, Sequence | np.ndarray | jax.Array) or is_traced(indices):
        raise TypeError(f"global_tokens indices must be a sequence of static ints, got {indices!r}")
    indices = tuple(check_int(f"global_tokens indices[{n}]", x, min=0) for n, x in enumerate(indices))
    if not indices:
        raise ValueError("global_tokens needs at least one index, got []")
    return GlobalTokens(indices)


@_public
def chunked(size: int) -> Mask:
    """Attention only within chunks ``[k*size, (k+1)*size)`` of positions; ``size`` a positive int."""
    return Chunked(check_int("chunked size", size, min=1))


@_public
def prefix_lm(prefix_length: int) -> Mask:
    """Bidirectional over the first ``prefix_length`` (a non-negative int) positions, causal after them."""
    return Causal() | KeyBelow(check_int("prefix_length", prefix_length, min=0))


def _keywords_only(fn: Callable[..., Mask]) -> Callable[..., Mask]:
    """``fn`` (keyword-only arguments), refusing a positional call with a TypeError that names the keywords."""

    @functools.wraps(fn)
    def call(*args: object, **kwargs: Any) -> Mask:
        if args:
            raise TypeError(
                f"masks.padding takes its lengths by keyword: pass kv_lengths=... (key padding: the keys s >= "
                f"length of each example are masked, the common case) or q_lengths=... (query padding), or both; "
                f"got {len(args)} positional argument(s) (a positional padding(lengths) once meant q_lengths)"
            )
        return fn(**kwargs)

    return call


@_public
@_keywords_only
def padding(*, kv_lengths: ArrayLike | None = None, q_lengths: ArrayLike | None = None) -> Mask:
    """Per-example valid lengths ``(B,)`` of the keys and/or queries, by keyword; the rest is masked.

    ``padding(kv_lengths=n)`` is key padding, the common case (a batch of sequences padded to
    one length; torch's ``key_padding_mask`` is its negation): query t of example b attends to
    the keys ``s < n[b]`` only. ``padding(q_lengths=n)`` masks the query rows ``t >= n[b]``
    (their output is 0); both together mask both. A positional call raises a TypeError: which
    lengths are meant is said by name.

    Lengths are non-negative integers; a length beyond the sequence means all of it is valid.
    Negative lengths raise a ValueError when they can be read; traced under ``jit``, a negative
    length counts as 0 (the whole example is masked, and a fully masked query row gives 0).

    Args:
      kv_lengths: ``(B,)`` valid keys of each example.
      q_lengths: ``(B,)`` valid queries of each example.
    """
    if q_lengths is None and kv_lengths is None:
        raise ValueError("padding needs q_lengths or kv_lengths")
    checked = []
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if x is not None:
            x = int_array(f"padding {name}", x, ndim=1, shape="(B,)")
            if not is_traced(x) and x.size and int(x.min()) < 0:
                raise ValueError(f"padding {name} must be non-negative, got {np.asarray(x).tolist()}")
        checked.append(x)
    q_lengths, kv_lengths = checked
    if q_lengths is not None and kv_lengths is not None and len({q_lengths.shape[0], kv_lengths.shape[0]} - {1}) > 1:
        raise ValueError(
            f"padding q_lengths and kv_lengths must share the batch B, got {q_lengths.shape} and {kv_lengths.shape}"
        )
    return Padding(q_lengths, kv_lengths)


@_public
def segment_ids(q_segments: ArrayLike, kv_segments: ArrayLike | None = None) -> Mask:
    """Document masking for packed sequences: ``q_segments (B, T)``, ``kv_segments (B, S)``.

    Integer segment ids; ``kv_segments`` defaults to ``q_segments`` (self-attention). The
    lengths T and S must equal those of the queries and keys the mask is used with.
    """
    kv_segments = q_segments if kv_segments is None else kv_segments
    q = int_array("segment_ids q_segments", q_segments, ndim=2, shape="(B, T)")
    kv = int_array("segment_ids kv_segments", kv_segments, ndim=2, shape="(B, S)")
    if len({q.shape[0], kv.shape[0]} - {1}) > 1:
        raise ValueError(
            f"segment_ids q_segments (B, T) and kv_segments (B, S) must share the batch B, got {q.shape} and {kv.shape}"
        )
    return SegmentIds(q, kv)


@_public
def predicate(fn: Any) -> Predicate:
    """A mask from ``fn(batch, head, q_pos, kv_pos) -> bool``, a function of int32 scalars (vmapped over the grid).

    ``batch`` indexes the first leading axis of the call (after broadcasting q, k, v, mask and
    bias), ``head`` the remaining leading axes flattened row-major, ``q_pos``/``kv_pos`` the
    absolute positions (offsets included), as for ``score_mod``. ``fn`` may close over arrays
    (document ids, per-head window sizes), traced ones included. Combine with position predicates
    by ``&`` so the blockwise path skips their empty tiles; tiles of the predicate itself are all
    evaluated. Example: ``predicate(lambda b, h, q, kv: q - kv <= windows[h])``.
    """
    if not callable(fn):
        raise TypeError(f"predicate needs a callable fn(batch, head, q_pos, kv_pos) -> bool, got {fn!r}")
    return Predicate(fn)


@_public
def array(m: ArrayLike) -> ArrayMask:
    """An explicit boolean mask ``(..., T, S)`` (True = attend), broadcastable like NumPy.

    A 1-D ``(S,)`` array masks keys for every query; 0-D masks everything or nothing. It combines
    with predicates by ``&``, ``|`` and ``~``; a plain boolean array passed as ``mask=`` is read the
    same way.
    """
    return mask_of_array(m)


@_public
def tile_kinds(mask: Mask, T: int, S: int, block_q: int, block_kv: int, *, q_offset: int, kv_offset: int) -> Array:
    """``(ceil(T/block_q), ceil(S/block_kv))`` int8 EMPTY / PARTIAL / FULL, traced.

    As :meth:`Mask.block_kinds`, but array leaves and per-example masks (``padding``,
    ``segment_ids``) are read on device: a tile empty for every example (every entry of an array
    False) is empty, one full for every example full. Works under ``jit`` with traced arrays.
    Static ``q_offset``/``kv_offset``.
    """
    check_lengths(mask, T, S)
    leads = [a.array.shape[:-2] for a in array_leaves(mask)]
    ndim = 2 + max([1, *map(len, leads)])  # the rank of a q the leaves broadcast against
    lead = broadcast_ranked(example_lead(mask, ndim), *leads)
    rows = as_rows(mask, lead)._bind(q_offset, kv_offset)
    return reduce_kinds(row_kinds(rows, T, S, block_q, block_kv, q_offset=q_offset, kv_offset=kv_offset))
