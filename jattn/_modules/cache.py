"""The decoding cache of the attention modules, as pure functions on a dict of arrays.

NNX keeps the dict in ``nnx.Cache`` variables, Linen in the ``'cache'`` collection; both call
the same functions here. The dict describes its own layout (its keys are static):

- full softmax cache: ``next (B,)`` the next position of each example, ``k``, ``v``
  ``(B, C, K, D)`` with ``C = max_length`` slots and ``pos (B, C)`` the absolute position each
  slot holds (-1: empty);
- ring softmax cache: the same with ``C = window + P`` slots, plus ``window ()`` and
  ``pinned (P,)`` (global positions kept in slots ``0..P-1``; the newest ``window`` tokens
  rotate through the other slots);
- linear cache: ``next (B,)`` and the recurrent state ``kv (B, K, G, F, D)``, ``z (B, K, G, F)``;
- a recurrent kind's cache: ``next (B,)`` and ``state (B, N, 1, D, D)``; a log kind's ``state (B, N, 1, L, D, D)``:
  a state per Fenwick level, L = ``bit_length(max_length - 1) + 1`` (positions below ``max_length`` rounded up to a
  power of 2).

Which one a module keeps is its kind's (:mod:`jattn._modules.kinds`: ``softmax_cache``, ``linear_cache``,
``state_cache`` here).

Keys are cached after QK normalisation and rotary embedding (at their absolute positions).
Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._linear import LinearState, feature_fn
from jattn._masks import Mask
from jattn._scalars import check_dtype, check_int, int_array, is_traced

Cache = dict[str, Array]


def init(
    kind,
    heads: tuple[int, int, int],
    feature_map: str | Callable[[Array], Array],
    batch_size: int,
    max_length: int,
    window: int | None,
    pinned: Sequence[int],
    dtype: Any,
) -> Cache:
    """An empty cache (see the module docstring) of the module kind ``kind`` (its record, whose ``cache`` makes it).

    ``heads = (N, K, D)``; checks ``batch_size`` .. ``dtype`` by name.
    """
    b = check_int("batch_size", batch_size, min=1)
    max_length = check_int("max_length", max_length, min=1)
    check_dtype("dtype", dtype)
    if window is not None:
        window = check_int("window", window, min=1)
    if isinstance(pinned, str) or not isinstance(pinned, Sequence | np.ndarray):
        raise TypeError(f"pinned must be a sequence of non-negative int positions, got {pinned!r}")
    pinned = tuple(check_int(f"pinned[{n}]", p, min=0) for n, p in enumerate(pinned))
    if len(set(pinned)) != len(pinned):
        raise ValueError(f"pinned positions must be distinct, got {pinned}")
    if pinned and window is None:
        raise ValueError(f"pinned={pinned} needs a window (pinned slots sit beside a ring buffer)")
    if not kind.scores and window is not None:
        raise ValueError(f"window={window} applies to the softmax kind; the {kind.name} cache is a recurrent state")
    cache: Cache = {"next": jnp.zeros((b,), jnp.int32)}
    return cache | kind.cache(kind, heads, feature_map, b, max_length, window, pinned, dtype)


def state_cache(kind, heads, feature_map, b: int, max_length: int, window, pinned, dtype) -> Cache:
    """A recurrent kind's ``state`` (its record's :meth:`jattn._linear.kinds.RecurrentKind.state`)."""
    num_heads, _, d = heads
    return {"state": kind.recurrent.state(b, num_heads, d, max_length, dtype)}


def linear_cache(kind, heads, feature_map, b: int, max_length: int, window, pinned, dtype) -> Cache:
    """Linear attention's state ``kv (B, K, G, F, D)``, ``z (B, K, G, F)``."""
    num_heads, kv, d = heads
    g = num_heads // kv
    f = jax.eval_shape(feature_fn(feature_map), jax.ShapeDtypeStruct((d,), dtype)).shape[-1]
    return {"kv": jnp.zeros((b, kv, g, f, d), dtype), "z": jnp.zeros((b, kv, g, f), dtype)}


def softmax_cache(kind, heads, feature_map, b: int, max_length: int, window, pinned, dtype) -> Cache:
    """The softmax kind's slots: ``k``, ``v (B, C, K, D)`` and ``pos (B, C)``, with a ring's ``window`` and ``pinned``."""
    _, kv, d = heads
    slots = max_length if window is None else window + len(pinned)
    cache = {
        "k": jnp.zeros((b, slots, kv, d), dtype),
        "v": jnp.zeros((b, slots, kv, d), dtype),
        "pos": jnp.full((b, slots), -1, jnp.int32),
    }
    if window is not None:
        cache |= {"window": jnp.asarray(window, jnp.int32), "pinned": jnp.asarray(pinned, jnp.int32).reshape(-1)}
    return cache


def positions(cache: Cache, t: int, lengths: Array | None) -> tuple[Array, Array, Array, Array]:
    """Positions of ``t`` new tokens per example.

    Returns ``pos (B, T)`` absolute positions, ``valid (B, T)`` (the first ``lengths[b]`` tokens
    of example b are real), the checked ``lengths (B,)`` and ``bad (B, T)``: outputs to poison
    with NaN (a traced length out of ``[0, T]``, or a position past a full cache). Concrete
    faults raise a ValueError before anything changes.
    """
    b = cache["next"].shape[0]
    if lengths is None:
        lengths, bad = jnp.full((b,), t, jnp.int32), jnp.zeros((b,), bool)
    else:
        lengths = int_array("lengths", lengths, ndim=1, shape=f"(B,) = ({b},)").astype(jnp.int32)
        if lengths.shape != (b,):
            raise ValueError(f"lengths must have shape (B,) = ({b},), got {lengths.shape}")
        bad = (lengths < 0) | (lengths > t)
        if not is_traced(bad) and bool(jnp.any(bad)):
            raise ValueError(f"lengths must be in [0, T={t}], got {np.asarray(lengths).tolist()}")
        lengths = jnp.clip(lengths, 0, t)
    pos = cache["next"][:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # (B, T)
    valid = jnp.arange(t, dtype=jnp.int32)[None] < lengths[:, None]  # (B, T)
    bad = jnp.broadcast_to(bad[:, None], (b, t))
    if "pos" in cache and "window" not in cache:  # the full cache holds positions [0, C)
        capacity = cache["pos"].shape[1]
        past = valid & (pos >= capacity)  # (B, T)
        if not is_traced(past) and bool(jnp.any(past)):
            raise ValueError(
                f"decoding past init_cache(max_length={capacity}): positions up to "
                f"{np.asarray(cache['next'] + lengths).tolist()} (per example) do not fit; allocate a longer cache"
            )
        bad = bad | past
    if "state" in cache and cache["state"].ndim == 6:  # a log kind's levels hold positions below 2^(L-1)
        capacity = 2 ** (cache["state"].shape[3] - 1)
        past = valid & (pos >= capacity)
        if not is_traced(past) and bool(jnp.any(past)):
            raise ValueError(
                f"decoding past the log kind's cache levels (positions below {capacity}, from init_cache's "
                f"max_length): positions up to {np.asarray(cache['next'] + lengths).tolist()}; allocate a longer cache"
            )
        bad = bad | past
    return pos, valid, lengths, bad


def key_positions(cache: Cache, pos: Array, valid: Array) -> Array:
    """``(B, C + T)``: the absolute position of each key :func:`read` returns (-1: an empty slot or padding)."""
    return jnp.concatenate([cache["pos"], jnp.where(valid, pos, -1)], axis=1)


def read(cache: Cache, k: Array, v: Array, pos: Array, valid: Array, mask: Mask) -> tuple[Array, Array, Array]:
    """The keys a step attends to: the cached slots, then this step's ``k, v (B, T, K*D)``.

    Returns ``keys (B, C + T, K*D)``, ``values (B, C + T, K*D)`` and the boolean mask
    ``(B, 1, T, C + T)`` of the predicate ``mask`` on absolute positions (empty slots and
    padding tokens never attended).
    """
    b = k.shape[0]
    kv_pos = key_positions(cache, pos, valid)  # (B, C + T)
    i, j = pos[:, None, :, None], kv_pos[:, None, None, :]
    allowed = mask.allowed(i, j) & (j >= 0)  # (B, 1, T, C + T)
    keys = jnp.concatenate([cache["k"].reshape(b, cache["k"].shape[1], -1).astype(k.dtype), k], axis=1)
    values = jnp.concatenate([cache["v"].reshape(b, cache["v"].shape[1], -1).astype(v.dtype), v], axis=1)
    return keys, values, allowed


def dropped_seen(cache: Cache, pos: Array, valid: Array, mask: Mask) -> Array:
    """``(B, T)``: the tokens at ``pos`` whose query ``mask`` lets see a key the ring has dropped.

    A ring holds the newest ``window`` keys and the pinned ones: it serves masks whose queries
    see nothing older (a sliding window, global tokens pinned as keys); a global token's query,
    which sees every earlier key, needs the full cache. Probed, exactly, at key position 0 and at
    the newest dropped key (a wider window, a global query, an unpinned prefix or global key are
    seen at one of them). Concrete hits raise a ValueError before anything changes; traced ones
    are returned, for NaN outputs. All False for the full and linear caches.
    """
    if "window" not in cache:
        return jnp.zeros(pos.shape, bool)
    gone = (cache["next"] - cache["window"])[:, None, None, None]  # keys below it left the ring (B, 1, 1, 1)
    i = pos[:, None, :, None]  # (B, 1, T, 1), as read() asks the mask
    seen = jnp.zeros(pos.shape, bool)
    for j in (jnp.zeros_like(gone), gone - 1):
        pinned = jnp.any(j[..., None] == cache["pinned"].reshape(1, 1, 1, 1, -1), axis=-1)
        hit = (j >= 0) & (j < gone) & ~pinned & mask.allowed(i, j)
        seen = seen | jnp.broadcast_to(hit, (*pos.shape[:1], 1, pos.shape[1], 1)).reshape(pos.shape)
    seen = seen & valid
    if not is_traced(seen) and bool(jnp.any(seen)):
        where = np.argwhere(np.asarray(seen))[0]
        raise ValueError(
            f"the mask lets the query at position {int(pos[tuple(where)])} (example {int(where[0])}) see keys "
            f"that the ring cache (window={int(cache['window'])}, pinned={np.asarray(cache['pinned']).tolist()}) "
            "has dropped: pin those keys (init_cache(pinned=...)), widen the window, or, for a global token's "
            "query (it sees every key), use the full cache (no window)"
        )
    return seen


def write(cache: Cache, k: Array, v: Array, pos: Array, valid: Array, lengths: Array) -> Cache:
    """The cache after appending this step's ``k, v (B, T, K*D)`` at ``pos (B, T)`` where ``valid``."""
    end = cache["next"] + lengths  # (B,)
    size = cache["pos"].shape[1]
    if "window" not in cache:
        slot = jnp.where(valid & (pos < size), pos, size)  # size: out of range, dropped
    else:
        pinned = cache["pinned"]
        slot = pinned.shape[0] + pos % cache["window"]
        keep = valid & (pos >= end[:, None] - cache["window"])  # only the newest `window` tokens survive
        for n in range(pinned.shape[0]):
            slot = jnp.where(pos == pinned[n], n, slot)
            keep = keep | (valid & (pos == pinned[n]))
        slot = jnp.where(keep, slot, size)
    rows = jnp.broadcast_to(jnp.arange(k.shape[0])[:, None], slot.shape)
    heads = (*k.shape[:2], *cache["k"].shape[-2:])  # (B, T, K, D)
    return cache | {
        "k": cache["k"].at[rows, slot].set(k.reshape(heads).astype(cache["k"].dtype), mode="drop"),
        "v": cache["v"].at[rows, slot].set(v.reshape(heads).astype(cache["v"].dtype), mode="drop"),
        "pos": cache["pos"].at[rows, slot].set(pos, mode="drop"),
        "next": end,
    }


def linear_state(cache: Cache) -> LinearState:
    """The recurrent state of a linear cache."""
    return LinearState(cache["kv"], cache["z"])


def write_linear(cache: Cache, state: LinearState, lengths: Array) -> Cache:
    """The linear cache after a step that advanced each example by ``lengths (B,)``."""
    return cache | {"kv": state.kv, "z": state.z, "next": cache["next"] + lengths}


def write_state(cache: Cache, state: Array, lengths: Array) -> Cache:
    """A recurrent kind's cache after a step that advanced each example by ``lengths (B,)``."""
    return cache | {"state": state.astype(cache["state"].dtype), "next": cache["next"] + lengths}
