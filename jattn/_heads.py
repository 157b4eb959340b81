"""Head bookkeeping shared by the NNX and Linen modules (pure functions, no parameters).

Projected activations are laid out for the core as ``(B, K, G, T, D)`` queries against
``(B, K, 1, S, D)`` keys and values, so grouped-query attention is plain broadcasting and
nothing is repeated in memory. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from jattn import _cache
from jattn._checks import (
    check_block_size,
    check_bool,
    check_dtype,
    check_int,
    check_mask,
    check_real,
    check_score_mod,
)
from jattn._core import IMPLEMENTATIONS, attention, attention_weights
from jattn._linear import LinearState, feature_fn, linear_attention
from jattn._masks import Causal, Mask
from jattn._ring import sequence_parallel_attention
from jattn._rope import rope as rotate
from jattn._score_mods import ScoreMod


def check_heads(d_model: int, num_heads: int, num_kv_heads: int | None, qkv_features: int | None) -> tuple[int, int]:
    """Validates the head configuration; returns ``(num_kv_heads, head_depth)``."""
    d_model, num_heads = check_int("d_model", d_model, min=1), check_int("num_heads", num_heads, min=1)
    kv = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, min=1)
    features = d_model if qkv_features is None else check_int("qkv_features", qkv_features, min=1)
    if num_heads % kv:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of num_heads={num_heads}")
    if features % num_heads:
        raise ValueError(f"qkv_features={features!r} must be a positive multiple of num_heads={num_heads}")
    return kv, features // num_heads


def check_options(
    *,
    kv_features: int,
    out_features: int | None,
    out_proj: bool | None,
    use_bias: bool,
    dropout_rate: float,
    deterministic: bool,
    dtype: Any,
    param_dtype: Any,
    sequence_axis: str | None,
) -> None:
    """Validates the module options shared by NNX and Linen (types, ranges and dtypes)."""
    check_int("context_features (kv features)", kv_features, min=1)
    if out_features is not None:
        check_int("out_features", out_features, min=1)
    if out_proj is not None:
        check_bool("out_proj", out_proj)
    check_bool("use_bias", use_bias)
    check_bool("deterministic", deterministic)
    check_real("dropout_rate", dropout_rate, low=0.0, high=1.0)
    check_dtype("dtype", dtype, optional=True)
    check_dtype("param_dtype", param_dtype)
    if sequence_axis is not None and not isinstance(sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}")


def check_call(
    deterministic: bool | None, return_weights: bool, decode: bool | None = False, sow_weights: bool = False
) -> None:
    """Validates the switches of a module call."""
    if deterministic is not None:
        check_bool("deterministic", deterministic)
    check_bool("return_weights", return_weights)
    if decode is not None:
        check_bool("decode", decode)
    check_bool("sow_weights", sow_weights)


def check_input(name: str, x: Array, features: int) -> None:
    """Raises unless ``x`` is a floating ``(..., T, features)`` array, ``T >= 1``, batch dims ``>= 1``."""
    shape = jnp.shape(x)
    if len(shape) < 2 or shape[-1] != features or 0 in shape:
        raise ValueError(
            f"{name} must have shape (..., length >= 1, {features}), got {shape} (any batch dims, each >= 1)"
        )
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{name} must be floating point, got {jnp.result_type(x)} with shape {shape}")


def check_context(x: Array, d_model: int, context: Array, features: int, context_mask: Array | None) -> None:
    """Raises unless ``x (..., T, d_model)``, ``context (..., S, features)``, boolean ``context_mask (..., S)``."""
    check_input("x", x, d_model)
    check_input("context", context, features)
    if context.shape[:-2] != x.shape[:-2]:
        raise ValueError(f"x and context must share the batch dims, got {x.shape} and {context.shape}")
    if context_mask is not None:
        if jnp.shape(context_mask) != context.shape[:-1]:
            raise ValueError(
                f"context_mask must have shape (..., S) = {context.shape[:-1]}, got {jnp.shape(context_mask)}"
            )
        if jnp.result_type(context_mask) != jnp.bool_:
            raise TypeError(f"context_mask must be boolean (True = attend), got {jnp.result_type(context_mask)}")


def _split(x: Array, heads: int, groups: int) -> Array:
    """``(B, L, heads*groups*D) -> (B, heads, groups, L, D)``."""
    b, length, f = x.shape
    return x.reshape(b, length, heads, groups, f // (heads * groups)).transpose(0, 2, 3, 1, 4)


def _check_mask_shape(got: tuple[int, ...], shape: tuple[int, int, int, int]) -> None:
    """Raises unless a mask of shape ``got`` is ``(T, S)``, ``(B, T, S)`` or ``(B, N, T, S)`` for ``shape = (B, N, T, S)``."""
    b, n, t, s = shape
    want = {2: (t, s), 3: (b, t, s), 4: (b, n, t, s)}.get(len(got))
    if want is None or any(m not in (1, w) for m, w in zip(got, want, strict=True)):
        padding = (
            "; a (B, S) key-padding mask goes as mask[:, None, :] (B, 1, S) or masks.padding(kv_lengths=lengths) "
            "(True = attend: torch's key_padding_mask is True at padding, so ~mask)"
        )
        raise ValueError(
            f"mask must have shape (T, S) = {(t, s)}, (B, T, S) = {(b, t, s)} or (B, N, T, S) = {shape} "
            f"(each axis may be 1), got shape {tuple(got)}" + (padding if tuple(got) == (b, s) else "")
        )


def _split_mask(mask: Array | None, shape: tuple[int, int, int, int], num_kv_heads: int) -> Array | None:
    """A boolean mask for ``shape = (B, N, T, S)`` -> broadcastable to ``(B, K, G, T, S)``.

    The rule: a 2-D mask is ``(T, S)``, a 3-D mask ``(B, T, S)`` per example (broadcast over
    heads) and a 4-D mask ``(B, N, T, S)``; any axis may be 1 (broadcast). A function (e.g.
    ``masks.causal`` uncalled) raises a TypeError (:func:`jattn._checks.check_mask`).
    """
    check_mask(mask)
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype} with shape {mask.shape}")
    _check_mask_shape(mask.shape, shape)
    n = shape[1]
    if mask.ndim == 3:
        mask = mask[:, None]  # (B, 1, T, S): the same mask for every head
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    heads = (num_kv_heads, n // num_kv_heads) if mask.shape[1] == n != 1 else (1, 1)
    return mask.reshape(mask.shape[0], *heads, *mask.shape[2:])


def _weights(
    q: Array, k: Array, mask: Array | Mask | None, precision: jax.lax.PrecisionLike, score_mod, sinks
) -> Array:
    """The weights ``(B, K, G, T, S)`` that the core applies to v (before dropout), ``score_mod`` and ``sinks`` included.

    Without either, :func:`jattn.attention_weights`; with them, the dense core itself on the values
    ``I (S, S)``: row t of its output is the weights of row t (a sink's share left out).
    """
    if score_mod is None and sinks is None:
        return attention_weights(q, k, mask=mask, precision=precision)
    compute = jnp.promote_types(q.dtype, jnp.float32)  # the weights' dtype, as attention_weights
    eye = jnp.eye(k.shape[-2], dtype=compute)  # (S, S): value s picks key s's weight
    q, k = q.astype(compute), k.astype(compute)  # the core computes the logits in this dtype anyway
    return attention(
        q, k, eye, mask=mask, precision=precision, implementation="dense", score_mod=score_mod, sinks=sinks
    )


def at_positions(score_mod: ScoreMod, q_pos: Array, kv_pos: Array) -> ScoreMod:
    """``score_mod`` at absolute positions ``q_pos (B, T)`` and ``kv_pos (B, S)`` (a cache's, in any slot order).

    The core, called with an array mask, gives ``score_mod`` grid positions: query t at
    ``S - T + t`` and key s at ``s`` (its default offsets); this maps them, per batch row, to the
    positions the tokens really have, so a decoding step modifies the scores as the full pass does.
    """
    t, s = q_pos.shape[1], kv_pos.shape[1]

    def mod(score, batch, head, i, j):
        rows = jnp.clip(i - (s - t), 0, t - 1)  # grid row -> query index (padded tile rows clipped)
        return score_mod(score, batch, head, q_pos[batch, rows], kv_pos[batch, jnp.clip(j, 0, s - 1)])

    return mod


KINDS = ("softmax", "linear")


def check_path(implementation: str | None, block_size: int | tuple[int, int] | None) -> None:
    """Validates a module's ``implementation`` and ``block_size`` (as :func:`jattn.attention` takes them)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    check_block_size(block_size)


def check_kind(kind: str, feature_map: object) -> None:
    """Validates the attention kind."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "linear":
        feature_fn(feature_map)


def _ring_size(axis: str | None) -> int:
    """Devices along mesh axis ``axis`` of the current mesh (1 without one)."""
    if axis is None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def multihead(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    mask: Array | Mask | None,
    kv_mask: Array | None = None,
    kind: str = "softmax",
    feature_map: str | Callable[[Array], Array] = "elu",
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_weights: bool = False,
    linear_state: LinearState | None = None,
    sequence_axis: str | None = None,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Array | None = None,
) -> tuple[Array, Array | None, LinearState | None]:
    """Attention over heads of projected ``q (B, T, N*D)``, ``k, v (B, S, K*D)``.

    ``mask`` is a boolean ``(T, S)``, ``(B, T, S)`` (per example, broadcast over heads) or
    ``(B, N, T, S)`` array (any axis may be 1), or a :class:`~jattn.masks.Mask`, which goes to
    the core as it is (so the blockwise path can skip its empty tiles); ``kv_mask (B, S)`` marks
    valid keys (context padding). ``implementation`` and ``block_size`` are those of
    :func:`jattn.attention` (``block_size`` is dropped for a path other than the blockwise one). For ``kind='linear'`` the mask must
    be None or ``causal()`` and ``linear_state`` continues a causal sequence. ``score_mod`` goes to
    the core as it is (its ``head`` is the query head n = k·G + g) and ``sinks (N,)`` as ``(K, G)``
    (softmax kind, not over a ring).

    Returns ``out (B, T, N*E)``, the weights ``(B, N, T, S)`` (before dropout) if asked, and
    the linear state after the last key (linear kind only).

    With ``sequence_axis`` naming an axis of more than one device in the current mesh
    (``jax.set_mesh``), softmax attention runs as ring attention over it
    (:func:`jattn.sequence_parallel_attention`); elsewhere it is the plain core.
    """
    groups = num_heads // num_kv_heads
    qh = _split(q, num_kv_heads, groups)  # (B, K, G, T, D)
    kh = _split(k, num_kv_heads, 1)  # (B, K, 1, S, D)
    vh = _split(v, num_kv_heads, 1)  # (B, K, 1, S, E)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    valid = None if kv_mask is None else jnp.asarray(kv_mask).reshape(b, 1, 1, s)  # (B, 1, 1, S)
    state = None
    sinks = None if sinks is None else sinks.reshape(num_kv_heads, groups)  # (N,) -> (K, G): head n = k·G + g
    if kind == "linear":
        if score_mod is not None or sinks is not None:
            raise ValueError("score_mod and sinks need kind='softmax'; linear attention forms no scores")
        if return_weights:
            raise ValueError("return_weights needs kind='softmax'; linear attention forms no weights")
        if mask is not None and not isinstance(mask, Causal):
            raise ValueError(f"kind='linear' takes mask=None or masks.causal(), got {mask!r}")
        out, state = linear_attention(
            qh,
            kh,
            vh,
            feature_map=feature_map,
            causal=mask is not None,
            kv_mask=valid,
            initial_state=linear_state,
            return_state=True,
            precision=precision,
        )
        weights = None
    elif _ring_size(sequence_axis) > 1:
        if kv_mask is not None:
            raise ValueError(f"sequence_axis={sequence_axis!r} does not take a context mask (kv_mask)")
        if dropout_rate:
            raise ValueError(f"sequence_axis={sequence_axis!r} does not take dropout_rate={dropout_rate}")
        if score_mod is not None or sinks is not None:
            raise ValueError(
                f"sequence_axis={sequence_axis!r} (ring attention over {_ring_size(sequence_axis)} devices) does not "
                f"take score_mod or sinks, got score_mod={score_mod!r}, sinks={sinks is not None}"
            )
        out = sequence_parallel_attention(qh, kh, vh, axis_name=sequence_axis, mask=mask, precision=precision)
        weights = attention_weights(qh, kh, mask=mask, precision=precision) if return_weights else None
        weights = None if weights is None else weights.reshape(b, num_heads, t, s)
    else:
        if not isinstance(mask, Mask):  # a predicate broadcasts over (B, K, G) as it is
            mask = _split_mask(mask, (b, num_heads, t, s), num_kv_heads)  # (B|1, K|1, G|1, T|1, S|1)
        elif mask.per_example:  # its batch is checked on the shape of its dense form (nothing is formed)
            _check_mask_shape(jax.eval_shape(lambda: mask.dense(t, s)).shape, (b, num_heads, t, s))
        if valid is not None:
            valid = valid.reshape(b, 1, 1, 1, s)
            mask = valid if mask is None else mask & valid
        out = attention(
            qh,
            kh,
            vh,
            mask=mask,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            precision=precision,
            implementation=implementation,
            block_size=block_size if implementation in (None, "blockwise") else None,  # tiles of the blockwise path
            score_mod=score_mod,
            sinks=sinks,
        )
        weights = None
        if return_weights:
            weights = _weights(qh, kh, mask, precision, score_mod, sinks).reshape(b, num_heads, t, s)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, -1)  # (B, K, G, T, E) -> (B, T, N*E)
    return out, weights, state


# -- the module call, shared by NNX and Linen ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """The checked, static configuration of an attention module (NNX or Linen).

    ``deterministic`` is not here: it is the module's own switch (the NNX attribute that
    ``.eval()``/``.train()``/``nnx.view`` set, the Linen field), read at each call.
    """

    d_model: int
    kv_features: int
    num_heads: int
    num_kv_heads: int
    head_depth: int
    out_features: int | None  # features of ``wo``; None: no output projection
    kind: str
    feature_map: str | Callable[[Array], Array]
    dropout_rate: float
    precision: jax.lax.PrecisionLike
    sequence_axis: str | None
    implementation: str | None
    block_size: int | tuple[int, int] | None
    normalize_qk: bool
    rope: bool
    rope_base: float
    decode: bool
    score_mod: ScoreMod | None
    sinks: bool


def options(
    d_model: int,
    kv_features: int,
    *,
    num_heads: int,
    num_kv_heads: int | None,
    qkv_features: int | None,
    out_features: int | None,
    out_proj: bool | None,
    use_bias: bool,
    kind: str,
    feature_map: str | Callable[[Array], Array],
    dropout_rate: float,
    deterministic: bool,
    dtype: Any,
    param_dtype: Any,
    precision: jax.lax.PrecisionLike,
    sequence_axis: str | None,
    implementation: str | None,
    block_size: int | tuple[int, int] | None,
    normalize_qk: bool,
    rope: bool,
    rope_base: float,
    decode: bool,
    score_mod: ScoreMod | None = None,
    sinks: bool = False,
) -> Options:
    """Checks a module's options (ValueError/TypeError naming the option) and resolves defaults."""
    kv_heads, depth = check_heads(d_model, num_heads, num_kv_heads, qkv_features)
    check_kind(kind, feature_map)
    check_options(
        kv_features=kv_features,
        out_features=out_features,
        out_proj=out_proj,
        use_bias=use_bias,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        param_dtype=param_dtype,
        sequence_axis=sequence_axis,
    )
    check_path(implementation, block_size)
    check_bool("normalize_qk", normalize_qk)
    check_bool("rope", rope)
    check_bool("decode", decode)
    check_score_mod(score_mod)
    check_bool("sinks", sinks)
    if kind == "linear" and (score_mod is not None or sinks):
        raise ValueError(
            f"score_mod and sinks need kind='softmax' (linear attention forms no scores), got kind={kind!r} with "
            f"score_mod={score_mod!r}, sinks={sinks!r}"
        )
    rope_base = check_real("rope_base", rope_base, low=0.0, open_low=True)
    if rope and depth % 2:
        raise ValueError(f"rope=True needs an even head depth D = qkv_features / num_heads, got D={depth}")
    if out_proj is None:
        out_proj = num_heads > 1 or out_features is not None
    if out_features is not None and not out_proj:
        raise ValueError(f"out_features={out_features} needs out_proj=True")
    return Options(
        d_model=int(d_model),
        kv_features=int(kv_features),
        num_heads=int(num_heads),
        num_kv_heads=kv_heads,
        head_depth=depth,
        out_features=(int(out_features or d_model) if out_proj else None),
        kind=kind,
        feature_map=feature_map,
        dropout_rate=float(dropout_rate),
        precision=precision,
        sequence_axis=sequence_axis,
        implementation=implementation,
        block_size=tuple(block_size) if isinstance(block_size, list) else block_size,
        normalize_qk=bool(normalize_qk),
        rope=bool(rope),
        rope_base=rope_base,
        decode=bool(decode),
        score_mod=score_mod,
        sinks=bool(sinks),
    )


def init_cache(
    opts: Options, batch_size: int, max_length: int, window: int | None, pinned: tuple[int, ...], dtype: Any
) -> _cache.Cache:
    """An empty decoding cache for a module with options ``opts`` (see :mod:`jattn._cache`)."""
    return _cache.init(
        kind=opts.kind,
        num_heads=opts.num_heads,
        num_kv_heads=opts.num_kv_heads,
        head_depth=opts.head_depth,
        feature_map=opts.feature_map,
        batch_size=batch_size,
        max_length=max_length,
        window=window,
        pinned=pinned,
        dtype=dtype,
    )


@dataclasses.dataclass(frozen=True)
class Layers:
    """A module's projections ``(B, L, features) -> (B, L, features')`` and QK norms over ``D``."""

    wq: Callable[[Array], Array]
    wk: Callable[[Array], Array]
    wv: Callable[[Array], Array]
    wo: Callable[[Array], Array] | None
    query_ln: Callable[[Array], Array] | None
    key_ln: Callable[[Array], Array] | None
    sinks: Array | None = None  # (N,) learned sink logits (``sinks=True``)


def _flat_mask(mask: Array | Mask | None, batch: tuple[int, ...], n: int, t: int, s: int) -> Array | Mask | None:
    """A mask over ``x``'s batch dims ``batch`` as one over the flattened batch (the rule of :func:`multihead`).

    Arrays: ``(T, S)``, ``(*batch, T, S)`` (per example) or ``(*batch, N, T, S)``, any axis 1.
    """
    if mask is None or isinstance(mask, Mask):
        return mask
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype} with shape {mask.shape}")
    if mask.ndim == 2:
        return mask
    want = {len(batch) + 2: (*batch, t, s), len(batch) + 3: (*batch, n, t, s)}.get(mask.ndim)
    if want is None or any(m not in (1, w) for m, w in zip(mask.shape, want, strict=True)):
        raise ValueError(
            f"mask must have shape (T, S) = {(t, s)}, (B, T, S) = {(*batch, t, s)} or "
            f"(B, N, T, S) = {(*batch, n, t, s)} (each axis may be 1; B: the batch dims of x), got shape {mask.shape}"
        )
    rest = mask.shape[len(batch) :]
    if all(d == 1 for d in mask.shape[: len(batch)]):
        return mask.reshape(1, *rest)
    return jnp.broadcast_to(mask, (*batch, *rest)).reshape(-1, *rest)


def _qk(opts: Options, layers: Layers, q: Array, k: Array, q_pos: Array, k_pos: Array) -> tuple[Array, Array]:
    """QK normalisation then rotary embedding of ``q (B, T, N*D)`` and ``k (B, S, K*D)`` per head.

    ``q_pos`` and ``k_pos`` broadcast to ``(B, T)`` and ``(B, S)``: the absolute positions.
    """

    def per_head(a: Array, heads: int, norm: Callable[[Array], Array] | None, pos: Array) -> Array:
        b, length, f = a.shape
        a = a.reshape(b, length, heads, f // heads)  # (B, L, H, D)
        if norm is not None:
            a = norm(a)
        if opts.rope:
            a = rotate(a, jnp.broadcast_to(pos, (b, length))[:, :, None], opts.rope_base)  # positions (B, L, 1)
        return a.reshape(b, length, f)

    if not (opts.normalize_qk or opts.rope):
        return q, k
    return per_head(q, opts.num_heads, layers.query_ln, q_pos), per_head(k, opts.num_kv_heads, layers.key_ln, k_pos)


def forward(
    opts: Options,
    layers: Layers,
    x: Array,
    context: Array | None,
    mask: Array | Mask | None,
    *,
    context_mask: Array | None = None,
    cache: _cache.Cache | None = None,
    lengths: Array | None = None,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    implementation: str | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> tuple[Array, Array | None, _cache.Cache | None]:
    """One module call: ``x (..., T, F)`` attends to itself (``context=None``) or ``context (..., S, F')``.

    The batch dims ``...`` (any number, none for unbatched input) are flattened to one ``B``;
    masks over them follow (:func:`_flat_mask`), ``context_mask (..., S)``, ``lengths (...)``.
    With ``cache`` (self-attention), the tokens continue the cached ones (:mod:`jattn._cache`);
    ``mask`` must then be a predicate (default causal). Returns ``out (..., T, F_out)``, the
    weights ``(..., N, T, S)`` when asked (S: all keys attended, cached ones first) and the
    updated cache (None without one). Dropout is applied when ``dropout_rng`` is given.
    """
    implementation = opts.implementation if implementation is None else implementation
    block_size = opts.block_size if block_size is None else block_size
    check_path(implementation, block_size)
    check_mask(mask)
    batch, t = x.shape[:-2], x.shape[-2]
    ctx = x if context is None else context
    s = ctx.shape[-2]
    xs = x.reshape(-1, t, x.shape[-1])  # (B, T, F): the batch dims flattened
    cs = ctx.reshape(-1, s, ctx.shape[-1])  # (B, S, F')
    b = xs.shape[0]
    q, k, v = layers.wq(xs), layers.wk(cs), layers.wv(cs)
    attend = dict(
        num_heads=opts.num_heads,
        num_kv_heads=opts.num_kv_heads,
        kind=opts.kind,
        feature_map=opts.feature_map,
        dropout_rate=opts.dropout_rate if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng,
        precision=opts.precision,
        return_weights=return_weights,
        implementation=implementation,
        block_size=block_size,
        sinks=None if layers.sinks is None else jnp.asarray(layers.sinks),
    )
    bad, new = None, None
    if cache is None:
        if lengths is not None:
            raise ValueError("lengths applies to decode=True only")
        kv_mask = None if context_mask is None else jnp.asarray(context_mask).reshape(b, s)  # (B, S)
        pos = jnp.arange(t, dtype=jnp.int32)[None]  # (1, T): positions of a self-attention pass
        q, k = _qk(opts, layers, q, k, pos, pos)
        mask = _flat_mask(mask, batch, opts.num_heads, t, s)
        out, weights, _ = multihead(
            q, k, v, mask=mask, kv_mask=kv_mask, sequence_axis=opts.sequence_axis, score_mod=opts.score_mod, **attend
        )
    else:
        if cache["next"].shape[0] != b:
            raise ValueError(
                f"x has batch dims {batch} ({b} sequences) but the cache was made for batch_size={cache['next'].shape[0]}"
            )
        mask = Causal() if mask is None else mask
        if not isinstance(mask, Mask):
            raise TypeError("with decode=True, mask must be a jattn.masks.Mask predicate (default causal())")
        if lengths is not None:
            lengths = jnp.asarray(lengths)
            if lengths.shape != batch:
                raise ValueError(
                    f"lengths must have shape (B,) = {batch}, got {lengths.shape} (B: the batch dims of x)"
                )
            lengths = lengths.reshape(b)
        pos, valid, lengths, bad = _cache.positions(cache, t, lengths)  # (B, T), (B, T), (B,), (B, T)
        q, k = _qk(opts, layers, q, k, pos, pos)
        if opts.kind == "linear":
            out, weights, state = multihead(
                q, k, v, mask=mask, kv_mask=valid, linear_state=_cache.linear_state(cache), **attend
            )
            new = _cache.write_linear(cache, state, lengths)
        else:
            keys, values, allowed = _cache.read(cache, k, v, pos, valid, mask)  # (B, C + T, K*D) x2, (B, 1, T, C + T)
            bad = bad | _cache.dropped_seen(cache, pos, valid, mask)  # a ring that lost what the mask sees
            mod = opts.score_mod
            if mod is not None:  # the core sees the (T, C + T) grid; the mod gets the tokens' absolute positions
                mod = at_positions(mod, pos, _cache.key_positions(cache, pos, valid))
            out, weights, _ = multihead(q, keys, values, mask=allowed, score_mod=mod, **attend)
            new = _cache.write(cache, k, v, pos, valid, lengths)
    if layers.wo is not None:
        out = layers.wo(out)
    if bad is not None:  # NaN where a traced fault could not raise
        out = jnp.where(bad[..., None], jnp.full((), jnp.nan, out.dtype), out)
    out = out.reshape(*batch, t, out.shape[-1])
    if weights is not None:
        weights = weights.reshape(*batch, *weights.shape[1:])  # (..., N, T, S)
    return out, weights, new
