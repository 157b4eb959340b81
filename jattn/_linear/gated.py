r"""Gated linear attention and the delta rule: the linear-attention family people train, behind one call.

Dimension key as in :mod:`jattn._core` (no feature map here: F = D). Each query row ``t`` reads a
state ``S_t (D, E)`` that every key updates in turn, per leading index (batch, head)::

    decay       S_t = a_t ⊙ S_{t-1} + k_t v_tᵀ
    delta rule  S_t = (I - β_t k_t k_tᵀ) (a_t ⊙ S_{t-1}) + β_t k_t v_tᵀ
    low rank    S_t = (diag(w_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ       (given ``a``, ``b``)
    output      o_t = scale · S_tᵀ q_t

with ``a_t = exp(g_t)`` (a scalar per step and head: ``g (..., T)``; retention is a constant per
head, i.e. ``g`` of shape ``(N, 1)``; Mamba-2's SSD form one per step) or ``exp(gk_t)`` per key
feature (``gk (..., T, D)``, gated linear attention: ``a_t ⊙ S`` scales row ``f`` of S by
``a_{t,f}``). No decay at all is plain (unnormalised) linear attention; ``beta`` switches the delta
rule on (DeltaNet; with ``g``, Gated DeltaNet; with ``gk``, Kimi Delta Attention, KDA, of Kimi Linear:
the decay first, then the delta step, as the paper and flash-linear-attention's ``kda`` write it; with a
scalar decay the order does not matter, per feature it does). The names follow flash-linear-attention's
(``g``, ``gk``, ``beta``, ``scale``, ``initial_state``); its ``(B, T, H, D)`` layout is jattn's
``(B, H, T, D)``.

**Diagonal plus low rank** (``a`` and ``b``, RWKV-7's transition; flash-linear-attention's ``dplr`` /
``generalized_delta_rule`` with its names): ``w_t = exp(gk_t)`` per key feature (``g`` adds, none: ``w = 1``),
``a_t (D,)`` reads the state and ``b_t (D,)`` writes what it read, both from ``S_{t-1}``, beside the decay.
It holds the others: GLA (``a = b = 0``); DeltaNet (``a = k``, ``b = -β k``, v replaced by ``β v``); Gated
DeltaNet (as DeltaNet with ``a = exp(g) k`` and the decay ``g``); KDA (as DeltaNet with ``a = exp(gk) ⊙ k`` and
the decay ``gk``). Its chunkwise and recurrent forms are in
:mod:`jattn._linear.dplr.chunk`. Whether the transition is contracting is the caller's to ensure, as the
delta rule's short keys are: RWKV-7's ``a = -κ̂``, ``b = κ̂ ⊙ α`` with ``‖κ̂‖ = 1`` and ``α`` in [0, 1] has
eigenvalues in [0, 1] at ``w = 1`` (``1 - Σ α_f κ̂_f²`` and 1), and with one ``α`` for all features it is
symmetric with eigenvalues in ``[min w - α, max w]``: never expanding. Not checked (it depends on every step).

**The delta rule needs short keys.** A step scales the state's component along ``k_t`` by
``a_t (1 - β_t ‖k_t‖²)``: with ``‖k_t‖ <= 1`` (and β in [0, 1]) it never grows, but where
``β_t ‖k_t‖² > 2`` it grows by that factor's size each step, and after some tens of steps the state
overflows and outputs and state turn inf and NaN, with no error (the two forms overflow at different
steps). Keys straight from a projection are that long (``‖k‖ ≈ sqrt(D)`` for unit-variance
features). The fix: L2-normalise k over D (``k / ‖k‖``; the modules' delta kinds apply SiLU and an
L2 norm), as the delta rule's papers do. It is not checked: whether a state overflows depends on the
whole sequence, and NaN for every such input would change results that are finite.

**Chunkwise form** (``mode='chunk'``): within a chunk of ``C`` steps, with ``b_t`` the running sum
of the log decays from the chunk's start and ``Γ_ts = exp(b_t - b_s)`` for ``s <= t``, the writes
``δ_s`` (``v_s`` without the delta rule) give ``o_t = exp(b_t) S_0ᵀ q_t + Σ_{s<=t} Γ_ts (q_t·k_s) δ_s``
and the chunk's last state ``S_C = exp(b_C) S_0 + Σ_s Γ_Cs k_s δ_sᵀ``. The delta rule's writes solve
a unit lower-triangular system (the UT transform of the DeltaNet paper, with decays):
``(I + A) Δ = diag(β) (V - diag(exp(b)) K S_0)``, ``A_ts = β_t Γ_ts (k_t·k_s)`` for ``s < t``. With a
decay per key feature (GLA, KDA) ``b_t`` is a vector (D,) and ``Γ_ts (q_t·k_s)`` becomes
``Σ_f q_tf exp(b_tf - b_sf) k_sf`` (likewise in ``A``; ``exp(b)`` scales K and q feature by feature): GLA
keeps those exponents per pair and feature; KDA forms the pair sums as a binary tree of matmuls: the
chunk splits into blocks of 2h steps (h = 1, 2, ..., C/2) whose upper h queries meet the lower h keys at
the running sum r of the lower half's last step, ``(b_t - r) + (r - b_s)``, each part ``<= 0``
(:mod:`jattn._linear.kda.pair_sums`). Every
exponent is a difference ``b_t - b_s <= 0`` (or a sum of such): nothing overflows, at any length. The running sums are kept
to twice the working precision (``hi + lo``: the cumulative sum and what its additions rounded away), so
each difference is exact to its own rounding, whatever came before it in the chunk: after one step of log
decay -1e7 the later steps' small decays do not cancel away (as in a plain running sum, where
``-inf - (-inf)`` is even NaN). The chunk form is as exact as the recurrent one for any finite decay.
Chunks run in a
``lax.scan`` whose body is rematerialised, so the backward keeps one state per chunk: O(T) memory.

**Recurrent form** (``mode='recurrent'``): the recurrence above one step at a time (decoding; the
reference the chunkwise form is checked against). Its backward keeps a state per step.

**Documents**: ``segment_ids`` start a fresh (zero) state wherever the id changes from one step to the
next (packed documents); ``kv_mask`` False drops a step (its key, value and gates are not read: it neither
writes nor decays the state; its output is 0). ``initial_state (..., D, E)`` is the state before the
first step; the state after the last is returned with ``return_state=True``.

**Which leading index an array belongs to.** The gates ``g``, ``gk``, ``beta`` broadcast as NumPy
does, from the right: they are per head, so ``g (N, 1)`` is a constant per head. ``segment_ids`` and
``kv_mask`` are per-example arrays and read as :mod:`jattn.masks` reads them: ``(T,)`` is every sequence;
``(B, T)`` is per example, batch first (on the first leading axis), shared by the heads, as
``masks.segment_ids(ids)`` reads the same array, whatever B and N are; an array with one axis per
leading axis of q, k, v (``(B, N, T)``, ``(B, 1, T)``) is per leading index. With fewer axes than that
but more than one (``(B, K, T)`` for q ``(B, K, G, T, D)``) which axes it spans is ambiguous: a
ValueError says how to write it. One per head is ``(1, N, T)`` (``ids[None]``).
"""

from __future__ import annotations

import functools

import jax
from jax import Array
from jax.typing import ArrayLike

from jattn._linear.deltaproduct import interleave, last_substeps
from jattn._linear.dplr.chunk import chunked as dplr_chunked
from jattn._linear.dplr.recurrent import recurrent as dplr_recurrent
from jattn._linear.dplr.steps import prepare_low_rank
from jattn._linear.forms import Forms, run
from jattn._linear.gated_delta_rule.chunk import chunked as gated_chunked
from jattn._linear.gated_delta_rule.recurrent import recurrent as gated_recurrent
from jattn._linear.sequence_parallel import first_resets, run_sharded
from jattn._linear.steps import poison, prepare
from jattn._scalars import check_bool, check_int

__all__ = ["MODES", "gated_linear_attention"]

MODES = ("chunk", "recurrent")
GATED_DELTA_RULE = Forms(gated_recurrent, gated_chunked)  # every gate: decays, the delta rule, KDA
DPLR = Forms(dplr_recurrent, dplr_chunked)  # the diagonal-plus-low-rank transition (a, b)


def gated_linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    g: ArrayLike | None = None,
    gk: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    num_householder: int = 1,
    a: ArrayLike | None = None,
    b: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    kv_mask: ArrayLike | None = None,
    initial_state: ArrayLike | None = None,
    return_state: bool = False,
    mode: str = "chunk",
    chunk_size: int | None = None,
    axis_name: str | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> Array | tuple[Array, Array]:
    """Causal gated linear attention / delta rule of q, k ``(..., T, D)`` and v ``(..., T, E)`` -> ``(..., T, E)``.

    The recurrence and both forms are in the module docstring (:mod:`jattn._linear.gated`).

    Args:
      q, k, v: one floating dtype; leading dimensions broadcast (batch, heads).
      g: log decay per step, ``<= 0``, broadcasting (as NumPy, from the right) to ``(..., T)``: a constant per
        head (retention, e.g. shape ``(N, 1)``) or one per step (Mamba-2 / SSD style, Gated DeltaNet).
      gk: log decay per step and key feature, ``<= 0``, broadcasting to ``(..., T, D)`` (gated linear
        attention, GLA; with ``beta``, Kimi Delta Attention, KDA: the decay, then the delta step). With ``g``
        too, the two add. With ``a``, ``b``: the diagonal's.
      beta: the delta rule's write strength in ``[0, 1]`` (a sigmoid's range), broadcasting to ``(..., T)``;
        None: no delta rule. It needs L2-normalised keys: with ``β ‖k‖² > 2`` the state grows each step and
        overflows to inf and NaN, unchecked (module docstring).
      num_householder: ``n_h``, the delta steps a token (DeltaProduct, :mod:`jattn._linear.deltaproduct`): k
        ``(..., T·n_h, D)``, v ``(..., T·n_h, E)`` and ``beta (..., T·n_h)`` hold each token's ``n_h`` keys,
        values and betas one after the other (token ``t``'s step ``j`` at ``t·n_h + j``), q, ``g``,
        ``segment_ids`` and ``kv_mask`` one per token ``(..., T)``; ``g`` decays once a token, before its first
        step, and q reads after its last. Not with ``gk``; needs ``beta``. This is flash-linear-attention's
        layout (``chunk_gated_delta_product(..., num_householder=n_h)``, k ``(B, T·n_h, H, D)``): weights and
        activations port as they are, and the sub-steps are the sequence the delta rule runs, with no new axis
        for q, k, v to disagree on. The default 1 is the delta rule itself.
      a, b: the low-rank part of a diagonal-plus-low-rank transition (RWKV-7), broadcasting to ``(..., T, D)``,
        together: every step is ``S_t = (diag(exp(gk_t)) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ`` (module docstring),
        ``gk`` and ``g`` (adding) the diagonal's log decays, default 0. Not with ``beta`` (the delta rule is
        ``a = k``, ``b = -beta k`` with ``beta v``). Their leading axes broadcast with q, k, v's. Contractivity
        is not checked (module docstring).
      scale: multiplies q: a finite real number or a 0-d float array (a traced one is not checked); default
        ``1/sqrt(D)``.
      segment_ids: integer ``(T,)``, ``(B, T)`` (per example: batch first, shared by the heads, as
        :func:`jattn.masks.segment_ids`) or one axis per leading axis of q, k, v (module docstring); the state
        restarts from zero wherever the id changes.
      kv_mask: boolean, shaped as ``segment_ids``; False drops the step (padding): its output is 0, the state
        passes it by, its key, value and gates are not read (any values, NaN included, are fine there).
      initial_state: ``(..., D, E)``, the state before the first step (default zeros).
      return_state: also return the state after the last step, ``(..., D, E)`` in the compute dtype.
      mode: ``'chunk'`` (training; O(T) memory forward and backward) or ``'recurrent'`` (step by step).
      chunk_size: steps of a chunk (``mode='chunk'``; sub-steps with ``num_householder``); T need not be a
        multiple. None: 8 with ``a``, ``b``, 16 with ``gk`` (their decays inside a chunk cost ``C² D``), else 32:
        the fastest in the docs' measurements.
      axis_name: inside ``jax.shard_map`` with the sequence split over this mesh axis (device i of the axis
        holds the i-th block of steps): the state passes from shard to shard (:mod:`jattn._linear.sequence_parallel`);
        ``initial_state`` is the first shard's, and the state returned is the last step's, on every device.
      precision: of the products (``jax.lax.Precision``).

    Returns:
      ``out (..., T, E)`` in v's dtype, computed in float32 (float64 for float64 inputs); with ``return_state``
      also the final state. Decays above 0 or not finite, or ``beta`` outside [0, 1], at a step that is kept
      (``kv_mask``), raise ValueError where their values and the mask's can be read; traced (under ``jit``,
      ``grad``, ``vmap``), they make the outputs and state NaN for the leading indices they occur in. At a
      dropped step they are not read, eager or traced.
    """
    mode = _check_mode(mode)
    low_rank = a is not None or b is not None
    if chunk_size is None:
        chunk_size = 8 if low_rank else 16 if gk is not None else 32
    chunk_size = check_int("chunk_size", chunk_size, min=1)
    return_state = check_bool("return_state", return_state)
    num_householder = check_int("num_householder", num_householder, min=1)
    if num_householder > 1:
        q, g, segment_ids, kv_mask = interleave(q, k, v, num_householder=num_householder, g=g, gk=gk, beta=beta,
                                                segment_ids=segment_ids, kv_mask=kv_mask)  # fmt: skip
    first = None if axis_name is None else (lambda ids, lead: first_resets(ids, lead, axis_name))
    rest = dict(scale=scale, segment_ids=segment_ids, kv_mask=kv_mask, initial_state=initial_state, first=first)
    if low_rank:
        steps, prepared, state = prepare_low_rank(q, k, v, a=a, b=b, g=g, gk=gk, beta=beta, **rest)
        family = DPLR
    else:
        steps, state = prepare(q, k, v, g=g, gk=gk, beta=beta, **rest)
        prepared, family = steps, GATED_DELTA_RULE
    how = dict(mode=mode, chunk_size=chunk_size, precision=precision)
    if axis_name is None:
        out, state = run(family, prepared, state, **how)
    else:
        out, state = run_sharded(prepared, state, axis_name=axis_name, run=functools.partial(run, family), **how)
    out, state = poison(steps, out, state, axis_name)
    out = last_substeps(out, num_householder).astype(steps.out_dtype)
    return (out, state) if return_state else out


def _check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return str(mode)
