"""``jax.nn.dot_product_attention``'s signature and layout, running on :func:`jattn.attention`.

jax.nn lays heads out as ``(B, T, N, H)`` / ``(B, S, K, H)`` and aligns a causal mask or a
local window **top-left** (query ``t`` sees key ``s <= t``, also when ``T != S``). jattn lays
heads out as ``(..., T, D)`` and aligns its mask predicates bottom-right by default. This module
translates one into the other: q becomes ``(B, K, G, T, H)`` against k, v ``(B, K, 1, S, H)``
(grouped-query attention without repeating k or v), ``is_causal`` and ``local_window_size``
become :func:`jattn.masks.causal` / :func:`jattn.masks.sliding_window` placed with
``q_offset=0, kv_offset=0``, and sequence lengths become boolean array masks (which the
blockwise path tiles at run time, so padded tiles are skipped).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jattn import masks
from jattn._checks import check_mask
from jattn._core import attention
from jattn._layouts import from_grouped, heads_grid, to_grouped
from jattn._masks import Mask
from jattn._masks import mask_of_array as array_mask
from jattn._paths import check_implementation
from jattn._scalars import check_bool, check_int, int_array

__all__ = ["dot_product_attention"]

#: Appended to the shape errors of :func:`dot_product_attention`, which torch's layout lands in.
_TORCH_LAYOUT = (
    "; dot_product_attention takes jax.nn's layout, the heads after the length; for torch's (B, N, T, D) call "
    "jattn.attention(q, k, v), with grouped heads as q.reshape(B, K, N // K, T, D) against k[:, :, None], v[:, :, None]"
)


def _window(local_window_size: int | tuple[int, int]) -> tuple[int, int]:
    """``(left, right)`` of jax.nn's ``local_window_size`` (an int is symmetric)."""
    if isinstance(local_window_size, tuple | list):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size must be an int or a pair (left, right), got {local_window_size!r}")
        left, right = local_window_size
    else:
        left = right = local_window_size
    return check_int("local_window_size left", left, min=0), check_int("local_window_size right", right, min=0)


def _typed(name: str, x: ArrayLike, kind: type) -> Array:
    """``x`` as an array, or a TypeError unless its dtype is boolean (``kind`` bool) or floating."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, kind):
        what = "boolean (True = attend)" if kind is jnp.bool_ else "floating point"
        raise TypeError(f"{name} must be {what}, got dtype {x.dtype} with shape {x.shape}")
    return x


def _valid_positions(name: str, x: ArrayLike, B: int, L: int, axis: int) -> Array:
    """Valid positions ``arange(L) < x[b]`` as a boolean ``(B, 1, 1, L, 1)`` (axis -2) or ``(B, 1, 1, 1, L)``."""
    x = int_array(name, x, ndim=1, shape=f"(B,) = ({B},)")
    if x.shape[0] != B:
        raise ValueError(f"{name} must have shape (B,) = ({B},), got {x.shape}")
    valid = jnp.arange(L, dtype=jnp.int32)[None, :] < x.astype(jnp.int32)[:, None]  # (B, L)
    return valid.reshape(B, 1, 1, L, 1) if axis == -2 else valid.reshape(B, 1, 1, 1, L)


def _batched(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array, bool]:
    """The arrays q ``(B, T, N, H)``, k ``(B, S, K, H)``, v ``(B, S, K, E)`` (B = 1 added where unbatched), and whether batched.

    Raises unless the ranks agree, B, S, K and H match, and N is a multiple of K; the errors
    report the shapes given.
    """
    given = f"query {q.shape}, key {k.shape}, value {v.shape}"
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"query, key and value must all be (B, T|S, N|K, H) or all (T|S, N|K, H), got {given}")
    batched = q.ndim == 4
    query_shape, key_shape = q.shape, k.shape
    if not batched:
        q, k, v = q[None], k[None], v[None]
    B, _, N, H = q.shape
    _, S, K, _ = k.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[-1] != H or v.shape[1:3] != (S, K):
        raise ValueError(
            f"expected query (B, T, N, H), key (B, S, K, H), value (B, S, K, E) with one B, S, K and H, got {given}"
            + _TORCH_LAYOUT
        )
    if K == 0 or N % K:
        raise ValueError(
            f"the query heads N must be a multiple of the key/value heads K, got N={N} (query {query_shape}) "
            f"and K={K} (key {key_shape})" + _TORCH_LAYOUT
        )
    return q, k, v, batched


def _combined_mask(
    mask: ArrayLike | None,
    query_seq_lengths: ArrayLike | None,
    key_value_seq_lengths: ArrayLike | None,
    is_causal: bool,
    local_window_size: int | tuple[int, int] | None,
    shape: tuple[int, int, int, int, int],
) -> tuple[Mask | None, dict]:
    """jax.nn's mask arguments as one jattn mask over ``(B, K, G, T, S)``, with the offsets that align it top-left.

    ``shape`` is ``(B, N, K, T, S)``. The arrays (mask, lengths) are checked in that order, then
    the window.
    """
    B, N, K, T, S = shape
    arrays = []
    if mask is not None:
        arrays.append(heads_grid("mask", _typed("mask", mask, jnp.bool_), (B,), N, K, T, S))
    if query_seq_lengths is not None:
        arrays.append(_valid_positions("query_seq_lengths", query_seq_lengths, B, T, axis=-2))
    if key_value_seq_lengths is not None:
        arrays.append(_valid_positions("key_value_seq_lengths", key_value_seq_lengths, B, S, axis=-1))
    predicates = []
    if is_causal:
        predicates.append(masks.causal())
    if local_window_size is not None:
        predicates.append(masks.sliding_window(*_window(local_window_size)))
    combined = None
    for term in [*predicates, *(array_mask(a) for a in arrays)]:
        combined = term if combined is None else combined & term
    return combined, (dict(q_offset=0, kv_offset=0) if predicates else {})


def _jax_nn_outputs(
    result: Array | tuple[Array, Array], N: int, batched: bool, return_residual: bool
) -> Array | tuple[Array, Array]:
    """:func:`jattn.attention`'s ``out (B, K, G, T, E)`` (and ``lse (B, K, G, T)``) in jax.nn's layout.

    ``out (B, T, N, E)`` and the residual ``(B, T, N)`` in the dtype of out, without B when not
    ``batched``.
    """
    out, lse = result if return_residual else (result, None)
    out = from_grouped(out, N)  # (B, K, G, T, E) -> (B, T, N, E)
    if not batched:
        out = out[0]
    if not return_residual:
        return out
    B, T = lse.shape[0], lse.shape[-1]
    lse = lse.reshape(B, N, T).transpose(0, 2, 1).astype(out.dtype)  # (B, T, N)
    return out, (lse if batched else lse[0])


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> Array | tuple[Array, Array]:
    """:func:`jax.nn.dot_product_attention`'s signature and semantics on jattn's core.

    Shapes (jax.nn's letters; ``G = N // K`` query heads share a key/value head)::

        query     (B, T, N, H) or (T, N, H)
        key       (B, S, K, H) or (S, K, H)      N a multiple of K (GQA; K == 1 is MQA)
        value     (B, S, K, E) or (S, K, E)      E == H in jax.nn; any E here
        bias      broadcastable to (B, N, T, S): (B|1, N|1, T|1, S|1), fewer dims left-padded
        mask      boolean, same layout as bias, True = attend
        query_seq_lengths, key_value_seq_lengths   integer (B,); (1,) for unbatched inputs
        out       like query (last axis E), in the inputs' dtype
        residual  (B, T, N) or (T, N): the log-sum-exp of each row's logits

    The heads come after the length. Torch's ``(B, N, T, D)`` belongs to :func:`jattn.attention`;
    given here in arrays of one shape it is read as ``(B, T, N, H)`` without an error (as
    jax.nn reads it), and where shapes differ the error points to :func:`jattn.attention`.

    Alignment is jax.nn's (and torch's): **top-left**. With ``is_causal``, query ``t`` sees
    keys ``s <= t`` even when ``T != S``; ``local_window_size=(left, right)`` (an int is
    ``(w, w)``) lets query ``t`` see keys ``t - left <= s <= t + right``. (``jattn.attention``
    aligns its predicates bottom-right by default; this function passes ``q_offset=0,
    kv_offset=0``.) ``query_seq_lengths[b]`` masks queries ``t >= length`` (their output is
    0) and ``key_value_seq_lengths[b]`` keys ``s >= length``.

    Differences from jax.nn, by contract:
      * A query row with no key left to attend to gives 0 (and a residual of ``-inf``), not
        the mean of v (jax.nn fills masked logits with a large negative number).
      * The residual keeps its gradient (jax.nn stops it); it is in the inputs' dtype, like
        jax.nn's.
      * ``value`` may have a depth E different from H; float64 inputs compute in float64.

    Args:
      query, key, value: one floating dtype, layouts above.
      bias: additive logits bias, floating.
      mask: boolean mask, True = attend.
      scale: logit scale; default ``1 / sqrt(H)``.
      is_causal: top-left causal mask.
      query_seq_lengths: valid query lengths per example.
      key_value_seq_lengths: valid key/value lengths per example.
      local_window_size: ``w`` or ``(left, right)``, non-negative ints, top-left aligned.
      implementation: ``None`` (jattn chooses dense or blockwise, see
        :func:`jattn.choose_implementation`), ``'xla'``, ``'cudnn'`` (handed to jax.nn, as
        jattn does), or jattn's ``'dense'`` / ``'blockwise'``.
      return_residual: also return the log-sum-exp residual.

    Returns:
      ``out`` shaped like ``query`` (last axis E), or ``(out, residual)``.

    Raises:
      TypeError: non-floating or mismatched dtypes, a non-boolean mask (a function or a
        :class:`jattn.masks.Mask` included: ``is_causal=True`` is the causal mask), non-integer
        lengths.
      ValueError: wrong ranks, mismatched B, S or H, N not a multiple of K, a mask, bias or
        lengths shape that does not broadcast, a bad window or implementation.
    """
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    check_mask(mask, arrays_only=True)
    q, k, v, batched = _batched(q, k, v)
    B, T, N, _ = q.shape
    _, S, K, _ = k.shape
    check_implementation(implementation)
    is_causal = check_bool("is_causal", is_causal)
    return_residual = check_bool("return_residual", return_residual)
    qj, kj, vj = to_grouped(q, k, v, K)  # (B, K, G, T, H), (B, K, 1, S, H), (B, K, 1, S, E)
    combined, offsets = _combined_mask(
        mask, query_seq_lengths, key_value_seq_lengths, is_causal, local_window_size, (B, N, K, T, S)
    )
    jbias = None if bias is None else heads_grid("bias", _typed("bias", bias, jnp.floating), (B,), N, K, T, S)
    result = attention(
        qj,
        kj,
        vj,
        mask=combined,
        bias=jbias,
        scale=scale,
        return_lse=return_residual,
        implementation=implementation,
        **offsets,
    )
    return _jax_nn_outputs(result, N, batched, return_residual)
