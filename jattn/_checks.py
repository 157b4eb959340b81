"""Argument checks shared by the public functions and modules of jattn.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong
value or shape) with a message that names the argument, what it got and what is allowed.
The scalar checks (ints, bools, reals, dtypes) are :mod:`jattn._scalars`, which imports nothing of
jattn; the checks here build on the masks (:mod:`jattn._masks`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._masks import (
    ArrayMask,
    Mask,
    array_leaves,
    check_lengths,
    example_lead,
    is_mask_function,
    mask_of_array,
)
from jattn._scalars import check_int, check_real

__all__ = [
    "KernelRefusalError",
    "Operands",
    "Options",
    "Result",
    "as_mask",
    "broadcast_all",
    "call_lead",
    "check_bias",
    "check_block_size",
    "check_dropout",
    "check_grid",
    "check_mask",
    "check_offsets",
    "check_operands",
    "check_qkv",
    "check_scale",
    "check_score_mod",
    "check_sinks",
    "default_scale",
    "layout_hint",
]


class KernelRefusalError(ValueError):
    """A fused kernel cannot take this call (a "partly" cell of :data:`jattn.SUPPORT`, decided per call).

    Raised by a kernel's translation before it builds anything; with ``implementation=None`` the
    automatic choice catches it and tries the platform's next path, with the kernel named it reaches
    the caller as the ``ValueError`` it is, naming the argument and the paths that take it.
    """


_FLOATS = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)))


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array | None) -> None:
    """Validates q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``: ranks, dtypes, depths."""
    named = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, x in named.items():
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., len, depth), got shape {x.shape}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if len({x.dtype for x in named.values()}) > 1:
        got = ", ".join(f"{n}={x.dtype}" for n, x in named.items())
        raise TypeError(f"q, k and v must share one dtype, got {got}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same depth D (last axis), got q {q.shape} and k {k.shape}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k need a depth D >= 1 (last axis), got q {q.shape} and k {k.shape}")
    if v is not None and k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length S (axis -2), got k {k.shape} and v {v.shape}")


def _leads(arrays: dict[str, jax.Array]) -> tuple[int, ...] | None:
    """The broadcast of the arrays' leading shapes (all but the last two axes), or None."""
    try:
        return tuple(np.broadcast_shapes(*(x.shape[:-2] for x in arrays.values())))
    except ValueError:
        return None


def broadcast_all(**arrays: jax.Array | None) -> tuple[int, ...]:
    """The broadcast leading shape ``...`` of the named arrays, or an error naming their shapes.

    q, k (and v) are checked first, with :func:`layout_hint`; then ``mask`` and ``bias``
    against ``(..., T, S)`` (:func:`check_grid`), then every leading shape together.
    """
    named = {n: x for n, x in arrays.items() if x is not None}
    q, k = named["q"], named["k"]
    qkv = {n: x for n, x in named.items() if n in ("q", "k", "v")}
    if _leads(qkv) is None:
        shapes = ", ".join(f"{n} {x.shape}" for n, x in qkv.items())
        raise ValueError(
            f"leading dimensions of {', '.join(qkv)} do not broadcast: {shapes}" + layout_hint(q.shape, k.shape)
        )
    for name in ("mask", "bias"):
        if name in named:
            check_grid(name, named[name].shape, q.shape, k.shape)
    lead = _leads(named)
    if lead is None:
        shapes = ", ".join(f"{n} {x.shape}" for n, x in named.items())
        raise ValueError(
            f"leading dimensions do not broadcast: {shapes}; a mask or bias (..., T, S) broadcasts against the leading "
            f"dims {_leads(qkv)} of q, k, v" + _grouped_grid_hint(named)
        )
    return lead


def layout_hint(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> str:
    """What :func:`jattn.attention` takes, the grouped form for ``q_shape``/``k_shape`` and jax.nn's entry point.

    Appended to the errors of q, k, v leading dims that do not broadcast: torch's grouped-query
    ``(B, N, T, D)`` against ``(B, K, S, D)`` and jax.nn's ``(B, T, N, H)`` land there.
    """
    grouped = "q.reshape(B, K, G, T, D) with k[:, :, None] and v[:, :, None]"
    if len(q_shape) == len(k_shape) >= 3:
        n, kv = q_shape[-3], k_shape[-3]
        if 0 < kv < n and n % kv == 0:  # torch's grouped heads: q (..., N, T, D) against k (..., K, S, D)
            cut = ", ".join(map(str, (*q_shape[:-3], kv, n // kv, *q_shape[-2:])))
            index = ":, " * (len(k_shape) - 2) + "None"
            grouped = (
                f"for these shapes read as (B, N, T, D), (B, K, S, D): q.reshape({cut}) with k[{index}] and v[{index}]"
            )
    return (
        "; jattn.attention reads q (..., T, D), k (..., S, D), v (..., S, E), the heads among the leading dims ... "
        "as in torch's (B, N, T, D); grouped-query heads (N = K·G) go as q (B, K, G, T, D) against k, v "
        f"(B, K, 1, S, D), {grouped}; for jax.nn's layout q (B, T, N, H), k, v (B, S, K, H) call "
        "jattn.dot_product_attention(q, k, v)"
    )


def _grouped_grid_hint(named: dict[str, jax.Array]) -> str:
    """For grouped q ``(..., K, G, T, D)``: how a ``(B, N, T, S)`` mask or bias takes the grouped form."""
    q = named["q"]
    if q.ndim < 5:
        return ""
    K, G = q.shape[-4:-2]
    for name in ("mask", "bias"):
        x = named.get(name)
        if x is not None and x.ndim == q.ndim - 1 and x.shape[-3] == K * G:
            cut = ", ".join(map(str, (*x.shape[:-3], K, G, *x.shape[-2:])))
            return f"; a (B, N, T, S) {name} goes with grouped heads as {name}.reshape({cut}) (B, K, G, T, S)"
    return "; a (B, N, T, S) mask or bias goes with grouped heads as x.reshape(B, K, G, T, S)"


def check_grid(name: str, shape: tuple[int, ...], q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> None:
    """Raises unless a ``mask``/``bias`` of ``shape`` (as the caller gave it) broadcasts to ``(..., T, S)``.

    ``T`` and ``S`` are axis -2 of ``q_shape`` and ``k_shape``; 0-D and 1-D ``(S,)`` shapes
    broadcast like NumPy. The error reports ``shape`` itself and, where the shape fits them,
    torch's ``(B, S)`` key padding and jax.nn's layout (:func:`_grid_hint`).
    """
    t, s = q_shape[-2], k_shape[-2]
    grid = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    if grid[-2] in (1, t) and grid[-1] in (1, s):
        return
    raise ValueError(
        f"{name} of shape {tuple(shape)} does not broadcast to (..., T, S) = (..., {t}, {s}) (T and S: axis -2 of "
        f"q {tuple(q_shape)} and k {tuple(k_shape)})" + _grid_hint(name, grid, q_shape, k_shape)
    )


def _grid_hint(name: str, grid: tuple[int, ...], q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> str:
    """What a ``(..., T, S)`` array that does not fit may be: torch's key padding ``(B, S)``, or jax.nn's layout."""
    hints = []
    if len(grid) == 2 and len(q_shape) >= 3 and grid == (q_shape[0], k_shape[-2]):
        expand = f"{name}[:, {'None, ' * (len(q_shape) - 2)}:]"
        if name == "mask":
            hints.append(
                f"a (B, S) key-padding mask (B = q's first axis) is masks.padding(kv_lengths=lengths) with the valid "
                f"keys (B,) of each example, or {expand} (True = attend: torch's key_padding_mask is True at "
                "padding, so pass ~mask)"
            )
        else:
            hints.append(f"a (B, S) bias per example and key (B = q's first axis) goes as {expand}")
    if len(q_shape) >= 3 and len(k_shape) >= 3 and grid[-2] in (1, q_shape[-3]) and grid[-1] in (1, k_shape[-3]):
        hints.append(
            f"it fits (T, S) = ({q_shape[-3]}, {k_shape[-3]}) as if q and k were jax.nn's (B, T, N, H) and "
            "(B, S, K, H), which jattn.attention reads as (..., T, D) with T = N: call jattn.dot_product_attention, "
            "or swap the axes of q, k, v to (B, N, T, D) with x.swapaxes(-3, -2)"
        )
    return "".join(f"; {h}" for h in hints)


def check_mask(mask: Any, *, arrays_only: bool = False) -> None:
    """Raises a TypeError naming ``mask`` for a function given as a mask (e.g. ``masks.causal``, uncalled).

    A jattn mask predicate is built by calling its constructor (``masks.causal()``); a function
    of ``(batch, head, q_pos, kv_pos)`` becomes one with ``masks.predicate(fn)``. With
    ``arrays_only`` (jax.nn's signature, :func:`jattn.dot_product_attention`) a
    :class:`jattn.masks.Mask` is refused too. Every entry point that takes a mask calls this.
    """
    if arrays_only and (callable(mask) or isinstance(mask, Mask)):
        raise TypeError(
            f"mask must be a boolean array broadcastable to (B, N, T, S) (jax.nn's mask, True = attend), got "
            f"{_called(mask)}; pass is_causal=True for a causal mask and local_window_size=(left, right) for a band, "
            "or call jattn.attention (q (B, N, T, D)) to use a jattn.masks predicate"
        )
    if callable(mask):
        raise TypeError(f"mask must be a boolean array or a jattn.masks.Mask, got {_called(mask)}: {_mask_fix(mask)}")


def _called(fn: Any) -> str:
    """``fn`` for an error message: a jattn.masks constructor by its public name."""
    if is_mask_function(fn):
        return f"the function masks.{fn.__name__}"
    return f"{fn!r} of type {type(fn).__name__}"


def _mask_fix(fn: Any) -> str:
    """How to make a mask of the callable ``fn``: call a jattn.masks constructor, or wrap a predicate."""
    if is_mask_function(fn):
        params = inspect.signature(fn).parameters.values()
        required = [p.name for p in params if p.default is p.empty]
        args = ", ".join(required) if required or not params else "..."
        return f"a mask predicate is built by calling its constructor: mask=masks.{fn.__name__}({args})"
    return (
        "a mask predicate is built by calling its constructor, e.g. mask=masks.causal(), and a function "
        "fn(batch, head, q_pos, kv_pos) -> bool becomes one with mask=masks.predicate(fn)"
    )


def check_block_size(block_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``(block_q, block_kv)`` of positive ints, or an error naming ``block_size``."""
    if block_size is None:
        return None
    pair = block_size if isinstance(block_size, tuple | list) else (block_size, block_size)
    if len(pair) != 2:
        raise ValueError(f"block_size must be an int or a pair (block_q, block_kv), got {block_size!r}")
    return check_int("block_size", pair[0], min=1), check_int("block_size", pair[1], min=1)


def check_score_mod(score_mod: Any) -> None:
    """Raises a TypeError unless ``score_mod`` is None or callable."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            "score_mod must be a callable (score, batch, head, q_pos, kv_pos) -> score or None, "
            f"got {score_mod!r} of type {type(score_mod).__name__}"
        )


def check_sinks(sinks: jax.Array, lead: tuple[int, ...], dtype) -> None:
    """Raises unless ``sinks`` is floating and broadcasts to the leading shape ``lead`` of q, k, v."""
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be floating point, got {sinks.dtype} with shape {sinks.shape}")
    try:
        ok = np.broadcast_shapes(sinks.shape, lead) == tuple(lead)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"sinks of shape {sinks.shape} does not broadcast to the leading dimensions {tuple(lead)} of q, k, v "
            "(one logit per head: (N,) against (B, N, T, D); (K, G) against (B, K, G, T, D))"
        )


def check_scale(scale: float | ArrayLike | None) -> None:
    """Raises unless ``scale`` is None, a real number or a 0-d floating array."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(
            f"scale must be a real number or a 0-d float array, got {scale!r} of type {type(scale).__name__}"
        )
    if isinstance(scale, np.ndarray | jax.Array) and (
        np.ndim(scale) != 0 or not jnp.issubdtype(scale.dtype, jnp.floating)
    ):
        raise ValueError(
            f"scale must be a scalar (0-d float array), got dtype {scale.dtype} with shape {np.shape(scale)}"
        )


def default_scale(scale: float | ArrayLike | None, D: int) -> float | ArrayLike:
    """``scale``, or the article's ``1/√D`` where it is None (the one place that default is written)."""
    return 1.0 / math.sqrt(D) if scale is None else scale


def check_bias(bias: ArrayLike | None) -> jax.Array | None:
    """``bias`` as a floating array of at least 2 dims ``(..., T|1, S|1)``, or a TypeError; None stays None."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be floating point, got {bias.dtype} with shape {bias.shape}")
    return bias.reshape((1,) * max(0, 2 - bias.ndim) + bias.shape)  # NumPy broadcasting: (S,) is (1, S)


def as_mask(
    mask: ArrayLike | Mask | None, bias: ArrayLike | None, q: jax.Array, k: jax.Array
) -> tuple[Mask | None, jax.Array | None]:
    """``(mask, bias)`` checked: an array mask as :class:`~jattn.masks.ArrayMask`, bias as :func:`check_bias`'s.

    A boolean array mask (1-D and 0-D included) becomes an ``ArrayMask``; a Mask or None stays.

    Checks first that ``mask`` is no function (:func:`check_mask`), and that an array mask and
    ``bias`` broadcast to ``(..., T, S)`` (T, S: axis -2 of q ``(..., T, D)`` and k
    ``(..., S, D)``), in the shapes the caller gave.
    """
    check_mask(mask)
    if bias is not None:
        shape, bias = jnp.shape(bias), check_bias(bias)  # its dtype first
        check_grid("bias", shape, q.shape, k.shape)
    if mask is None or isinstance(mask, Mask):
        return mask, bias
    masked = mask_of_array(mask)
    check_grid("mask", jnp.shape(mask), q.shape, k.shape)
    return masked, bias


def check_offsets(mask: Mask | None, q_offset: ArrayLike | None, kv_offset: ArrayLike) -> None:
    """Offsets are integers (ints or integer arrays) and place predicates; with none they would silently do nothing."""
    for name, offset in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if offset is None or (isinstance(offset, numbers.Integral) and not isinstance(offset, bool)):
            continue
        if not isinstance(offset, np.ndarray | jax.Array) or not jnp.issubdtype(offset.dtype, jnp.integer):
            got = f"dtype {offset.dtype} with shape {np.shape(offset)}" if hasattr(offset, "dtype") else repr(offset)
            raise TypeError(f"{name} must be an int or an integer array, got {got} of type {type(offset).__name__}")
    given = q_offset is not None or not (isinstance(kv_offset, numbers.Integral) and kv_offset == 0)
    if given and (mask is None or isinstance(mask, ArrayMask)):
        raise ValueError(
            "q_offset and kv_offset place a jattn.masks predicate; an array mask (or no mask) indexes the (T, S) grid "
            f"itself, got mask={'None' if mask is None else 'an array'} with q_offset={q_offset!r}, kv_offset={kv_offset!r}"
        )


def check_dropout(rate: float, rng: jax.Array | None) -> float:
    """``rate`` as a float in ``[0, 1)`` (a traced one as it is), or an error; a rate above 0 needs ``rng``."""
    rate = check_real("dropout_rate", rate, low=0.0, high=1.0)
    if rate and rng is None:
        raise ValueError(f"dropout_rate={rate} > 0 needs a dropout_rng key")
    return rate


class Operands(NamedTuple):
    """One call's checked operands, resolved once for every path of :func:`jattn.attention`.

    q ``(..., T, D)``, k ``(..., S, D)`` and v ``(..., S, E)`` (None for
    :func:`jattn.attention_weights`) as arrays; the mask as a :class:`~jattn.masks.Mask` (or None);
    ``bias`` a floating array of at least 2 dims ``(..., T|1, S|1)`` (:func:`check_bias`) or None;
    ``scale`` a value (the default ``1/√D`` where the caller gave None); ``q_offset`` and ``kv_offset``
    as the caller gave them (None: the default, the last query on the last key); ``lead`` the call's
    leading shape ``...`` (q, k, v, bias, the mask's arrays and a per-example mask's batch
    broadcast) and ``axis`` the axis of it where q's first axis, a per-example mask's batch, lands.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array | None
    mask: Mask | None
    bias: jax.Array | None
    scale: float | jax.Array
    q_offset: ArrayLike | None
    kv_offset: ArrayLike
    lead: tuple[int, ...]
    axis: int


class Options(NamedTuple):
    """One call's checked arguments besides its :class:`Operands`: what a path of :func:`jattn.attention` reads.

    ``blocks`` the tiles ``(block_q, block_kv)`` (None: the path chooses), ``score_mod`` and ``sinks`` as the
    caller gave them (sinks as an array), ``dropout_rate`` checked with its ``dropout_rng``; ``return_lse`` and
    ``return_max_logit`` what the caller asked for (a path may compute both anyway). ``dropout_seeds (*lead)``:
    each leading row's dropout seed where a caller has them already (the GPU kernel's second order, whose
    reference path must drop its bits), else None.
    """

    blocks: tuple[int, int] | None
    precision: jax.lax.PrecisionLike
    score_mod: Callable[..., jax.Array] | None
    sinks: jax.Array | None
    dropout_rate: float
    dropout_rng: jax.Array | None
    return_lse: bool
    return_max_logit: bool
    dropout_seeds: jax.Array | None = None


class Result(NamedTuple):
    """What every path of :func:`jattn.attention` returns: ``out (..., T, E)``, ``lse (..., T)``, ``max_logit (..., T)``.

    ``lse`` and ``max_logit`` are None where the path does not give them (jax.nn gives no max logit, and an lse
    only when asked; TPU's splash attention neither).
    """

    out: jax.Array
    lse: jax.Array | None
    max_logit: jax.Array | None


def check_operands(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike | None,
    *,
    mask: ArrayLike | Mask | None,
    bias: ArrayLike | None,
    scale: float | ArrayLike | None,
    q_offset: ArrayLike | None,
    kv_offset: ArrayLike,
    offsets: bool = True,
) -> Operands:
    """The :class:`Operands` of a call, checked in this order (the first error raises), and resolved.

    q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` (:func:`check_qkv`), ``scale``,
    ``mask`` and ``bias`` (:func:`as_mask`), then the offsets (:func:`check_offsets`) unless
    ``offsets`` is False (:func:`jattn.choose_implementation` leaves them unchecked), then the
    leading shape (:func:`call_lead`).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), None if v is None else jnp.asarray(v)
    check_qkv(q, k, v)
    check_scale(scale)
    mask, bias = as_mask(mask, bias, q, k)
    if offsets:
        check_offsets(mask, q_offset, kv_offset)
    lead, axis = call_lead(mask, q, k, v, bias)
    scale = default_scale(scale, q.shape[-1])
    return Operands(q, k, v, mask, bias, scale, q_offset, kv_offset, lead, axis)


def call_lead(
    mask: Mask | None, q: Array, k: Array, v: Array | None, bias: Array | None
) -> tuple[tuple[int, ...], int]:
    """``(lead, axis)``: the call's leading shape and the axis of it where q's first axis lands.

    ``lead`` broadcasts q, k, v, bias, the mask's arrays (each checked against q and k) and a
    per-example mask's batch, which lies on ``lead[axis]`` (a per-example mask needs q of rank 3
    or more: a ``ValueError`` says so).
    """
    T, S = q.shape[-2], k.shape[-2]
    lead = broadcast_all(q=q, k=k, v=v, bias=bias)
    if mask is None:
        return lead, len(lead) - (q.ndim - 2)
    check_lengths(mask, T, S)
    leads = [broadcast_all(q=q, k=k, v=v, mask=a.array) for a in array_leaves(mask)]
    batch = example_lead(mask, q.ndim)
    try:
        lead = tuple(np.broadcast_shapes(lead, *leads, batch))
    except ValueError:
        raise ValueError(
            f"leading dimensions do not broadcast: q {q.shape}, k {k.shape}"
            + ("" if v is None else f", v {v.shape}")
            + ("" if bias is None else f", bias {bias.shape}")
            + "".join(f", mask array {a.array.shape}" for a in array_leaves(mask))
            + (f", the mask's batch {batch} (a per-example mask's B on q's first axis)" if batch else "")
        ) from None
    return lead, len(lead) - (q.ndim - 2)
