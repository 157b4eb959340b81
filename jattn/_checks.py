"""Argument checks shared by the public functions and modules of jattn.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong
value or shape) with a message that names the argument, what it got and what is allowed.
Integers are Python or NumPy integers (or 0-d concrete integer arrays), never ``bool``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "broadcast_all",
    "check_block_size",
    "check_bool",
    "check_dtype",
    "check_int",
    "check_qkv",
    "check_real",
    "check_score_mod",
    "check_sinks",
    "int_array",
    "is_traced",
]


def is_traced(x: Any) -> bool:
    """True when ``x`` is a JAX tracer (under ``jit``, ``grad``, ``vmap``...): its value cannot be read."""
    return isinstance(x, jax.core.Tracer)


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    """``value`` as a Python int, raising unless it is an integer in ``[min, max]``.

    Accepts ``int``, NumPy integers and 0-d concrete integer arrays; rejects ``bool`` and floats
    (``1.7`` or ``2.0``: an int is meant) with a TypeError.
    """
    if is_traced(value):
        raise TypeError(f"{name} must be a static int, got a traced value {value} (pass it as a static argument)")
    is_int_array = isinstance(value, np.ndarray | jax.Array) and value.ndim == 0 and value.dtype.kind in "iu"
    if isinstance(value, bool | np.bool_) or not (isinstance(value, numbers.Integral) or is_int_array):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(f"{name} must be {_int_range(min, max)}, got {value}")
    return value


def _int_range(min: int | None, max: int | None) -> str:
    if max is None:
        return {0: "a non-negative int", 1: "a positive int"}.get(min, f"an int >= {min}")
    return f"an int <= {max}" if min is None else f"an int in [{min}, {max}]"


def check_real(
    name: str, value: Any, *, low: float | None = None, high: float | None = None, open_low: bool = False
) -> float:
    """``value`` as a float, raising unless it is a finite real number in ``[low, high)``.

    ``open_low`` excludes ``low`` itself. ``bool`` is rejected (TypeError). A traced value is
    returned as is, unchecked (the caller documents what happens then).
    """
    if is_traced(value):
        return value
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    below = low is not None and (value <= low if open_low else value < low)
    if not math.isfinite(value) or below or (high is not None and value >= high):
        lo = "any" if low is None else f"({low}" if open_low else f"[{low}"
        hi = "inf)" if high is None else f"{high})"
        raise ValueError(f"{name} must be a finite number in {lo}, {hi}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool, raising TypeError unless it is ``bool`` or ``np.bool_``."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_dtype(name: str, dtype: Any, *, optional: bool = False) -> Any:
    """Raises unless ``dtype`` is a floating dtype (or None when ``optional``); returns it unchanged."""
    if dtype is None and optional:
        return dtype
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        allowed = "a floating dtype" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed} (e.g. jnp.float32), got {dtype!r}")
    return dtype


def int_array(name: str, x: Any, *, ndim: int, shape: str) -> jax.Array:
    """``x`` as an integer array of ``ndim`` dimensions (documented as ``shape``), or an error naming it."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape {shape}, got dtype {x.dtype} with shape {x.shape}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    return x


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


def broadcast_all(**arrays: jax.Array | None) -> tuple[int, ...]:
    """The broadcast leading shape ``...`` of the named arrays, or an error naming their shapes."""
    named = {n: x for n, x in arrays.items() if x is not None}
    t, s = named["q"].shape[-2], named["k"].shape[-2]
    for name in ("mask", "bias"):
        x = named.get(name)
        if x is not None and (x.ndim < 2 or x.shape[-2] not in (1, t) or x.shape[-1] not in (1, s)):
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to (..., T, S) = (..., {t}, {s})")
    try:
        return tuple(jnp.broadcast_shapes(*(x.shape[:-2] for x in named.values())))
    except ValueError:
        shapes = ", ".join(f"{n} {x.shape}" for n, x in named.items())
        raise ValueError(f"leading dimensions do not broadcast: {shapes}") from None


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
