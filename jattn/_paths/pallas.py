"""``implementation='pallas'``: jattn's arguments translated to a fused Pallas kernel.

On GPU the kernel is JAX's own flash attention,
:func:`jax.experimental.pallas.ops.gpu.attention.mha` (layout ``(B, T, N, D)``, one head dim for
q, k and v, causal top-left, lengths multiples of its blocks). On CPU the same kernel runs in
Pallas *interpret* mode: exact, slow, and how jattn tests the translation (there is no GPU in CI).
On TPU it is splash attention (:func:`jattn._paths.splash.splash_attention`), also tested in interpret mode on CPU.
Which kernel: :func:`kernel_platform`.

The GPU translation (dimension key in :mod:`jattn._core`):

* Leading dimensions ``...`` are broadcast (grouped-query kv heads are repeated) and flattened to
  the kernel's batch ``B`` with one head: q ``(B, L, 1, H)``, k and v ``(B, L, 1, H)``.
* Lengths are padded to one ``L``, a multiple of the blocks (the kernel's backward wants as
  many query blocks as key blocks); the head dims are padded with zeros to
  ``H = max(D (+1), E)`` (zero columns change no score; v's extra columns are dropped).
* ``causal()`` placed by the offsets, ``d = q_offset - kv_offset``: with ``d >= 0`` the queries
  are shifted down by ``d`` rows (query t at row ``t + d``), so the kernel's top-left
  ``row >= key`` is jattn's ``s <= t + d``; with ``d < 0`` the first ``-d`` queries see no key
  and are left out (they return 0).
* Keys to hide (beyond ``kv_lengths`` of ``padding()``, or the padding that reaches past S
  where a query could see it) are masked through one extra head column: q gets 1, k gets 0 for
  a visible key and a large negative value for a hidden one, so the kernel's logit of a hidden
  key underflows ``exp`` to exactly 0.
* Queries beyond ``q_lengths`` and padded query rows are dropped: their output is 0 and, as the
  output is cut there, they send no gradient.
* ``scale`` as a Python float is the kernel's ``sm_scale``; a traced scale is folded into q.

Everything else (arrays, windows, segment ids, bias, dropout, ...) raises the ``ValueError`` of
:data:`jattn.SUPPORT` (or, for masks the table calls "partly", this module's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn import _platform
from jattn._checks import KernelRefusalError
from jattn._masks import Causal, Mask, Padding, conjuncts, on_batch_axis, query_offset
from jattn._paths.choice import kernel_refusal
from jattn._paths.splash import splash_attention
from jattn._softmax import zero_empty_rows

__all__ = ["KERNEL_BLOCK", "kernel_platform", "pallas_attention"]

#: Largest square block the GPU kernel gets (its default forward block); smaller sequences take
#: the next power of two of their length (16 at least).
KERNEL_BLOCK = 128


def kernel_platform() -> tuple[str, bool]:
    """The kernel for this platform and whether it runs in interpret mode.

    ``'tpu'`` (splash attention) where :func:`jattn._platform.platform` says TPU, ``'gpu'``
    otherwise; interpreted unless JAX's backend is that platform (so on CPU; tests switch the
    platform to run the TPU translation on CPU).
    """
    kernel = "tpu" if _platform.platform() == "tpu" else "gpu"
    return kernel, jax.default_backend() != kernel


def _terms(mask: Mask | None) -> tuple[bool, Padding | None]:
    """``(causal, padding)`` of a conjunction of causal() and padding(); raises for anything else."""
    causal, pad = False, None
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Causal):
            causal = True
        elif isinstance(term, Padding) and pad is None:
            pad = term
        else:
            raise KernelRefusalError(
                f"implementation='pallas' expresses causal(), padding() and their '&' only, got {term!r} in {mask!r}; "
                "use 'dense' or 'blockwise'"
            )
    return causal, pad


def _static_scale(scale) -> float | None:
    """The scale as a Python float, or None when it is traced (then it is folded into q)."""
    if isinstance(scale, jax.core.Tracer):
        return None
    return float(np.asarray(scale))


def _clipped_lengths(x, lead: tuple[int, ...], limit: int, axis: int) -> Array:
    """Per-example lengths ``(B|1,)`` as ``(*lead)`` int32 (batch on ``lead[axis]``), clipped to ``[0, limit]``."""
    return on_batch_axis(jnp.clip(jnp.asarray(x, jnp.int32), 0, limit), lead, axis)


def _row(n: int, ndim: int) -> Array:
    """``arange(n)`` with ``ndim`` unit axes in front (strict rank promotion)."""
    return jnp.arange(n, dtype=jnp.int32).reshape((1,) * ndim + (n,))


def pl_next_pow2(n: int) -> int:
    """The smallest power of two ``>= n``."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Grid:
    """Where one call's queries and keys sit in the kernel's ``(L, L)`` grid (the module docstring's translation)."""

    drop: int  # queries that see no key at all: left out, they return 0
    front: int  # rows above the first query (query t sits at row t + front)
    rows: int  # the queries given to the kernel, T - drop
    L: int  # the one padded length of queries and keys, a multiple of the blocks
    blocks: tuple[int, int]  # the kernel's (block_q, block_kv)
    hide_tail: bool  # the keys padded past S are visible to some row: the extra column hides them
    column: bool  # q and k carry the extra head column that hides keys
    H: int  # the head dim q, k and v are padded to


def _grid(T: int, S: int, D: int, E: int, causal: bool, pad: Padding | None, d: int, blocks, interpret: bool) -> _Grid:
    """The kernel's grid for lengths T, S, head dims D, E and ``d = q_offset - kv_offset`` (see :class:`_Grid`)."""
    drop = min(max(-d, 0), T) if causal else 0  # queries that see no key at all
    front = max(d, 0) if causal else 0  # rows above the first query (query t sits at row t + front)
    rows = T - drop
    n = max(rows + front, S)
    if blocks is None:
        b = min(KERNEL_BLOCK, max(16, pl_next_pow2(n)))
        blocks = (b, b)
    if not interpret:  # Triton's dots want powers of two of at least 16 (the results are the same)
        blocks = tuple(max(16, pl_next_pow2(x)) for x in blocks)
    bq, bk = blocks
    L = -(-n // math.lcm(bq, bk)) * math.lcm(bq, bk)
    # Keys past S are visible where the kernel's causal bound reaches them (every row without causal).
    hide_tail = L > S and (not causal or rows + front > S)
    column = (pad is not None and pad.kv_lengths is not None) or hide_tail
    H = max(D + column, E, 1 if interpret else 16)  # Triton's dots want 16 at least
    return _Grid(drop, front, rows, L, (bq, bk), hide_tail, column, H)


def _hiding_column(q: Array, k: Array, pad: Padding | None, lead: tuple[int, ...], axis: int | None, sm: float):
    """``(q, k, hidden)``: q ``(*lead, rows, D+1)`` with a column of 1, k ``(*lead, S, D+1)`` with 0 or ``hidden``.

    A key beyond ``kv_lengths`` gets ``hidden``, a logit that underflows ``exp`` to exactly 0.
    """
    S = k.shape[-2]
    # An example without keys shows the kernel its first key (its rows return 0 below, and send no
    # gradient): with every key hidden the kernel's backward divides 0 by 0 (NaN, found by the fuzz).
    if pad is None or pad.kv_lengths is None:
        kv_len = S
    else:
        kv_len = jnp.maximum(_clipped_lengths(pad.kv_lengths, lead, S, axis), 1)[..., None]
    valid = _row(S, len(lead)) < kv_len
    hidden = -float(jnp.finfo(q.dtype).max) / 16 / max(sm, 1.0)
    q = jnp.concatenate([q, jnp.ones((*lead, q.shape[-2], 1), q.dtype)], axis=-1)
    k = jnp.concatenate([k, jnp.broadcast_to(jnp.where(valid, 0.0, hidden).astype(k.dtype), (*lead, S))[..., None]], -1)
    return q, k, hidden


def _to_kernel(x: Array, before: int, grid: _Grid) -> Array:
    """``(*lead, l, h) -> (B, L, 1, H)``: zero rows before and after, zero columns after."""
    x = x.reshape(-1, *x.shape[-2:])
    x = jnp.pad(x, ((0, 0), (before, grid.L - before - x.shape[1]), (0, grid.H - x.shape[2])))
    return x[:, :, None, :]


def _mha(q: Array, k: Array, v: Array, grid: _Grid, sm: float, causal: bool, hidden, interpret: bool) -> Array:
    """The GPU flash kernel on q ``(*lead, rows, ·)``, k ``(*lead, S, ·)``, v ``(*lead, S, E)``: ``(B, L, 1, H)``.

    ``hidden`` (with ``grid.hide_tail``) is the hiding column's value for the keys padded past S.
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # imported on use: Triton bits

    S, D = v.shape[-2], q.shape[-1] - grid.column
    kf = _to_kernel(k, 0, grid)
    if grid.hide_tail:  # padded keys past S carry the hiding column too
        kf = kf.at[:, S:, 0, D].set(jnp.asarray(hidden, kf.dtype))
    bq, bk = grid.blocks
    b2 = math.gcd(bq, bk, 32)
    sizes = gpu_attention.BlockSizes(
        block_q=bq, block_k=bk, block_q_dkv=b2, block_kv_dkv=b2, block_q_dq=b2, block_kv_dq=b2
    )
    qf, vf = _to_kernel(q, grid.front, grid), _to_kernel(v, 0, grid)
    with jax.numpy_dtype_promotion("standard"):  # the kernel mixes dtypes internally; callers may run strict
        return gpu_attention.mha(qf, kf, vf, None, sm_scale=sm, causal=causal, block_sizes=sizes, interpret=interpret)


def _zero_unseen(out: Array, pad: Padding, lead: tuple[int, ...], axis: int, drop: int, T: int, S: int) -> Array:
    """``out`` ``(*lead, rows, E)`` with 0 on rows past ``q_lengths`` and on those of an example without keys."""
    seen = jnp.ones(out.shape[:-1], bool)
    if pad.q_lengths is not None:
        seen = drop + _row(out.shape[-2], len(lead)) < _clipped_lengths(pad.q_lengths, lead, T, axis)[..., None]
    if pad.kv_lengths is not None:
        seen = seen & (_clipped_lengths(pad.kv_lengths, lead, S, axis) > 0)[..., None]
    out, _ = zero_empty_rows(out, seen)
    return out


def pallas_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale,
    q_offset: int | None,
    kv_offset: int,
    blocks: tuple[int, int] | None,
    lead: tuple[int, ...],
    axis: int,
    score_mod: Callable[..., Array] | None = None,
) -> Array:
    """Attention through the platform's Pallas kernel; q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``.

    ``scale`` is a value, ``lead`` the call's leading shape and ``axis`` the axis of it where q's
    first axis (a per-example mask's batch) lands (:class:`jattn._checks.Operands`).

    Returns ``(..., T, E)`` in the dtype of q. ``mask`` is None or a conjunction of ``causal()``
    and ``padding()`` (anything else raises a ``ValueError``); ``q_offset``/``kv_offset`` are
    static ints; ``blocks`` is the kernel's ``(block_q, block_kv)``, default square
    ``min(KERNEL_BLOCK, next power of two of the padded length)``; compiled for a GPU (not
    interpreted) each is rounded up to a power of two of at least 16, as Triton needs. ``score_mod``:
    on TPU :func:`jattn.score_mods.softcap` (splash's soft-cap), on GPU none; others raise a
    :class:`jattn._checks.KernelRefusalError`.
    """
    kernel, interpret = kernel_platform()
    if kernel == "tpu":
        return splash_attention(q, k, v, mask, scale, q_offset, kv_offset, blocks, interpret, lead, axis, score_mod)
    if score_mod is not None:
        raise kernel_refusal("pallas", "score_mod", "the GPU kernel takes no score modification")
    T, S, D, E = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    causal, pad = _terms(mask)
    grid = _grid(T, S, D, E, causal, pad, query_offset(q_offset, kv_offset, T, S) - kv_offset, blocks, interpret)
    if grid.rows == 0:
        return jnp.zeros((*lead, T, E), q.dtype)
    sm = _static_scale(scale)
    if sm is None:  # traced scale: into q (in the compute dtype, rounded once to q's dtype)
        q = (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype)
        sm = 1.0
    q = jnp.broadcast_to(q[..., grid.drop :, :], (*lead, grid.rows, D))
    k = jnp.broadcast_to(k, (*lead, S, D))
    v = jnp.broadcast_to(v, (*lead, S, E))
    hidden = None
    if grid.column:
        q, k, hidden = _hiding_column(q, k, pad, lead, axis, sm)
    out = _mha(q, k, v, grid, sm, causal, hidden, interpret)
    out = out[:, grid.front : grid.front + grid.rows, 0, :E].reshape(*lead, grid.rows, E)
    if pad is not None:  # rows past q_lengths, or of an example without keys, return 0
        out = _zero_unseen(out, pad, lead, axis, grid.drop, T, S)
    if grid.drop:
        out = jnp.concatenate([jnp.zeros((*lead, grid.drop, E), out.dtype), out], axis=-2)
    return out
