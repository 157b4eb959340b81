"""The paths of :func:`jattn.attention`, what each honours, and which ones a call may take.

:data:`IMPLEMENTATIONS` names the paths; :data:`SUPPORT` says what each does with each argument
(the docs' support table is this dict); :func:`features_used` lists the rows of it a call uses,
:func:`refusal` says why a path cannot honour them, and :func:`candidate_paths` lists the paths
to try in order (``implementation=None``: the platform's fused paths of :data:`AUTO_ORDER` whose
cells are not "no", then blockwise for scores of at least :data:`AUTO_BLOCKWISE_MIN` entries per
head, dense otherwise). A "partly" cell is decided by the path itself, per call: it raises
:class:`jattn._checks.KernelRefusalError` and the core tries the next candidate. Nothing here
computes attention; shapes follow the dimension key of :mod:`jattn._core`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn import _platform
from jattn._checks import KernelRefusalError, Operands
from jattn._masks import ArrayMask, Mask

__all__ = [
    "AUTO_BLOCKWISE_MIN",
    "AUTO_ORDER",
    "IMPLEMENTATIONS",
    "SUPPORT",
    "candidate_paths",
    "check_implementation",
    "features_used",
    "kernel_refusal",
    "refusal",
]

AUTO_BLOCKWISE_MIN = 1024 * 1024  # T·S from which 'auto' prefers blockwise on CPU (docs: design notes)
IMPLEMENTATIONS = ("dense", "blockwise", "xla", "cudnn", "pallas")

_YES = "yes"
_STATIC = "no: offsets must be static ints"
_NO_BLOCKS = "no: it has no blocks"


def _row(
    *, dense: str = _YES, blockwise: str = _YES, jax_nn: str = _YES, xla: str = "", cudnn: str = "", pallas: str = _YES
) -> dict[str, str]:
    """A row of :data:`SUPPORT`, "yes" in every cell not named; ``jax_nn`` fills 'xla' and 'cudnn' both."""
    return dict(dense=dense, blockwise=blockwise, xla=xla or jax_nn, cudnn=cudnn or jax_nn, pallas=pallas)


#: What each implementation does with each argument: "yes" (honoured); "partly: ..." (honoured
#: where the path can express it, otherwise a ``ValueError``, :class:`jattn._checks.KernelRefusalError`,
#: that names the mask); or
#: "no: ..." (a ``ValueError`` that names the argument, the path and the paths that take it).
#: The support table of the README and the docs is this dict; ``implementation=None`` tries the
#: paths whose cells are not "no" (:func:`candidate_paths`), a "partly" cell decided per call.
#: The 'pallas' column is jattn's own GPU kernel (:mod:`jattn._gpu`, interpreted on CPU) and splash attention on TPU.
SUPPORT: dict[str, dict[str, str]] = {
    "mask (array, any leading dims, 1-D)": _row(pallas="no: the kernel takes no mask array"),
    "mask (position predicate)": _row(
        cudnn="partly: causal() and sliding_window(l, 0) aligned with the keys' end, and arrays",
        pallas="partly: GPU any (static offsets; per-tile kinds, empty tiles skipped); TPU any (splash masks)",
    ),
    "mask (per-example predicate: padding, segment_ids)": _row(
        cudnn="partly: padding() (as sequence lengths)",
        pallas="partly: GPU padding(), segment_ids(), in any '&', '|', '~'; TPU padding(), segment_ids(), in an '&'",
    ),
    "mask (predicate of batch and head: masks.predicate)": _row(
        cudnn="no: cuDNN takes no mask of the batch and head",
        pallas="no: the kernel takes no mask of the batch and head",
    ),
    "q_offset / kv_offset (static ints)": _row(cudnn="partly: where the mask stays aligned with the keys' end"),
    "q_offset / kv_offset (arrays, per example)": _row(blockwise=_STATIC, jax_nn=_STATIC, pallas=_STATIC),
    "bias": _row(pallas="no: the kernel takes no bias"),
    "dropout_rate": _row(
        jax_nn="no: jax.nn has no dropout",
        pallas="partly: GPU yes (the blockwise path's bits); TPU no: splash has none",
    ),
    "precision": _row(jax_nn="no: jax.nn takes no precision", pallas="no: the kernel fixes its own precision"),
    "return_lse": _row(pallas="partly: GPU yes (differentiable); TPU no: splash's log-sum-exp is not returned"),
    "return_max_logit": _row(
        jax_nn="no: jax.nn returns no max logit", pallas="partly: GPU yes; TPU no: splash returns none"
    ),
    "score_mod": _row(
        jax_nn="no: jax.nn takes no score modification",
        pallas=(
            "partly: GPU in the kernel (the arrays it closes over get gradients), but none that reads a table per "
            "score (T5's bias: a gather, which neither Triton nor Mosaic GPU lowers); TPU score_mods.softcap() "
            "(splash's soft-cap)"
        ),
    ),
    "sinks": _row(jax_nn="no: jax.nn takes no sinks", pallas="partly: GPU yes; TPU no: splash takes none"),
    "block_size": _row(dense=_NO_BLOCKS, jax_nn=_NO_BLOCKS),
    "float64 inputs": _row(
        xla="no: jax.nn computes in float32",
        cudnn="no: cuDNN has no float64 kernel",
        pallas="no: the kernel computes in float32",
    ),
    "value depth E != D": _row(jax_nn="no: jax.nn needs E == D"),
}


AUTO_ORDER: dict[str, tuple[str, ...]] = {"gpu": ("pallas", "cudnn"), "tpu": ("pallas",), "cpu": ()}
"""The fused paths ``implementation=None`` tries first, by platform, in order; each takes the call or
refuses it (a "no" cell of :data:`SUPPORT` for a row the call uses, or its own per-call refusal of
a "partly" cell), and after them comes the blockwise/dense rule (:data:`AUTO_BLOCKWISE_MIN`).
No GPU or TPU figure has been measured yet: this order is reasoned, not timed, and is to be
replaced by the measured one when an H200 is at hand (docs/design/pallas.md). Why this order:

* GPU: 'pallas' first: it takes float32 as well as bf16/f16, any head dim (padded), ``E != D``,
  and its masks (today causal() and padding()) at any static offsets; cuDNN takes bf16/f16 only,
  head dims that are multiples of 8 up to 128 (256 from Hopper on), ``E == D``, and causal() or
  sliding_window(l, 0) only when aligned with the keys' end. 'cudnn' second, for what the kernel
  refuses and cuDNN takes (its own per-call refusal says where not: float32, such a head dim, no
  CUDA GPU under JAX), except what :data:`AUTO_AVOIDS` keeps from it. Within 'pallas', the kernel by the
  GPU's compute capability (:func:`jattn._paths.pallas.gpu_backends`), each falling back to the next:
  sm_90 the Mosaic GPU kernel (``wgmma``), then Triton; sm_100/103 the Mosaic GPU kernel on ``tcgen05``
  (jax 0.12+), then Triton; sm_80-89 and sm_120 Triton alone, while JAX has its Pallas Triton backend
  (deprecated in 0.11: :mod:`jattn._gpu.deprecation`). The Mosaic GPU kernel takes bf16 and f16 with
  64-by-64 blocks (128 on sm_100); float32 and other blocks go to Triton.
* TPU: 'pallas' (splash attention): it takes every static predicate, padding() and
  segment_ids(); cuDNN is NVIDIA's, and jax.nn's 'xla' path forms the dense scores.
* CPU: none: the blockwise/dense rule alone, as measured there (docs: design notes); jax.nn's
  'xla' path forms the dense scores as 'dense' does.
"""

AUTO_AVOIDS: dict[str, tuple[str, ...]] = {"cudnn": ("mask (array, any leading dims, 1-D)", "bias")}
"""Rows of :data:`SUPPORT` a path takes when named but the automatic choice does not try it for:
jattn hands cuDNN an array mask or a bias broadcast to ``(B·N, 1, T, S)`` (jax.nn's layout), the
memory of the dense scores, where the blockwise path reads them a tile at a time."""


def _mask_rows(mask: Mask | None) -> list[str]:
    """The mask rows of :data:`SUPPORT` that ``mask`` uses."""
    if mask is None:
        return []
    used = []
    if mask.has_arrays:
        used.append("mask (array, any leading dims, 1-D)")
    if mask.per_row:
        used.append("mask (predicate of batch and head: masks.predicate)")
    if not isinstance(mask, ArrayMask):
        used.append(
            "mask (per-example predicate: padding, segment_ids)" if mask.per_example else "mask (position predicate)"
        )
    return used


def features_used(
    ops: Operands,
    dropout_rate: float,
    precision: jax.lax.PrecisionLike,
    return_lse: bool,
    block_size: int | tuple[int, int] | None,
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> list[str]:
    """The rows of :data:`SUPPORT` a call of these operands and arguments uses."""
    q, v, q_offset, kv_offset = ops.q, ops.v, ops.q_offset, ops.kv_offset
    used = _mask_rows(ops.mask)
    offsets = (q_offset if q_offset is not None else 0, kv_offset)
    if not all(isinstance(o, numbers.Integral) for o in offsets):
        used.append("q_offset / kv_offset (arrays, per example)")
    elif q_offset is not None or kv_offset != 0:
        used.append("q_offset / kv_offset (static ints)")
    for flag, row in (
        (ops.bias is not None, "bias"),
        (dropout_rate != 0, "dropout_rate"),
        (precision is not None, "precision"),
        (return_lse, "return_lse"),
        (return_max_logit, "return_max_logit"),
        (score_mod is not None, "score_mod"),
        (sinks is not None, "sinks"),
        (block_size is not None, "block_size"),
        (q.dtype == jnp.float64, "float64 inputs"),
        (v.shape[-1] != q.shape[-1], "value depth E != D"),
    ):
        if flag:
            used.append(row)
    return used


def refusal(path: str, used: list[str], *, partly: bool = True) -> str | None:
    """Why ``path`` cannot honour this call (the first row it refuses), or None.

    ``partly=True`` lets "partly" cells through (the jax.nn translation checks them case by case).
    """
    for row in used:
        cell = SUPPORT[row][path]
        if cell != _YES and not (partly and cell.startswith("partly")):
            takes = [p for p in IMPLEMENTATIONS if SUPPORT[row][p] == _YES]
            return f"implementation={path!r} cannot take {row}: {cell.removeprefix('no: ')}; use one of {takes}"
    return None


def kernel_refusal(path: str, row: str, why: str) -> KernelRefusalError:
    """A kernel's refusal of one call's ``row`` (a "partly" cell of :data:`SUPPORT`): why, and the paths that take it."""
    takes = [p for p in IMPLEMENTATIONS if SUPPORT[row][p] == _YES]
    return KernelRefusalError(f"implementation={path!r} cannot take {row}: {why}; use one of {takes}")


def check_implementation(implementation: str | None) -> None:
    """Raises a ``ValueError`` unless ``implementation`` is None or one of :data:`IMPLEMENTATIONS` (the one check of it)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")


def candidate_paths(implementation: str | None, q: Array, k: Array, used: list[str]) -> tuple[str, ...]:
    """The paths to try for this call, in order (q ``(..., T, D)``, k ``(..., S, D)``; ``used``: rows of :data:`SUPPORT`).

    An explicit ``implementation`` is the one candidate (a ``ValueError`` where its cell for a used
    row is "no"; a "partly" cell is decided by the path, which raises
    :class:`jattn._checks.KernelRefusalError`). ``None``: the fused paths of :data:`AUTO_ORDER` for
    the platform whose cells are not "no" (nor avoided, :data:`AUTO_AVOIDS`), then blockwise where it
    applies and the scores have at least :data:`AUTO_BLOCKWISE_MIN` entries per head, dense
    otherwise; the last candidate takes every call its cells allow.
    """
    check_implementation(implementation)
    if implementation is not None:
        why = refusal(implementation, used)
        if why:
            raise ValueError(why)
        return (implementation,)
    fused = [
        p
        for p in AUTO_ORDER.get(_platform.platform(), ())
        if refusal(p, used) is None and not set(AUTO_AVOIDS.get(p, ())) & set(used)
    ]
    big = q.shape[-2] * k.shape[-2] >= AUTO_BLOCKWISE_MIN
    order = ("blockwise", "dense") if big else ("dense", "blockwise")
    last = next((p for p in order if refusal(p, used, partly=False) is None), "dense")
    return (*fused, last)
