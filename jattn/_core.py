"""The pure attention core.

Dimension key, used in every einsum and shape comment of jattn:

  B  batch                      T  query length
  N  query heads                S  key/value length
  K  key/value heads            D  query/key depth
  G  query heads per kv head    E  value depth
  F  feature depth of linear attention's feature map (F = D for the elementwise maps)
  ...  any leading dimensions (batch, heads, groups), broadcast like NumPy

The computation is the article's: ``scores = q kᵀ · scale``, a softmax over the keys of each
query row (built from the stable parts in :mod:`jattn._softmax`), then the weighted sum of the
values.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn import _platform
from jattn._blockwise import blockwise_attention
from jattn._checks import (
    broadcast_all,
    check_block_size,
    check_grid,
    check_mask,
    check_qkv,
    check_real,
    check_score_mod,
    check_sinks,
)
from jattn._dropout import keep_mask, keep_scale, row_seeds
from jattn._masks import (
    ArrayMask,
    Causal,
    Mask,
    Padding,
    SlidingWindow,
    call_lead,
    call_rows,
    conjuncts,
    on_batch_axis,
    query_offset,
)
from jattn._masks import array as masks_array
from jattn._online import compute_dtype, lead_index
from jattn._pallas import pallas_attention
from jattn._softmax import SoftmaxParts, softmax_parts, zero_empty_rows
from jattn._tiles import choose_tiles

__all__ = ["IMPLEMENTATIONS", "SUPPORT", "attention", "attention_weights", "choose_implementation"]


def _check_scale(scale: float | ArrayLike | None) -> None:
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


def _as_mask(mask: ArrayLike | Mask | None, bias: ArrayLike | None, q: Array, k: Array) -> Mask | None:
    """A boolean array mask as :class:`~jattn.masks.ArrayMask` (1-D and 0-D included), else unchanged.

    Checks first that ``mask`` is no function (:func:`~jattn._checks.check_mask`), and that an
    array mask and ``bias`` broadcast to ``(..., T, S)``, in the shapes the caller gave.
    """
    check_mask(mask)
    if bias is not None:
        _check_bias(bias)  # its dtype first
        check_grid("bias", jnp.shape(bias), q.shape, k.shape)
    if mask is None or isinstance(mask, Mask):
        return mask
    array = masks_array(mask)
    check_grid("mask", jnp.shape(mask), q.shape, k.shape)
    return array


def _check_offsets(mask: Mask | None, q_offset: ArrayLike | None, kv_offset: ArrayLike) -> None:
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


def _dense_mask(
    mask: Mask | None, q: Array, k: Array, q_offset: ArrayLike | None, kv_offset: ArrayLike, v=None, bias=None
) -> Array | None:
    """The boolean ``(..., T, S)`` of a mask (a per-example one puts the batch on the first axis of q)."""
    if mask is None:
        return None
    T, S = q.shape[-2], k.shape[-2]
    if mask.per_row:
        return _dense_rows(mask, q, k, v, bias, q_offset, kv_offset)
    dense = mask.dense(T, S, q_offset=q_offset, kv_offset=kv_offset)
    if mask.per_example and dense.ndim == 4:  # (B, 1, T, S): batch first
        if q.ndim < 3:
            raise ValueError(f"a per-example mask needs a batch axis in q, got q of shape {q.shape}")
        dense = dense.reshape(dense.shape[0], *(1,) * (q.ndim - 3), T, S)
    return dense


def _dense_rows(mask: Mask, q, k, v, bias, q_offset, kv_offset) -> Array:
    """A mask that reads the batch and head (:func:`jattn.masks.predicate`), evaluated per row of the call: ``(..., T, S)``.

    As the blockwise path reads it: every leaf as rows of the leading shape flattened
    (:func:`jattn._masks.as_rows`), at static offsets.
    """
    T, S = q.shape[-2], k.shape[-2]
    if not all(isinstance(o, numbers.Integral) for o in (0 if q_offset is None else q_offset, kv_offset)):
        raise ValueError(
            f"a masks.predicate takes static int offsets, got q_offset={q_offset!r}, kv_offset={kv_offset!r}"
        )
    lead, rows = call_rows(mask, q, k, v, _check_bias(bias))
    q0 = query_offset(q_offset, kv_offset, T, S)
    rows = rows._bind(q0, kv_offset)
    m = rows.allowed(q0 + jnp.arange(T, dtype=jnp.int32)[:, None], kv_offset + jnp.arange(S, dtype=jnp.int32)[None])
    return jnp.broadcast_to(m, (math.prod(lead), T, S)).reshape(*lead, T, S)


def _check_bias(bias: ArrayLike | None) -> Array | None:
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be floating point, got {bias.dtype} with shape {bias.shape}")
    return bias.reshape((1,) * max(0, 2 - bias.ndim) + bias.shape)  # NumPy broadcasting: (S,) is (1, S)


def _pad_rank(x: Array | None, ndim: int) -> Array | None:
    """Left-pads ``x`` with unit axes to ``ndim`` dimensions (strict rank promotion is kept)."""
    return None if x is None else x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _positions(q_offset, kv_offset, T: int, S: int, ndim: int) -> tuple[Array, Array]:
    """Absolute positions for ``score_mod``: ``q_pos (..., T, 1)`` and ``kv_pos (..., 1, S)`` int32 at rank ``ndim``.

    Per-example offsets ``(B,)`` put the batch on the first axis, as for masks.
    """

    def place(offset, n, axis):
        offset = jnp.asarray(offset, jnp.int32)
        if offset.ndim:  # (B,): batch first
            offset = offset.reshape(-1, *(1,) * (ndim - 1))
        pos = jnp.arange(n, dtype=jnp.int32).reshape((n, 1) if axis == 0 else (1, n))
        pos = pos.reshape((1,) * (ndim - 2) + pos.shape)
        return offset + pos if offset.ndim else pos + offset

    q_offset = query_offset(q_offset, jnp.asarray(kv_offset, jnp.int32), T, S)
    return place(q_offset, T, 0), place(kv_offset, S, 1)


def _logits(
    q: Array,
    k: Array,
    mask: Array | None,
    bias: Array | None,
    scale: float | ArrayLike | None,
    precision: jax.lax.PrecisionLike,
    score_mod=None,
    mod_index: tuple = (),
    sinks: Array | None = None,
) -> tuple[SoftmaxParts, jnp.dtype, Array]:
    """Scaled, biased, modified, masked scores ``(..., T, S)`` split into softmax parts (all at one rank).

    ``mod_index`` is ``(batch, head, q_pos, kv_pos)`` for ``score_mod``; ``sinks`` ``(..., 1, 1)``
    joins each row as one more always-kept column without a value (the parts then span S + 1
    columns). Also returns the row max logit ``(..., T)`` over the kept scores (``-inf`` for a row
    with none), sinks left out.
    """
    compute = compute_dtype(q.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # The scale goes into q, not onto the scores: a product of scores and scale can be fused into
    # one multiply-add with the max subtraction (XLA on CPU does), leaving the row maximum's own
    # exponent at minus half an ulp of the logit instead of 0 (exp(-1e25) for logits near 1e32).
    qs = q.astype(compute) * jnp.asarray(scale, compute)
    s = jnp.einsum("...td,...sd->...ts", qs, k.astype(compute), precision=precision, preferred_element_type=compute)
    if bias is not None:
        s = s + bias.astype(compute)
    if score_mod is not None:
        x = jnp.asarray(score_mod(s, *mod_index)).astype(compute)
        s = jnp.broadcast_to(x, jnp.broadcast_shapes(s.shape, x.shape))
    if mask is not None:
        s = jnp.broadcast_to(s, jnp.broadcast_shapes(s.shape, mask.shape))
    keep = jnp.ones((1,) * s.ndim, bool) if mask is None else mask
    # A monitor, as on every path: the blockwise and ring backwards have no max-logit term.
    top = jax.lax.stop_gradient(jnp.max(s, axis=-1, where=keep, initial=-jnp.inf))
    if sinks is not None:
        shape = jnp.broadcast_shapes(s.shape, (*sinks.shape[:-1], 1))
        s = jnp.concatenate([jnp.broadcast_to(s, shape), jnp.broadcast_to(sinks.astype(compute), (*shape[:-1], 1))], -1)
        keep = jnp.concatenate([jnp.broadcast_to(keep, shape), jnp.ones((*shape[:-1], 1), bool)], -1)
        return softmax_parts(s, keep), compute, top
    return softmax_parts(s, mask), compute, top


def _check_dropout(rate: float, rng: Array | None) -> float:
    rate = check_real("dropout_rate", rate, low=0.0, high=1.0)
    if rate and rng is None:
        raise ValueError(f"dropout_rate={rate} > 0 needs a dropout_rng key")
    return rate


def _dropout(p: Array, rate: float, rng: Array | None, lead: tuple[int, ...]) -> Array:
    """Weights ``p (..., T, S)`` broadcast to ``(*lead, T, S)`` with dropout's rule (:mod:`jattn._dropout`) applied."""
    if rate == 0.0:
        return p
    T, S = p.shape[-2:]
    rows = jnp.arange(math.prod(lead), dtype=jnp.int32).reshape(*lead, 1, 1)
    one = (1,) * len(lead)
    t, s = jnp.arange(T, dtype=jnp.int32).reshape(*one, T, 1), jnp.arange(S, dtype=jnp.int32).reshape(*one, 1, S)
    keep = keep_mask(row_seeds(rng, rows), t, s, rate)  # (*lead, T, S): the blockwise path's bits exactly
    return jnp.broadcast_to(p, keep.shape) * keep_scale(keep, rate, p.dtype)


AUTO_BLOCKWISE_MIN = 1024 * 1024  # T·S from which 'auto' prefers blockwise on CPU (bench/README)
IMPLEMENTATIONS = ("dense", "blockwise", "xla", "cudnn", "pallas")

_YES = "yes"
#: What each implementation does with each argument: "yes" (honoured); "partly: ..." (honoured
#: where jax.nn has an argument for it, otherwise a ``ValueError`` that names the mask); or
#: "no: ..." (a ``ValueError`` that names the argument, the path and the paths that take it).
#: The README table is this dict; ``implementation=None`` picks a path whose cells are all "yes".
#: The 'pallas' column is JAX's GPU flash kernel (interpreted on CPU) and splash attention on TPU.
SUPPORT: dict[str, dict[str, str]] = {
    "mask (array, any leading dims, 1-D)": dict(
        dense=_YES, blockwise=_YES, xla=_YES, cudnn=_YES, pallas="no: the kernel takes no mask array"
    ),
    "mask (position predicate)": dict(
        dense=_YES,
        blockwise=_YES,
        xla=_YES,
        cudnn="partly: causal() and sliding_window(l, 0) aligned with the keys' end, and arrays",
        pallas="partly: GPU causal() (any static offsets); TPU any (splash masks)",
    ),
    "mask (per-example predicate: padding, segment_ids)": dict(
        dense=_YES,
        blockwise=_YES,
        xla=_YES,
        cudnn="partly: padding() (as sequence lengths)",
        pallas="partly: GPU padding(); TPU padding(), segment_ids(), in an '&'",
    ),
    "mask (predicate of batch and head: masks.predicate)": dict(
        dense=_YES,
        blockwise=_YES,
        xla=_YES,
        cudnn="no: cuDNN takes no mask of the batch and head",
        pallas="no: the kernel takes no mask of the batch and head",
    ),
    "q_offset / kv_offset (static ints)": dict(
        dense=_YES,
        blockwise=_YES,
        xla=_YES,
        cudnn="partly: where the mask stays aligned with the keys' end",
        pallas=_YES,
    ),
    "q_offset / kv_offset (arrays, per example)": dict(
        dense=_YES,
        blockwise="no: offsets must be static ints",
        xla="no: offsets must be static ints",
        cudnn="no: offsets must be static ints",
        pallas="no: offsets must be static ints",
    ),
    "bias": dict(dense=_YES, blockwise=_YES, xla=_YES, cudnn=_YES, pallas="no: the kernel takes no bias"),
    "dropout_rate": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn has no dropout",
        cudnn="no: jax.nn has no dropout",
        pallas="no: the kernel has no dropout",
    ),
    "precision": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn takes no precision",
        cudnn="no: jax.nn takes no precision",
        pallas="no: the kernel fixes its own precision",
    ),
    "return_lse": dict(
        dense=_YES,
        blockwise=_YES,
        xla=_YES,
        cudnn=_YES,
        pallas="no: the kernel's log-sum-exp cannot be differentiated",
    ),
    "return_max_logit": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn returns no max logit",
        cudnn="no: jax.nn returns no max logit",
        pallas="no: the kernel returns no max logit",
    ),
    "score_mod": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn takes no score modification",
        cudnn="no: jax.nn takes no score modification",
        pallas="no: the kernel takes no score modification",
    ),
    "sinks": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn takes no sinks",
        cudnn="no: jax.nn takes no sinks",
        pallas="no: the kernel takes no sinks",
    ),
    "block_size": dict(
        dense="no: it has no blocks",
        blockwise=_YES,
        xla="no: it has no blocks",
        cudnn="no: it has no blocks",
        pallas=_YES,
    ),
    "float64 inputs": dict(
        dense=_YES,
        blockwise=_YES,
        xla="no: jax.nn computes in float32",
        cudnn="no: cuDNN has no float64 kernel",
        pallas="no: the kernel computes in float32",
    ),
    "value depth E != D": dict(
        dense=_YES, blockwise=_YES, xla="no: jax.nn needs E == D", cudnn="no: jax.nn needs E == D", pallas=_YES
    ),
}


def _features(
    q,
    v,
    mask: Mask | None,
    bias,
    q_offset,
    kv_offset,
    dropout_rate,
    precision,
    return_lse,
    block_size,
    score_mod=None,
    sinks=None,
    return_max_logit=False,
):
    """The rows of :data:`SUPPORT` this call uses."""
    used = []
    if mask is not None:
        if mask.has_arrays:
            used.append("mask (array, any leading dims, 1-D)")
        if mask.per_row:
            used.append("mask (predicate of batch and head: masks.predicate)")
        if not isinstance(mask, ArrayMask):
            used.append(
                "mask (per-example predicate: padding, segment_ids)"
                if mask.per_example
                else "mask (position predicate)"
            )
    offsets = (q_offset if q_offset is not None else 0, kv_offset)
    if not all(isinstance(o, numbers.Integral) for o in offsets):
        used.append("q_offset / kv_offset (arrays, per example)")
    elif q_offset is not None or kv_offset != 0:
        used.append("q_offset / kv_offset (static ints)")
    for flag, row in (
        (bias is not None, "bias"),
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


def _refusal(path: str, used: list[str], *, partly: bool = True) -> str | None:
    """Why ``path`` cannot honour this call (the first row it refuses), or None.

    ``partly=True`` lets "partly" cells through (the jax.nn translation checks them case by case).
    """
    for row in used:
        cell = SUPPORT[row][path]
        if cell != _YES and not (partly and cell.startswith("partly")):
            takes = [p for p in IMPLEMENTATIONS if SUPPORT[row][p] == _YES]
            return f"implementation={path!r} cannot take {row}: {cell.removeprefix('no: ')}; use one of {takes}"
    return None


def _choose(implementation, q, k, used: list[str]) -> str:
    """The path for this call; an explicit choice that cannot honour an argument raises a ``ValueError``."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation is not None:
        why = _refusal(implementation, used)
        if why:
            raise ValueError(why)
        return implementation
    big = q.shape[-2] * k.shape[-2] >= AUTO_BLOCKWISE_MIN
    order = ("blockwise", "dense") if big else ("dense", "blockwise")
    if _platform.platform() in ("gpu", "tpu"):  # the fused kernel first, where it honours everything
        order = ("pallas", *order)
    return next((p for p in order if _refusal(p, used, partly=False) is None), "dense")


def _jax_nn_args(
    mask: Mask | None, path: str, T: int, S: int, q_offset: int | None, kv_offset: int, lead, batch_axis: int
) -> dict:
    """jax.nn's own arguments for a jattn mask: ``is_causal``, ``local_window_size``, sequence lengths, ``mask``.

    jax.nn aligns queries top-left (query t sees key s <= t); jattn places query t at position
    ``q_offset + t`` and key s at ``kv_offset + s``, so a band ``i - L <= j <= i + R`` becomes
    ``local_window_size = (L - d, R + d)`` with ``d = q_offset - kv_offset``. Terms jax.nn has no
    argument for are materialised into its ``mask`` (xla) or refused (cudnn). Padding lengths
    ``(B,)`` lie along ``lead``'s axis ``batch_axis``, where q's first axis lands (as for every path).
    """
    q_offset = query_offset(q_offset, kv_offset, T, S)
    d = q_offset - kv_offset
    left = right = None  # the band s - t in [-left, right] (None: unbounded)
    kwargs: dict = {}
    rest: Mask | None = None
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Causal | SlidingWindow):
            tl, tr = (None, d) if isinstance(term, Causal) else (term.left - d, term.right + d)
            left = tl if left is None else (left if tl is None else min(left, tl))
            right = tr if right is None else min(right, tr)
        elif isinstance(term, Padding):
            for name, x in (("query_seq_lengths", term.q_lengths), ("key_value_seq_lengths", term.kv_lengths)):
                if x is not None:
                    x = jnp.minimum(jnp.asarray(x, jnp.int32), T if name[0] == "q" else S)
                    x = on_batch_axis(x, lead, batch_axis).reshape(-1)
                    kwargs[name] = x if name not in kwargs else jnp.minimum(kwargs[name], x)
        else:
            rest = term if rest is None else rest & term
    if right is not None or left is not None:
        if path == "cudnn" and right != 0:
            raise ValueError(
                f"implementation='cudnn' expresses causal() and sliding_window(l, 0) only with queries aligned to the "
                f"keys' end (q_offset - kv_offset == S - T == 0), got {mask!r} with T={T}, S={S}, q_offset={q_offset}, "
                f"kv_offset={kv_offset}; use 'xla', 'dense' or 'blockwise'"
            )
        if right == 0 and (path == "cudnn" or left is None):
            kwargs["is_causal"] = True
        if left is not None or right != 0:
            kwargs["local_window_size"] = (T + S if left is None else left, T + S if right is None else right)
    if rest is not None:
        if path == "cudnn" and not rest.has_arrays:
            raise ValueError(
                f"implementation='cudnn' expresses causal(), sliding_window(l, 0), padding() and arrays only, got "
                f"{rest!r}; use 'xla', 'dense' or 'blockwise'"
            )
        kwargs["mask"] = rest
    return kwargs


def _lse_grad(value: Array, q, k, v, bias, mask: Mask | None, scale, q_offset, kv_offset) -> Array:
    """jax.nn's log-sum-exp ``value`` (any shape of B·T entries), differentiated as the dense path's.

    jax.nn stops its residual's gradient. Here it gets the gradient of the dense logits'
    log-sum-exp with respect to q, k and bias (:func:`_grad_from`). Everything traced that the
    dense one reads (mask arrays, v, offsets, scale) becomes an argument (the constants of its
    jaxpr), so it also holds where the backward runs outside the forward's ``jit``
    (``grad(jit(f))``).
    """

    def lse(q, k, bias=None):
        dense = _dense_mask(mask, q, k, q_offset, kv_offset, v, bias)
        lead = broadcast_all(q=q, k=k, v=v, mask=dense, bias=bias)
        ndim = len(lead) + 2
        q, k, dense, bias = (_pad_rank(x, ndim) for x in (q, k, dense, bias))
        parts = _logits(q, k, dense, bias, scale, None, None, (), None)[0]
        return jnp.broadcast_to(parts.logsumexp(), (*lead, q.shape[-2])).reshape(-1)

    diff = (q, k) if bias is None else (q, k, bias)
    closed = jax.make_jaxpr(lse)(*diff)
    return _grad_from(_Jaxpr(closed.jaxpr), value, diff, tuple(closed.consts))


class _Jaxpr:
    """A jaxpr as a function of its inputs and then its constants (for :func:`_grad_from`)."""

    def __init__(self, jaxpr) -> None:
        self.jaxpr = jaxpr

    def __call__(self, *args):
        n = len(self.jaxpr.constvars)
        args, consts = args[: len(args) - n], args[len(args) - n :]
        return jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(self.jaxpr, consts))(*args)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grad_from(fn, value: Array, diff: tuple, rest: tuple) -> Array:
    """``value`` (no gradient of its own), differentiated as ``fn(*diff, *rest)`` (whose value it equals) in ``diff``.

    The backward computes ``fn``'s VJP only where the cotangent is not all zeros (``lax.cond``):
    an lse returned but not used in the loss costs no dense pass.
    """
    return value


def _grad_from_fwd(fn, value, diff, rest):
    return value, (diff, rest)


def _grad_from_bwd(fn, res, g):
    diff, rest = res

    def pull(g):
        out, vjp = jax.vjp(lambda *d: fn(*d, *rest), *diff)
        return vjp(g.reshape(out.shape).astype(out.dtype))

    zeros = jax.tree.map(jnp.zeros_like, diff)
    grads = jax.lax.cond(jnp.any(g != 0), pull, lambda g: zeros, g)
    return jnp.zeros_like(g), grads, jax.tree.map(lambda _: None, rest)


_grad_from.defvjp(_grad_from_fwd, _grad_from_bwd)


def _jax_nn(q, k, v, mask: Mask | None, bias, scale, path, q_offset, kv_offset, return_lse):
    """Hands the call to ``jax.nn.dot_product_attention`` with its own arguments (see :data:`SUPPORT`)."""
    T, S = q.shape[-2], k.shape[-2]
    bias = _check_bias(bias)
    lead, axis = broadcast_all(q=q, k=k, v=v, bias=bias), 0
    if mask is not None and q.ndim > 2:
        lead, axis = call_lead(mask, q, k, v, bias)  # with a per-example mask's batch, on q's first axis
    if T == 0 or S == 0:  # no key (or no query): every row is empty, 0 with lse -inf; jax.nn cannot reshape it
        dense = _dense_mask(mask, q, k, q_offset, kv_offset, v, bias)
        lead = tuple(np.broadcast_shapes(lead, broadcast_all(q=q, k=k, v=v, bias=bias, mask=dense)))
        out = jnp.zeros((*lead, T, v.shape[-1]), v.dtype)
        return (out, jnp.full((*lead, T), -jnp.inf, jnp.float32)) if return_lse else out
    kwargs = _jax_nn_args(mask, path, T, S, q_offset, kv_offset, lead or (1,), axis)  # jax.nn needs a batch axis
    rest = kwargs.pop("mask", None)
    dense = _dense_mask(rest, q, k, q_offset, kv_offset, v, bias)
    lead = tuple(np.broadcast_shapes(lead, broadcast_all(q=q, k=k, v=v, bias=bias, mask=dense)))

    def flat(x):  # (..., L, D) -> (B, L, 1, D)
        x = jnp.broadcast_to(x, (*lead, *x.shape[-2:]))
        return x.reshape(-1, x.shape[-2], 1, x.shape[-1])

    def flat_ts(x):  # (..., T, S) -> (B, 1, T, S)
        return jnp.broadcast_to(x, (*lead, T, S)).reshape(-1, 1, T, S)

    with jax.numpy_dtype_promotion("standard"):  # jax.nn promotes bf16/f16 internally; callers may run strict
        out = jax.nn.dot_product_attention(
            flat(q),
            flat(k),
            flat(v),
            bias=None if bias is None else flat_ts(bias).astype(q.dtype),
            mask=None if dense is None else flat_ts(dense),
            scale=scale,
            implementation=path,
            return_residual=return_lse,
            **kwargs,
        )
    out, lse = out if return_lse else (out, None)
    if lse is not None:  # jax.nn stops the residual's gradient: take it from the dense logits'
        lse = _lse_grad(lse, q, k, v, bias, mask, scale, q_offset, kv_offset)
    out = out.reshape(*lead, T, v.shape[-1])
    if mask is not None:  # jax.nn averages v over a fully masked row; the contract is 0 (and lse -inf)
        dense = _dense_mask(mask, q, k, q_offset, kv_offset, v, bias)  # (..., T, S): reduced before it is broadcast
        seen = jnp.broadcast_to(jnp.any(jnp.broadcast_to(dense, (*dense.shape[:-2], T, S)), axis=-1), (*lead, T))
        out, lse = zero_empty_rows(out, seen, None if lse is None else lse.reshape(*lead, T))
    elif lse is not None:
        lse = lse.reshape(*lead, T).astype(jnp.float32)
    return (out, lse) if return_lse else out


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_lse: bool = False,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> Array | tuple[Array, ...]:
    r"""Scaled dot-product attention: ``softmax(score_mod(q kᵀ · scale + bias), masked) v``.

    Shapes (dimension key in :mod:`jattn._core`)::

        q     (..., T, D)      queries
        k     (..., S, D)      keys
        v     (..., S, E)      values
        mask  (..., T, S)      boolean, True = attend; broadcastable
        bias  (..., T, S)      additive, floating; broadcastable
        out   (..., T, E)      in the dtype of q, k, v
        lse   (..., T)         log-sum-exp of each row's logits (float32, or float64)
        sinks (...)            one logit per row of the leading dims, e.g. (N,) against (B, N)
        max_logit (..., T)     each row's largest (modified, kept) logit; -inf for an empty row

    The leading dimensions ``...`` of q, k, v, mask and bias broadcast like NumPy, so a head axis
    of size 1 in k and v gives multi-query attention, and grouped-query attention is q of shape
    ``(B, K, G, T, D)`` against k, v of shape ``(B, K, 1, S, D)``. ``vmap`` over any leading
    axis is free.

    Layout: the heads are leading dimensions, as in torch's ``(B, N, T, D)``. No check on shapes
    can tell this from jax.nn's and Flax's ``(B, T, N, H)``: ``(2, 32, 1, 128)`` is one token of
    32 heads here (decoding) and 32 tokens of one head there, ``(2, 8, 4, 64)`` a prompt of 4
    tokens with 8 heads or of 8 tokens with 4, and any leading dims (windows, axial rows, sets)
    are valid. So ``(B, T, N, H)`` arrays with ``T == S`` attend over the heads of each token
    (N query heads against K key heads) without an error; pass them to
    :func:`jattn.dot_product_attention` (jax.nn's signature and layout, grouped heads included)
    or swap them to ``(B, N, T, H)`` with ``x.swapaxes(-3, -2)``. With ``T != S`` their leading
    dims do not broadcast, and a mask ``(T, S)`` does not fit the ``(N, K)`` read from them: both
    errors name the layouts. One query token ``(B, 1, N, H)`` against ``(B, S, K, H)`` does
    broadcast, to an output ``(B, S, N, H)`` unlike q's shape. Grouped heads in torch's layout,
    q ``(B, N, T, D)`` against k, v ``(B, K, S, D)``, take the form above:
    ``q.reshape(B, K, N // K, T, D)`` with ``k[:, :, None]`` and ``v[:, :, None]``. A torch
    key-padding mask ``(B, S)`` is ``masks.padding(kv_lengths=...)`` or ``mask[:, None, None, :]``
    here (True = attend); passed as it is, it is read as ``(T, S)``: an error that says so, unless
    ``B`` is 1 (the same mask) or ``T`` (then one row per query, without an error).

    .. math::
        \mathrm{out}_t = \sum_s \frac{e^{x_{ts} - m_t}}{\sum_{s'} e^{x_{ts'} - m_t}} v_s, \quad
        x_{ts} = \mathrm{scale}\, q_t \cdot k_s + \mathrm{bias}_{ts}, \quad m_t = \max_s x_{ts}

    with the sums and the max over attended keys only.

    Score modifications and sinks (see :mod:`jattn.score_mods`): ``score_mod(score, batch, head,
    q_pos, kv_pos)`` replaces each logit ``x_ts`` before the mask. Its arguments are arrays that
    broadcast against ``score``: int32 ``batch`` indexes the first leading axis (after
    broadcasting q, k, v, mask, bias), ``head`` the remaining leading axes flattened row-major
    (for ``(B, N, T, D)``: head = n; for the grouped layout ``(B, K, G, T, D)``: head =
    k·G + g; both 0 where there is no such axis); ``q_pos``, ``kv_pos`` are the absolute
    positions of the mask predicates (``q_offset + t``, ``kv_offset + s``). It must act element
    by element with NumPy broadcasting (the blockwise path calls it on tiles). Arrays it closes
    over receive gradients on every path. ``sinks`` adds ``e^sink`` to each row's denominator
    without a value: ``out_t = Σ_s e^{x_ts} v_s / (Σ_s e^{x_ts} + e^{sink})``; the log-sum-exp
    includes it, the max logit does not.

    Contract:
      * A query row whose keys are all masked out returns exactly 0 and contributes zero
        gradient to q, k, v, bias, sinks and the arrays of ``score_mod`` (its log-sum-exp is
        ``-inf``, or its sink with ``sinks``: a sink alone keeps the row's output at 0); never
        NaN, never the mean of v. A row whose every logit is ``-inf`` through ``bias`` or
        ``score_mod`` is treated the same.
      * NaN in an unmasked entry of q, k, v or bias propagates to the rows it touches.
      * bfloat16/float16 inputs: logits and softmax are computed and accumulated in float32
        (no overflow for logits up to the float32 range); the output is in the input dtype.
        float64 inputs (with ``jax_enable_x64``) compute in float64.
      * Pure: no side effects and no host syncs; works under ``jit``, ``vmap``, ``grad`` and
        ``remat``.

    Args:
      q, k, v: queries, keys, values; one floating dtype.
      mask: boolean, True = attend, broadcastable to ``(..., T, S)``; or a
        :class:`jattn.masks.Mask` predicate such as ``masks.causal()`` (per-example masks index
        the first axis of q as the batch).
      bias: additive logits bias, broadcastable to ``(..., T, S)``.
      scale: logit scale; default ``1 / sqrt(D)``.
      q_offset, kv_offset: absolute positions of the first query and key, scalars or per
        example ``(B,)``, for a :class:`~jattn.masks.Mask` only. Default ``kv_offset = 0`` and
        ``q_offset = S - T``: queries aligned bottom-right, at the end of the keys, as for a KV
        cache (so ``causal()`` with ``T < S`` lets the last query see every key).
      dropout_rate: probability of dropping an attention weight (training only); kept weights
        are scaled by ``1 / (1 - dropout_rate)``. Entry ``(t, s)`` of leading row ``b`` (the
        broadcast leading dimensions flattened row-major) is kept by a stateless hash of the
        key, ``b``, ``t`` and ``s`` (:mod:`jattn._dropout`), so 'dense' and 'blockwise' (any
        ``block_size``) drop exactly the same entries.
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      precision: matmul precision passed to the einsums (matters on TPU).
      return_lse: also return the ``(..., T)`` log-sum-exp of the logits.
      implementation: ``'dense'`` materialises the ``(..., T, S)`` scores (the reference);
        ``'blockwise'`` runs an online softmax over blocks (:mod:`jattn._blockwise`): O(T)
        memory, empty blocks of a mask predicate skipped, same contract; ``'xla'`` /
        ``'cudnn'`` hand the call to :func:`jax.nn.dot_product_attention` and raise a
        ``ValueError`` for arguments it cannot express; ``'pallas'`` runs JAX's fused Pallas
        kernel of the platform (:mod:`jattn._pallas`): the flash-attention kernel for GPU
        (causal() at any static offsets, padding()), on CPU that same kernel in Pallas
        interpret mode (exact but slow, meant for tests), splash attention on TPU (any static
        predicate, padding(), segment_ids()); lengths and head dims are padded by jattn; ``None``
        chooses: on GPU and TPU 'pallas' where every argument's cell is "yes", then blockwise where it
        applies and the scores would have at least ``AUTO_BLOCKWISE_MIN`` entries per head,
        dense otherwise.
      block_size: ``(block_q, block_kv)`` (or one int for both) of the blockwise path;
        ``None`` chooses the tile from the mask, the platform and the CPU threads (:func:`jattn._tiles.auto_block`;
        on several CPU threads a causal or windowed backward's at 512, :data:`BACKWARD_SIDE`),
        so results may differ in the last bits between machines; pass it to fix them. On
        'pallas' the kernel's blocks (default: 128, or the padded length's power of two).
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score``, see above.
      sinks: floating sink logits, broadcastable to the leading dimensions ``...``.
      return_max_logit: also return the ``(..., T)`` row max logit (QK-clip monitoring),
        without a gradient on every path (the log-sum-exp has one).

    Returns:
      ``out`` of shape ``(..., T, E)``, followed by ``lse`` when ``return_lse`` and then
      ``max_logit`` when ``return_max_logit`` (a tuple when either is asked for).

    Raises:
      TypeError: non-floating or mismatched dtypes of q, k, v; non-bool mask; a function as
        mask (``masks.causal`` uncalled); non-float bias; offsets that are not ints or integer
        arrays.
      ValueError: ranks below 2, mismatched D or S, leading dimensions or a mask/bias shape
        that does not broadcast (the message names the layouts above).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    _check_scale(scale)
    mask = _as_mask(mask, bias, q, k)
    _check_offsets(mask, q_offset, kv_offset)
    dropout_rate = _check_dropout(dropout_rate, dropout_rng)
    blocks = check_block_size(block_size)
    check_score_mod(score_mod)
    sinks = None if sinks is None else jnp.asarray(sinks)
    used = _features(
        q, v, mask, bias, q_offset, kv_offset, dropout_rate, precision, return_lse, block_size,
        score_mod, sinks, return_max_logit,
    )  # fmt: skip
    path = _choose(implementation, q, k, used)

    def result(out, lse, top):
        extra = ((lse,) if return_lse else ()) + ((top,) if return_max_logit else ())
        return (out, *extra) if extra else out

    if path == "blockwise":
        T, S = q.shape[-2], k.shape[-2]
        split = bias is None and score_mod is None and not dropout_rate
        (bq, bk), back = choose_tiles(mask, T, S, q_offset, kv_offset, blocks, split)
        bias = _check_bias(bias)  # sinks are checked against the call's leading dims, mask arrays included, there
        out, lse, top = blockwise_attention(
            q,
            k,
            v,
            mask=mask,
            scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            block_q=bq,
            block_kv=bk,
            precision=precision,
            score_mod=score_mod,
            sinks=sinks,
            bias=bias,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            backward_block=back,
            fused=blocks is None,
        )
        return result(out, lse, top)
    if path == "pallas":
        return pallas_attention(q, k, v, mask=mask, scale=scale, q_offset=q_offset, kv_offset=kv_offset, blocks=blocks)
    if path in ("xla", "cudnn"):
        return _jax_nn(q, k, v, mask, bias, scale, path, q_offset, kv_offset, return_lse)
    T, S = q.shape[-2], k.shape[-2]
    mask, bias = _dense_mask(mask, q, k, q_offset, kv_offset, v, bias), _check_bias(bias)
    lead = broadcast_all(q=q, k=k, v=v, mask=mask, bias=bias)
    ndim = len(lead) + 2
    q, k, v, mask, bias = (_pad_rank(x, ndim) for x in (q, k, v, mask, bias))
    mod_index = (*lead_index(lead), *_positions(q_offset, kv_offset, T, S, ndim)) if score_mod else ()
    if sinks is not None:
        check_sinks(sinks, lead, q.dtype)
        sinks = jnp.broadcast_to(sinks, lead)[..., None, None]
    parts, compute, top = _logits(q, k, mask, bias, scale, precision, score_mod, mod_index, sinks)
    weights = parts.weights()
    p = _dropout(weights if sinks is None else weights[..., :-1], dropout_rate, dropout_rng, lead)
    # The weighted sum takes the normalised float32 weights (v upcast for bf16/f16), so the
    # gradient is the softmax's own p (dp - rowsum(p dp)) with dp = dO·vᵀ in float32: its two terms
    # cancel exactly where they should (a one-hot row gives 0). Rounding the weights to 16 bits, or
    # normalising after the sum, rounds or splits dp and breaks that cancellation (and dp overflows
    # float16 for large v).
    out = jnp.einsum("...ts,...se->...te", p, v.astype(compute), precision=precision, preferred_element_type=compute)
    out = out.astype(v.dtype)
    rows = out.shape[:-1]
    return result(out, jnp.broadcast_to(parts.logsumexp(), rows), jnp.broadcast_to(top, rows))


def choose_implementation(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    dropout_rate: float = 0.0,
    precision: jax.lax.PrecisionLike = None,
    return_lse: bool = False,
    block_size: int | tuple[int, int] | None = None,
    score_mod: Callable[..., Array] | None = None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> str:
    """The path :func:`attention` with ``implementation=None`` takes for these arguments.

    One of :data:`IMPLEMENTATIONS`: on GPU and TPU, 'pallas' where it honours every argument (every cell
    "yes": no mask, or only static offsets, block_size, E != D); then blockwise where it honours
    every argument and the scores
    would have at least ``AUTO_BLOCKWISE_MIN`` entries per head (or ``block_size`` is given),
    dense otherwise (the dense path honours every argument; see :data:`SUPPORT`). Shapes as
    for :func:`attention`; nothing is computed.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    mask = _as_mask(mask, bias, q, k)
    used = _features(
        q, v, mask, bias, q_offset, kv_offset, dropout_rate, precision, return_lse, block_size,
        score_mod, sinks, return_max_logit,
    )  # fmt: skip
    return _choose(None, q, k, used)


def attention_weights(
    q: ArrayLike,
    k: ArrayLike,
    *,
    mask: ArrayLike | Mask | None = None,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    q_offset: ArrayLike | None = None,
    kv_offset: ArrayLike = 0,
    precision: jax.lax.PrecisionLike = None,
) -> Array:
    """The attention weights ``(..., T, S)`` that :func:`attention` applies to v.

    q ``(..., T, D)`` and k ``(..., S, D)`` and the keyword arguments are as for
    :func:`attention`. Each row sums to 1 over its attended keys; a fully masked row is all
    zeros. The weights are in float32 for bfloat16/float16/float32 inputs and float64 for
    float64 inputs.
    """
    q, k = jnp.asarray(q), jnp.asarray(k)
    check_qkv(q, k, None)
    _check_scale(scale)
    mask = _as_mask(mask, bias, q, k)
    _check_offsets(mask, q_offset, kv_offset)
    mask, bias = _dense_mask(mask, q, k, q_offset, kv_offset, None, bias), _check_bias(bias)
    ndim = len(broadcast_all(q=q, k=k, mask=mask, bias=bias)) + 2
    q, k, mask, bias = (_pad_rank(x, ndim) for x in (q, k, mask, bias))
    parts, _, _ = _logits(q, k, mask, bias, scale, precision)
    return parts.weights()
