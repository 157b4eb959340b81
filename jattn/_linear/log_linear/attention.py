r"""Log-linear attention (Guo, Yang et al. 2025): a Fenwick-tree set of states per step over the scalar-gate kinds.

Dimension key as in :mod:`jattn._core`; L: levels. The recurrence of :mod:`jattn._linear.gated` with a decay per
step (``g``: Mamba-2's SSD form; with ``beta``: Gated DeltaNet) writes every key ``s`` into one state; here the
keys a query step ``t`` sees are split into O(log T) buckets by a Fenwick tree of the prefix ``0 .. t``: key ``s``
lies at **level** ``ℓ(t, s) = bit_length(t XOR s)`` (0 for ``s = t`` itself, 1 for ``s = t - 1`` when t is odd,
and level ℓ >= 1 holds the ``2^(ℓ-1)`` keys of the block just before t's at that scale). Each level has its own
state and a weight ``λ_t^(ℓ)`` per query step (``level_weights``, data-dependent, from the input)::

    S_t^(ℓ) = Σ_{s <= t, ℓ(t, s) = ℓ}  A_t ⋯ A_{s+1} k_s w_sᵀ      A_r = a_r (I - β_r k_r k_rᵀ),  w_s = β_s v_s
    o_t     = scale · Σ_ℓ λ_t^(ℓ) S_t^(ℓ)ᵀ q_t

(without the delta rule ``A_r = a_r`` and ``w_s = v_s``; ``a_r = exp(g_r)``). With every ``λ = 1`` the levels
add up to the one state of :func:`jattn.gated_linear_attention`: the same outputs. Positions are the steps'
indices in the sequence (from ``start`` in the recurrent form): a step that ``kv_mask`` drops keeps its index
(it writes nothing and decays nothing, as in the base kinds), and ``segment_ids`` zero every level where the id
changes but do not restart the positions (a document starting at a position that is not a multiple of a large
power of 2 is bucketed as in the whole sequence, not as it would be alone).

**Chunkwise form** (``mode='chunk'``, chunks of C = a power of 2 steps, aligned to position 0): two steps in one
chunk lie at a level below ``log2(C) + 1``, which depends on their places in the chunk only: a dense ``(C, C)``
matrix per chunk (the base kind's ``Γ ∘ q kᵀ`` times the delta rule's UT transform, weighted by ``λ_t`` at the
level of each pair). Steps in chunks ``m' < m`` lie at level ``log2(C) + bit_length(m XOR m')``: a scan over the
chunks carries one state per such level, merges them as a Fenwick tree over chunks, and each query reads them
all through one ``(C, L·D) @ (L·D, E)`` product. Time O(T log T) (``T · D · E`` per level above a chunk);
memory O(T) for everything but the scan's carry, which the rematerialised backward keeps once per chunk:
``(T / C) · log2(T / C)`` states of ``D × E``. Every exponent is a difference ``<= 0``, as in the base kinds.
It continues a sequence as the recurrent form does, from a ``start`` on the chunks (a multiple of C): the
incoming level states, merged to ``start``, hold only levels above a chunk and begin the scan's carry; the states
returned (relative to the last kept step) are that step's chunk's keys split by their level from it, and the
carry taken through that chunk.

**Recurrent form** (``mode='recurrent'``, decoding): ``L`` states per sequence; at a kept step at position
``p`` after the last kept one at ``p0`` the levels ``0 .. h-1`` merge into level ``h = bit_length(p0 XOR p)``
(relative to p their keys all lie there), every level takes the step's transition and level 0 becomes its write.

**Sequence parallel** (``axis_name``, :mod:`jattn._linear.log_linear.sequence_parallel`): each shard's effect on the level
states is affine, ``S ↦ merge(M S) + H`` with one ``D × D`` transition ``M`` for every level; the shards' maps
are gathered and composed, and each shard runs from its incoming level states at its own ``start``.

**Why a separate function** and not a ``level_weights`` argument of :func:`jattn.gated_linear_attention`: its
state is not one ``(D, E)`` matrix but ``L`` of them tied to a position (``initial_state (..., L, D, E)``
relative to ``start - 1``, returned relative to the last kept step), a contract the base call's
``initial_state`` / ``return_state`` do not hold, and its sequence-parallel maps carry that position (a merge of
levels besides the transition); it takes the scalar-gate kinds only (the paper's Mamba-2 and Gated DeltaNet; no
per-feature ``gk``); and its chunk size must be a power of 2, with chunks aligned to the positions. It reuses the
base kinds' checked inputs (:mod:`jattn._linear.steps`), their chunk arithmetic
(:mod:`jattn._linear.chunking`) and their shard-boundary documents (:mod:`jattn._linear.sequence_parallel`), so
they cannot drift apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._linear.log_linear.chunk import chunked
from jattn._linear.log_linear.levels import bit_length, chunk_length, levels_needed, overflows, positions
from jattn._linear.log_linear.recurrent import recurrent
from jattn._linear.log_linear.sequence_parallel import run_sharded
from jattn._linear.sequence_parallel import first_resets
from jattn._linear.steps import Steps, poison, prepare
from jattn._scalars import check_bool, check_int, is_traced

__all__ = ["log_linear_attention"]

MODES = ("chunk", "recurrent")


def log_linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    level_weights: ArrayLike,
    g: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    kv_mask: ArrayLike | None = None,
    initial_state: ArrayLike | None = None,
    start: int | ArrayLike = 0,
    return_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    axis_name: str | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Array | tuple[Array, Array]:
    """Causal log-linear attention of q, k ``(..., T, D)`` and v ``(..., T, E)`` -> ``(..., T, E)``.

    The recurrence and both forms are in the module docstring (:mod:`jattn._linear.log_linear.attention`).

    Args:
      q, k, v: one floating dtype; leading dimensions broadcast (batch, heads).
      level_weights: ``λ (..., T, L)``, floating, the weight of each level for each query step, broadcasting to
        the call's leading shape (it does not widen it). L at least ``bit_length(start + T - 1) + 1`` (the whole
        sequence's T with ``axis_name``); at position p the levels above ``bit_length(p)``, where no key can
        be, are not read (NaN or inf there changes nothing), in either form.
      g: log decay per step, ``<= 0``, broadcasting to ``(..., T)`` (Mamba-2's SSD form); None: no decay.
      beta: the delta rule's write strength in ``[0, 1]``, broadcasting to ``(..., T)`` (with ``g``: Gated
        DeltaNet); needs L2-normalised keys, as in :func:`jattn.gated_linear_attention`.
      scale: multiplies q (default ``1/sqrt(D)``).
      segment_ids, kv_mask: as :func:`jattn.gated_linear_attention` (every level restarts from zero where the id
        changes; a dropped step keeps its position, writes nothing and outputs 0).
      initial_state: ``(..., L, D, E)``, the level states relative to position ``start - 1`` (default zeros).
        At ``start = 0`` there is no such position: it is not read.
      start: the position of the first step: an int or an integer array broadcasting to the leading shape, e.g.
        ``(B, 1, 1)`` per example for q ``(B, N, 1, T, D)``. ``mode='chunk'`` needs multiples of ``chunk_size``
        (ValueError where known; traced, NaN outputs elsewhere); ``mode='recurrent'`` takes any.
      return_state: also return the level states after the last kept step, relative to it, ``(..., L, D, E)``
        (with trailing padding, continue at ``start`` = that step's position + 1); both forms give the same.
      mode: ``'chunk'`` (training) or ``'recurrent'`` (step by step, decoding).
      chunk_size: steps of a chunk, a power of 2 (``mode='chunk'``; T need not be a multiple).
      axis_name: inside ``jax.shard_map`` with the sequence split over this mesh axis (device i holds steps
        ``[i T, (i + 1) T)`` from ``start``): the level states pass from shard to shard
        (:mod:`jattn._linear.log_linear.sequence_parallel`); ``initial_state`` is the first shard's, and the states
        returned are the sequence's, on every device. ``mode='chunk'`` needs T (a shard's) a multiple of the
        chunk.
      precision: of the products (``jax.lax.Precision``).

    Returns:
      ``out (..., T, E)`` in v's dtype, computed in float32 (float64 for float64 inputs); with ``return_state`` also
      the level states. Bad gates raise or poison as in :func:`jattn.gated_linear_attention`; a traced ``start``
      whose positions need more than L levels (or, in the chunk form, off the chunks) makes that sequence's
      outputs and state NaN.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    chunk_size = check_int("chunk_size", chunk_size, min=1)
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of 2 (chunks aligned to the Fenwick tree), got {chunk_size}")
    return_state = check_bool("return_state", return_state)
    first = None if axis_name is None else (lambda ids, lead: first_resets(ids, lead, axis_name))
    steps, _ = prepare(q, k, v, g=g, gk=None, beta=beta, scale=scale, segment_ids=segment_ids, kv_mask=kv_mask,
                       initial_state=None, first=first)  # fmt: skip
    lead, T = steps.keep.shape[:-1], steps.keep.shape[-1]
    shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    if mode == "chunk":
        _check_aligned(start, chunk_size, T, shards)
    start_ = _start(start, lead)
    lam = _level_weights(level_weights, lead, T, _last_position(start, T * shards), steps.q.dtype, shards)
    lam = _reached_only(lam, start_, axis_name)
    plain = mode == "chunk" and initial_state is None and not return_state and _is_zero(start) and axis_name is None
    L = levels_needed(T) if plain else lam.shape[-1]  # from 0 with nothing out: the levels T reaches
    state = _initial_levels(initial_state, lead, L, steps.q.shape[-1], steps.v.shape[-1], steps.q.dtype)
    state = jnp.where((start_ > 0)[..., None, None, None], state, 0.0)  # no position before 0: not read

    def form(steps: Steps, lam: Array, state: Array, start: Array) -> tuple[Array, Array, Array]:
        if mode == "chunk":
            return chunked(steps, lam, state, start, chunk_size, precision)
        return recurrent(steps, lam, state, start, precision)

    if axis_name is None:
        out, state, _ = form(steps, lam, state, start_)
    else:
        out, state = run_sharded(steps, lam, state, start_, axis_name=axis_name, form=form)
    return _finish(steps, out, state, start_, mode, chunk_size, axis_name, return_state)


def _finish(steps: Steps, out: Array, state: Array, start: Array, mode, chunk_size, axis_name, return_state):
    """The call's result: outputs 0 at dropped steps, in v's dtype, with the level states where asked.

    NaN where gates are bad, positions past the levels or (traced) a chunk-mode ``start`` off the chunks,
    anywhere in the sequence.
    """
    *lead, T, _ = out.shape
    L, D, E = state.shape[-3:]
    here = start if axis_name is None else start + jax.lax.axis_index(axis_name) * T
    bad = overflows(steps.keep, here, L)
    if mode == "chunk":
        bad |= here % chunk_length(chunk_size, T) != 0
    if axis_name is not None:
        bad = jax.lax.pmax(bad.astype(jnp.int32), axis_name) > 0
    out = jnp.where(steps.keep[..., None], out, 0.0)
    out, flat = poison(steps, out, state.reshape(*lead, L * D, E), axis_name)
    nan = jnp.asarray(jnp.nan, out.dtype)
    out = jnp.where(bad[..., None, None], nan, out).astype(steps.out_dtype)
    state = jnp.where(bad[..., None, None, None], nan, flat.reshape(*lead, L, D, E))
    return (out, state) if return_state else out


def _check_aligned(start: int | ArrayLike, chunk_size: int, T: int, shards: int) -> None:
    """The chunk form's ``start`` (where known) and shard length must be multiples of the chunk, or an error."""
    if not is_traced(start) and np.any(np.asarray(start) % chunk_size != 0):
        raise ValueError(
            f"mode='chunk' needs start to be a multiple of chunk_size={chunk_size} (chunks aligned to the Fenwick "
            f"tree), got start={np.asarray(start).tolist()}: pass a chunk_size dividing it, or mode='recurrent' "
            "(any start)"
        )
    if shards > 1 and T % chunk_length(chunk_size, T):
        raise ValueError(
            f"mode='chunk' with axis_name needs the shard length T={T} to be a multiple of the chunk "
            f"(chunk_size={chunk_size}) so every shard starts on a chunk: pass a chunk_size dividing it, or "
            "mode='recurrent'"
        )


def _is_zero(start: int | ArrayLike) -> bool:
    return not is_traced(start) and bool(np.all(np.asarray(start) == 0))


def _start(start: int | ArrayLike, lead: tuple[int, ...]) -> Array:
    """``start`` as int32 ``(*lead,)``, or an error naming it."""
    x = jnp.asarray(start)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"start must be an integer position or array of them, got {x.dtype} with shape {x.shape}")
    try:
        fits = jnp.broadcast_shapes(x.shape, lead) == lead
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"start must broadcast to the leading shape {lead}, got shape {x.shape}")
    if not is_traced(x) and bool(np.any(np.asarray(x) < 0)):
        raise ValueError(f"start must be >= 0, got values down to {int(np.min(np.asarray(x)))}")
    return jnp.broadcast_to(x.astype(jnp.int32), lead)


def _last_position(start: int | ArrayLike, T: int) -> int:
    """The largest position the call reaches where ``start`` is known (else as from 0)."""
    return (0 if is_traced(start) else int(np.max(np.asarray(start), initial=0))) + T


def _level_weights(x: ArrayLike, lead: tuple[int, ...], T: int, end: int, dtype, shards: int = 1) -> Array:
    """``level_weights`` as ``(*lead, T, L)`` in ``dtype``, or an error naming its shape.

    ``T`` is the shard's length under ``axis_name`` (``shards`` > 1), ``end`` the last position of the whole sequence.
    """
    x = jnp.asarray(x)
    need = levels_needed(end)
    t = f"T={T}" if shards == 1 else f"T={T}: this shard's steps of the sequence's {T * shards}"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"level_weights must be floating (..., {t}, L), got {x.dtype} with shape {x.shape}")
    if x.ndim < 2 or x.shape[-2] not in (1, T) or x.shape[-1] < need:
        raise ValueError(
            f"level_weights must have shape (..., {t}, L) with L >= {need} levels (bit_length of the last "
            f"position {end - 1} of the whole sequence, plus 1), got {x.shape}"
        )
    try:
        fits = jnp.broadcast_shapes(x.shape[:-2], lead) == lead
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"level_weights {x.shape} must broadcast to the leading shape {lead} of q, k, v and gates")
    return jnp.broadcast_to(x.astype(dtype), (*lead, T, x.shape[-1]))


def _reached_only(lam: Array, start: Array, axis_name: str | None) -> Array:
    """``lam (*lead, T, L)`` with the levels no key can be at replaced by 0 (so NaN or inf there are not read).

    At position p a key at s < p lies at level ``bit_length(s ^ p) <= bit_length(p)`` (level 0 is p itself):
    the levels above ``bit_length(p)`` are empty at p in both forms, whatever the weights say.
    """
    T, L = lam.shape[-2:]
    here = start if axis_name is None else start + jax.lax.axis_index(axis_name) * T
    bits = bit_length(positions(here, T))  # (*lead, T)
    return jnp.where(jnp.arange(L, dtype=jnp.int32).reshape((1,) * bits.ndim + (L,)) <= bits[..., None], lam, 0.0)


def _initial_levels(x: ArrayLike | None, lead: tuple[int, ...], L: int, D: int, E: int, dtype) -> Array:
    if x is None:
        return jnp.zeros((*lead, L, D, E), dtype)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"initial_state must be floating (..., L={L}, D={D}, E={E}), got {x.dtype}")
    try:
        fits = x.shape[-3:] == (L, D, E) and jnp.broadcast_shapes(x.shape[:-3], lead) == lead
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"initial_state must have shape (..., L={L}, D={D}, E={E}) broadcasting to {lead}, got {x.shape}"
        )
    return jnp.broadcast_to(x.astype(dtype), (*lead, L, D, E))
