"""The checked inputs of :func:`jattn.gated_linear_attention`: shapes, dtypes, values, documents and padding.

Dimension key as in :mod:`jattn._core`; the recurrence is in :mod:`jattn._linear.gated`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._arrays import compute_dtype
from jattn._checks import check_qkv, check_scale
from jattn._masks import per_example_steps
from jattn._scalars import is_traced

__all__ = ["Steps", "poison", "prepare"]


class Steps(NamedTuple):
    """The checked per-step inputs, broadcast to the call's leading shape ``lead`` and computed in ``dtype``.

    ``q, k (*lead, T, D)`` (q scaled), ``v (*lead, T, E)``, ``g (*lead, T)`` or ``gk (*lead, T, D)`` (log decays,
    0 where absent or dropped), ``beta (*lead, T)`` or None (no delta rule), ``reset (*lead, T)`` (a fresh state
    before the step), ``keep (*lead, T)`` (the step's key counts), ``out_dtype`` (v's).
    """

    q: Array
    k: Array
    v: Array
    g: Array | None
    gk: Array | None
    beta: Array | None
    reset: Array
    keep: Array
    out_dtype: jnp.dtype


def prepare(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    g: ArrayLike | None,
    gk: ArrayLike | None,
    beta: ArrayLike | None,
    scale: float | ArrayLike | None,
    segment_ids: ArrayLike | None,
    kv_mask: ArrayLike | None,
    initial_state: ArrayLike | None,
    first: Callable[[Array, tuple[int, ...]], Array] | None = None,
) -> tuple[Steps, Array]:
    """The checked, broadcast :class:`Steps` of a call and its initial state ``(*lead, D, E)``; errors name the argument.

    ``first(segment_ids, lead)``, where given, says whether each sequence's first step starts a document
    (``(*lead,)``; by default none does: the sequence starts here).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-2] != T:
        raise ValueError(
            f"gated linear attention is causal self-attention: q and k need one length T, got {q.shape} and {k.shape}"
        )
    compute = compute_dtype(q.dtype)
    extra = {
        "g": _per_step("g", g, T, floating=True),
        "gk": _per_step("gk", gk, T, floating=True, depth=D),
        "beta": _per_step("beta", beta, T, floating=True),
        "segment_ids": _per_example("segment_ids", segment_ids, q, k, v),
        "kv_mask": _per_example("kv_mask", kv_mask, q, k, v),
    }
    given = {n: jnp.shape(x) for n, x in (("segment_ids", segment_ids), ("kv_mask", kv_mask)) if x is not None}
    lead = _lead(q, k, v, extra, given)
    _check_values(extra)
    scale = _check_scale(scale, D)
    keep = jnp.ones((*lead, T), bool) if extra["kv_mask"] is None else jnp.broadcast_to(extra["kv_mask"], (*lead, T))

    def full(x, *tail):
        return jnp.broadcast_to(x.astype(compute), (*lead, T, *tail))

    dropped = ~keep[..., None]
    qc = full(q, D) * jnp.asarray(scale, compute)
    kc = jnp.where(dropped, 0.0, full(k, D)).astype(compute)
    vc = jnp.where(dropped, 0.0, full(v, E)).astype(compute)
    gc = None if extra["g"] is None else jnp.where(keep, full(extra["g"]), 0.0).astype(compute)
    gkc = None if extra["gk"] is None else jnp.where(dropped, 0.0, full(extra["gk"], D)).astype(compute)
    bc = None if extra["beta"] is None else jnp.where(keep, full(extra["beta"]), 0.0).astype(compute)
    steps = Steps(qc, kc, vc, gc, gkc, bc, _resets(extra["segment_ids"], lead, T, first), keep, v.dtype)
    return steps, _initial_state(initial_state, lead, D, E, compute)


def _per_step(name: str, x: ArrayLike | None, T: int, *, floating: bool, depth: int | None = None) -> Array | None:
    """``x`` as an array of shape ``(..., T)`` (``(..., T, depth)`` with ``depth``), or an error naming it."""
    if x is None:
        return None
    x = jnp.asarray(x)
    want = f"(..., T={T})" if depth is None else f"(..., T={T}, D={depth})"
    tail = 1 if depth is None else 2
    if x.ndim < tail or x.shape[-tail] not in (1, T) or (depth is not None and x.shape[-1] not in (1, depth)):
        raise ValueError(f"{name} must broadcast to {want}, got shape {x.shape}")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating, got {x.dtype} with shape {x.shape}")
    if name == "segment_ids" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be integers {want}, got {x.dtype} with shape {x.shape}")
    if name == "kv_mask" and x.dtype != jnp.bool_:
        raise TypeError(f"kv_mask must be boolean {want}, got {x.dtype} with shape {x.shape}")
    return x


def _per_example(name: str, x: ArrayLike | None, q: Array, k: Array, v: Array) -> Array | None:
    """``segment_ids`` or ``kv_mask`` checked and read as :mod:`jattn.masks` reads per-example arrays (batch first)."""
    x = _per_step(name, x, q.shape[-2], floating=False)
    if x is None:
        return None
    try:
        lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        return x  # q, k, v's own error comes next (_lead)
    return per_example_steps(name, x, tuple(lead))


def _lead(
    q: Array, k: Array, v: Array, extra: dict[str, Array | None], given: dict[str, tuple[int, ...]]
) -> tuple[int, ...]:
    """The broadcast leading shape of q, k, v and the per-step arrays, or an error naming every shape.

    ``given``: the shapes the per-example arrays were passed with (``extra`` holds them as read).
    """
    leads = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    for name, x in extra.items():
        if x is not None:
            leads.append(x.shape[: -2 if name == "gk" else -1])
    try:
        return tuple(jnp.broadcast_shapes(*leads))
    except ValueError:
        got = ", ".join(
            f"{n} {given.get(n, x.shape)}" for n, x in {"q": q, "k": k, "v": v, **extra}.items() if x is not None
        )
        hint = "".join(
            f"; {n} {given[n]} is read as {extra[n].shape} ((B, T) per example, batch first as jattn.masks reads "
            f"it; one axis per leading axis as it is): for one per head pass e.g. (1, N, T), {n}[None], for q "
            f"(B, N, T, D)"
            for n in given
            if len(given[n]) > 1
        )
        raise ValueError(f"leading dimensions (batch, heads) do not broadcast: {got}{hint}") from None


def _check_values(extra: dict[str, Array | None]) -> None:
    """Concrete decays of kept steps must be finite and <= 0, beta in [0, 1]; traced ones are poisoned (:func:`poison`).

    A step that ``kv_mask`` drops is not read (under ``jit`` neither: :func:`prepare` zeroes its gates), so its
    values are not checked; with a traced ``kv_mask`` which steps are kept is known at run time only.
    """
    keep = None if extra["kv_mask"] is None else _concrete(extra["kv_mask"])
    if extra["kv_mask"] is not None and keep is None:
        return
    for name in ("g", "gk", "beta"):
        x = _concrete(extra[name])
        if x is None:
            continue
        if keep is not None:
            x, kept = np.broadcast_arrays(x, keep[..., None] if name == "gk" else keep)
            x = x[kept]
        if x.size and name == "beta" and not np.all((x >= 0) & (x <= 1)):
            raise ValueError(f"beta must lie in [0, 1] (e.g. a sigmoid), got values in [{np.min(x)}, {np.max(x)}]")
        if x.size and name != "beta" and not np.all(np.isfinite(x) & (x <= 0)):
            raise ValueError(
                f"{name} is a log decay: finite and <= 0 (a decay exp({name}) in (0, 1]); got values in "
                f"[{np.min(x)}, {np.max(x)}] (segment_ids restart the state)"
            )


def _check_scale(scale: float | ArrayLike | None, D: int) -> float | Array:
    """``scale`` (default ``1/sqrt(D)``): a real number or 0-d float array (:func:`jattn._checks.check_scale`), finite."""
    if scale is None:
        return 1.0 / D**0.5
    check_scale(scale)
    if not is_traced(scale) and not np.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number, got {float(scale)}")
    return scale


def _concrete(x: Array | None) -> np.ndarray | None:
    """``x`` as NumPy where its values are known (not traced) and it has any, else None."""
    if x is None or is_traced(x) or not x.size:
        return None
    return np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)


def _resets(segment_ids: Array | None, lead: tuple[int, ...], T: int, first: Callable | None) -> Array:
    """``(*lead, T)``: True where a step starts a new document (its id differs from the previous step's)."""
    if segment_ids is None:
        return jnp.zeros((*lead, T), bool)
    ids = jnp.broadcast_to(segment_ids, (*lead, T))
    start = jnp.zeros((*lead, 1), bool) if first is None else first(segment_ids, lead)[..., None]
    return jnp.concatenate([start, ids[..., 1:] != ids[..., :-1]], axis=-1)


def _initial_state(state: ArrayLike | None, lead: tuple[int, ...], D: int, E: int, compute) -> Array:
    if state is None:
        return jnp.zeros((*lead, D, E), compute)
    state = jnp.asarray(state)
    if not jnp.issubdtype(state.dtype, jnp.floating):
        raise TypeError(f"initial_state must be floating (..., D={D}, E={E}), got {state.dtype}")
    try:
        fits = state.shape[-2:] == (D, E) and jnp.broadcast_shapes(state.shape[:-2], lead) == lead
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"initial_state must have shape (..., D={D}, E={E}) broadcasting to {lead}, got {state.shape}")
    return jnp.broadcast_to(state.astype(compute), (*lead, D, E))


def poison(steps: Steps, out: Array, state: Array, axis_name: str | None = None) -> tuple[Array, Array]:
    """NaN outputs and state wherever traced decays of kept steps are above 0 or not finite, or beta is outside [0, 1].

    A dropped step's gates were zeroed by :func:`prepare`: they are not read, as eagerly (:func:`_check_values`).

    With ``axis_name`` (the sequence split over it) a bad step on any device poisons the whole sequence.
    """
    bad = jnp.zeros(out.shape[:-2], bool)
    if steps.g is not None:
        bad |= jnp.any(~(jnp.isfinite(steps.g) & (steps.g <= 0)), axis=-1)
    if steps.gk is not None:
        bad |= jnp.any(~(jnp.isfinite(steps.gk) & (steps.gk <= 0)), axis=(-2, -1))
    if steps.beta is not None:
        bad |= jnp.any(~((steps.beta >= 0) & (steps.beta <= 1)), axis=-1)
    if axis_name is not None:
        bad = jax.lax.pmax(bad.astype(jnp.int32), axis_name) > 0
    nan = jnp.asarray(jnp.nan, out.dtype)
    return jnp.where(bad[..., None, None], nan, out), jnp.where(bad[..., None, None], nan, state)
