"""Attention over the heads of projected activations (pure functions, no parameters).

:func:`multihead` splits projected ``q (B, T, N*D)``, ``k, v (B, S, K*D)`` into heads, lays
them out for the core as ``(B, K, G, T, D)`` queries against ``(B, K, 1, S, D)`` keys and
values, so grouped-query attention is plain broadcasting and nothing is repeated in memory, and
runs the softmax core, linear attention or ring attention over them. Dimension key:
:mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from jattn._core import attention, attention_weights
from jattn._linear import LinearState, linear_attention
from jattn._masks import Causal, Mask
from jattn._ring import sequence_parallel_attention
from jattn.score_mods import ScoreMod

__all__ = ["Heads", "at_positions", "linear_heads", "multihead", "recurrent_heads", "softmax_heads", "with_causal"]


def _split(x: Array, heads: int, groups: int) -> Array:
    """``(B, L, heads*groups*D) -> (B, heads, groups, L, D)``."""
    b, length, f = x.shape
    return x.reshape(b, length, heads, groups, f // (heads * groups)).transpose(0, 2, 3, 1, 4)


def _check_mask_shape(got: tuple[int, ...], shape: tuple[int, int, int, int]) -> None:
    """Raises unless a mask of shape ``got`` is ``(T, S)``, ``(B, T, S)`` or ``(B, N, T, S)`` for ``shape = (B, N, T, S)``."""
    b, n, t, s = shape
    want = {2: (t, s), 3: (b, t, s), 4: (b, n, t, s)}.get(len(got))
    if want is None or any(m not in (1, w) for m, w in zip(got, want, strict=True)):
        padding = (
            "; a (B, S) key-padding mask goes as mask[:, None, :] (B, 1, S) or masks.padding(kv_lengths=lengths) "
            "(True = attend: torch's key_padding_mask is True at padding, so ~mask)"
        )
        raise ValueError(
            f"mask must have shape (T, S) = {(t, s)}, (B, T, S) = {(b, t, s)} or (B, N, T, S) = {shape} "
            f"(each axis may be 1), got shape {tuple(got)}" + (padding if tuple(got) == (b, s) else "")
        )


def _split_mask(mask: Array | None, shape: tuple[int, int, int, int], num_kv_heads: int) -> Array | None:
    """A boolean mask for ``shape = (B, N, T, S)`` -> broadcastable to ``(B, K, G, T, S)``.

    The rule: a 2-D mask is ``(T, S)``, a 3-D mask ``(B, T, S)`` per example (broadcast over
    heads) and a 4-D mask ``(B, N, T, S)``; any axis may be 1 (broadcast). The module call
    has already refused a function as ``mask`` (:func:`jattn._checks.check_mask`).
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype} with shape {mask.shape}")
    _check_mask_shape(mask.shape, shape)
    n = shape[1]
    if mask.ndim == 3:
        mask = mask[:, None]  # (B, 1, T, S): the same mask for every head
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    heads = (num_kv_heads, n // num_kv_heads) if mask.shape[1] == n != 1 else (1, 1)
    return mask.reshape(mask.shape[0], *heads, *mask.shape[2:])


def with_causal(mask: Array | Mask | None) -> Mask:
    """``masks.causal()`` and ``mask`` (a module's ``causal=True``): causal() itself for None or causal()."""
    if mask is None or isinstance(mask, Causal):
        return Causal()
    return Causal() & mask


def at_positions(score_mod: ScoreMod, q_pos: Array, kv_pos: Array) -> ScoreMod:
    """``score_mod`` at absolute positions ``q_pos (B, T)`` and ``kv_pos (B, S)`` (a cache's, in any slot order).

    The core, called with an array mask, gives ``score_mod`` grid positions: query t at
    ``S - T + t`` and key s at ``s`` (its default offsets); this maps them, per batch row, to the
    positions the tokens really have, so a decoding step modifies the scores as the full pass does.
    """
    t, s = q_pos.shape[1], kv_pos.shape[1]

    def mod(score, batch, head, i, j):
        rows = jnp.clip(i - (s - t), 0, t - 1)  # grid row -> query index (padded tile rows clipped)
        return score_mod(score, batch, head, q_pos[batch, rows], kv_pos[batch, jnp.clip(j, 0, s - 1)])

    return mod


def _ring_size(axis: str | None) -> int:
    """Devices along mesh axis ``axis`` of the current mesh (1 without one)."""
    if axis is None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if axis in mesh.axis_names else 1


class Heads(NamedTuple):
    """What a kind's attention over the heads reads besides ``qh (B, K, G, T, D)``, ``kh``, ``vh (B, K, 1, S, ·)``.

    ``shape = (B, N, T, S)``; ``mask`` as :func:`multihead` takes it (``causal`` and-ed in already for the
    kinds that form no scores and for ring attention, :func:`multihead`); ``valid (B, 1, 1, S)`` (or None) from
    ``kv_mask (B, S)``; ``state`` the cache's (linear: a :class:`jattn.LinearState`, a recurrent kind: its array);
    ``start (B, 1, 1)`` the cache's position (a log kind's level states sit there); ``kind`` the module kind's record.
    """

    kind: object  # jattn._modules.kinds.ModuleKind (typed loosely: that module imports this one)
    shape: tuple[int, int, int, int]
    num_kv_heads: int
    mask: Array | Mask | None
    kv_mask: Array | None
    valid: Array | None
    causal: bool
    state: LinearState | Array | None
    start: Array | None
    gates: dict[str, Array] | None
    feature_map: str | Callable[[Array], Array]
    dropout_rate: float
    dropout_rng: Array | None
    precision: jax.lax.PrecisionLike
    return_weights: bool
    sequence_axis: str | None
    implementation: str | None
    block_size: int | tuple[int, int] | None
    score_mod: ScoreMod | None
    sinks: Array | None
    num_householder: int


def linear_heads(qh: Array, kh: Array, vh: Array, h: Heads) -> tuple[Array, None, LinearState]:
    """Linear attention over the heads: ``out (B, K, G, T, E)``, no weights, the state (it continues a causal sequence)."""
    if h.score_mod is not None or h.sinks is not None:
        raise ValueError("score_mod and sinks need kind='softmax'; linear attention forms no scores")
    if h.return_weights:
        raise ValueError("return_weights needs kind='softmax'; linear attention forms no weights")
    if h.mask is not None and not isinstance(h.mask, Causal):
        raise ValueError(f"kind='linear' takes mask=None or masks.causal(), got {h.mask!r}")
    out, state = linear_attention(
        qh, kh, vh, feature_map=h.feature_map, causal=h.mask is not None, kv_mask=h.valid, initial_state=h.state,
        return_state=True, precision=h.precision,
    )  # fmt: skip
    return out, None, state


def recurrent_heads(qh: Array, kh: Array, vh: Array, h: Heads) -> tuple[Array, None, Array | None]:
    """A recurrent kind over the heads ``(B, N, 1, T, D)`` (K = N), its gates ``(B, N, 1, T[, D])``: out, no weights, the state.

    DeltaProduct (``num_householder`` n_h > 1): k, v and ``beta`` have ``T·n_h`` sub-steps. The state after the
    last step ``(B, N, 1, D, E)`` (or the level states; None for a log kind without a cache).
    """
    if h.mask is not None and not isinstance(h.mask, Causal):
        raise ValueError(f"kind={h.kind.name!r} is causal: it takes mask=None or masks.causal(), got {h.mask!r}")
    if h.return_weights:
        raise ValueError(f"return_weights needs kind='softmax'; kind={h.kind.name!r} forms no weights")
    out, state = h.kind.recurrent.attend(
        qh, kh, vh, h.gates or {}, valid=h.valid, state=h.state, start=h.start, num_householder=h.num_householder,
        precision=h.precision,
    )  # fmt: skip
    return out, None, state


def softmax_heads(qh: Array, kh: Array, vh: Array, h: Heads) -> tuple[Array, Array | None, None]:
    """Softmax attention over the heads (ring attention over ``sequence_axis`` where the mesh has it): out, weights."""
    sinks = None if h.sinks is None else h.sinks.reshape(h.num_kv_heads, -1)  # (N,) -> (K, G): head n = k·G + g
    scores = dict(precision=h.precision, return_weights=h.return_weights, score_mod=h.score_mod, sinks=sinks)
    if _ring_size(h.sequence_axis) > 1:
        out, weights = _ring_heads(
            qh, kh, vh, sequence_axis=h.sequence_axis, mask=h.mask, kv_mask=h.kv_mask, dropout_rate=h.dropout_rate,
            **scores,
        )  # fmt: skip
        return out, weights, None
    mask = _core_mask(h.mask, h.valid, h.shape, h.num_kv_heads, h.causal)
    out = attention(
        qh,
        kh,
        vh,
        mask=mask,
        dropout_rate=h.dropout_rate,
        dropout_rng=h.dropout_rng,
        precision=h.precision,
        implementation=h.implementation,
        block_size=h.block_size if h.implementation in (None, "blockwise") else None,  # tiles of the blockwise path
        score_mod=h.score_mod,
        sinks=sinks,
    )
    weights = None
    if h.return_weights:  # the weights the core applies to v, before dropout (a sink's share left out)
        weights = attention_weights(qh, kh, mask=mask, precision=h.precision, score_mod=h.score_mod, sinks=sinks)
    return out, weights, None


def _ring_heads(
    qh: Array,
    kh: Array,
    vh: Array,
    *,
    sequence_axis: str,
    mask: Array | Mask | None,
    kv_mask: Array | None,
    dropout_rate: float,
    precision: jax.lax.PrecisionLike,
    return_weights: bool,
    score_mod: ScoreMod | None,
    sinks: Array | None,
) -> tuple[Array, Array | None]:
    """Ring attention over ``sequence_axis``: ``out (B, K, G, T, E)`` and the weights ``(B, K, G, T, S)`` if asked."""
    if kv_mask is not None:
        raise ValueError(f"sequence_axis={sequence_axis!r} does not take a context mask (kv_mask)")
    if dropout_rate:
        raise ValueError(f"sequence_axis={sequence_axis!r} does not take dropout_rate={dropout_rate}")
    if score_mod is not None or sinks is not None:
        raise ValueError(
            f"sequence_axis={sequence_axis!r} (ring attention over {_ring_size(sequence_axis)} devices) does not "
            f"take score_mod or sinks, got score_mod={score_mod!r}, sinks={sinks is not None}"
        )
    out = sequence_parallel_attention(qh, kh, vh, axis_name=sequence_axis, mask=mask, precision=precision)
    weights = attention_weights(qh, kh, mask=mask, precision=precision) if return_weights else None
    return out, weights


def _core_mask(
    mask: Array | Mask | None,
    valid: Array | None,
    shape: tuple[int, int, int, int],
    num_kv_heads: int,
    causal: bool = False,
) -> Array | Mask | None:
    """The module mask for ``shape = (B, N, T, S)`` as the core takes it over ``(B, K, G, T, S)``.

    ``valid (B, 1, 1, S)`` is and-ed in, and with ``causal`` :func:`masks.causal() <with_causal>`.
    """
    b, _, t, s = shape
    if not isinstance(mask, Mask):  # a predicate broadcasts over (B, K, G) as it is
        mask = _split_mask(mask, shape, num_kv_heads)  # (B|1, K|1, G|1, T|1, S|1)
    elif mask.per_example:  # its batch is checked on the shape of its dense form (nothing is formed)
        _check_mask_shape(jax.eval_shape(lambda: mask.dense(t, s)).shape, shape)
    if valid is not None:
        valid = valid.reshape(b, 1, 1, 1, s)
        mask = valid if mask is None else mask & valid
    return with_causal(mask) if causal else mask


def multihead(
    q: Array,
    k: Array,
    v: Array,
    *,
    kind,
    num_heads: int,
    num_kv_heads: int,
    mask: Array | Mask | None,
    kv_mask: Array | None = None,
    feature_map: str | Callable[[Array], Array] = "elu",
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_weights: bool = False,
    linear_state: LinearState | Array | None = None,
    start: Array | None = None,
    gates: dict[str, Array] | None = None,
    causal: bool = False,
    sequence_axis: str | None = None,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Array | None = None,
    num_householder: int = 1,
) -> tuple[Array, Array | None, LinearState | Array | None]:
    """Attention over heads of projected ``q (B, T, N*D)``, ``k, v (B, S, K*D)``, as the module ``kind`` computes it.

    ``kind``: the module kind's record (:class:`jattn._modules.kinds.ModuleKind`), whose ``heads`` attends.
    ``mask`` is a boolean ``(T, S)``, ``(B, T, S)`` (per example, broadcast over heads) or
    ``(B, N, T, S)`` array (any axis may be 1), or a :class:`~jattn.masks.Mask`, which goes to
    the core as it is (so the blockwise path can skip its empty tiles); ``kv_mask (B, S)`` marks
    valid keys (context padding). ``implementation`` and ``block_size`` are those of
    :func:`jattn.attention` (``block_size`` is dropped for a path other than the blockwise one). For ``kind='linear'`` the mask must
    be None or ``causal()`` and ``linear_state`` continues a causal sequence (a recurrent kind's state likewise,
    ``start (B, 1, 1)`` its position). ``score_mod`` goes to
    the core as it is (its ``head`` is the query head n = k·G + g) and ``sinks (N,)`` as ``(K, G)``
    (softmax kind, not over a ring). ``causal`` ands ``masks.causal()`` into ``mask`` (None included).
    ``num_householder``: the DeltaProduct kinds' ``n_h``, k and v then ``(B, S, n_h·K·D)`` (sub-step outermost).

    Returns ``out (B, T, N*E)``, the weights ``(B, N, T, S)`` (before dropout) if asked, and
    the state after the last key (the kinds that keep one).

    With ``sequence_axis`` naming an axis of more than one device in the current mesh
    (``jax.set_mesh``), softmax attention runs as ring attention over it
    (:func:`jattn.sequence_parallel_attention`); elsewhere it is the plain core.
    """
    groups = num_heads // num_kv_heads
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if num_householder > 1:  # (B, S, n·K·D) -> (B, S·n, K·D): token s's j-th key at s·n + j (layout (n h d))
        k, v = (x.reshape(b, s * num_householder, x.shape[-1] // num_householder) for x in (k, v))
    qh = _split(q, num_kv_heads, groups)  # (B, K, G, T, D)
    kh = _split(k, num_kv_heads, 1)  # (B, K, 1, S, D); S·n_h sub-steps for DeltaProduct
    vh = _split(v, num_kv_heads, 1)  # (B, K, 1, S, E)
    valid = None if kv_mask is None else jnp.asarray(kv_mask).reshape(b, 1, 1, s)  # (B, 1, 1, S)
    if causal and (not kind.scores or _ring_size(sequence_axis) > 1):  # else the core's mask: _core_mask
        mask = with_causal(mask)
    heads = Heads(
        kind, (b, num_heads, t, s), num_kv_heads, mask, kv_mask, valid, causal, linear_state, start, gates,
        feature_map, dropout_rate, dropout_rng, precision, return_weights, sequence_axis, implementation, block_size,
        score_mod, sinks, num_householder,
    )  # fmt: skip
    out, weights, state = kind.heads(qh, kh, vh, heads)
    weights = None if weights is None else weights.reshape(b, num_heads, t, s)  # (B, K, G, T, S) -> (B, N, T, S)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, -1)  # (B, K, G, T, E) -> (B, T, N*E)
    return out, weights, state
