"""The scalar checks: ints, bools, reals, floating dtypes and integer arrays; this module imports nothing of jattn.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong
value or shape) with a message that names the argument, what it got and what is allowed.
Integers are Python or NumPy integers (or 0-d concrete integer arrays), never ``bool``. The
masks check their arguments here; :mod:`jattn._checks`, which builds on the masks, too.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_bool",
    "check_dtype",
    "check_int",
    "check_real",
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
