"""The call of an attention module, shared by :mod:`jattn.nnx` and :mod:`jattn.linen`.

A module hands :func:`forward` its checked options (:class:`~jattn._modules.options.ModuleConfig`),
its projections and norms (:class:`Layers`) and the call's arguments (:class:`CallArguments`);
:func:`forward` flattens the batch dims, projects, applies QK norm and rotary embedding, attends
over the heads (:func:`jattn._modules.multihead.multihead`), continues the decoding cache
(:mod:`jattn._modules.cache`) and projects the output. Also here: the checks of a call's inputs and
:func:`init_cache`. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import Array

from jattn._checks import check_mask
from jattn._masks import Causal, Mask
from jattn._modules import cache as _cache
from jattn._modules.decoding import Step
from jattn._modules.kinds import module_kind
from jattn._modules.multihead import multihead, with_causal
from jattn._modules.options import ModuleConfig, check_path, refuse_path
from jattn._rope import rope as rotate
from jattn._scalars import check_bool

__all__ = [
    "CallArguments", "Layers", "check_context", "check_input", "forward", "gate_params", "init_cache", "normalized_rotated",
]  # fmt: skip


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallArguments:
    """The arguments of one module call besides its inputs, under the names NNX and Linen take them.

    ``deterministic`` and ``decode``: None takes the module's default. Checked when made; no defaults
    here (each call passes every argument by name, so a missing or misspelt one is a ``TypeError``).
    """

    mask: Array | Mask | None
    context_mask: Array | None
    deterministic: bool | None
    return_weights: bool
    sow_weights: bool
    decode: bool | None
    lengths: Array | None
    implementation: str | None
    block_size: int | tuple[int, int] | None

    def __post_init__(self) -> None:
        if self.deterministic is not None:
            check_bool("deterministic", self.deterministic)
        check_bool("return_weights", self.return_weights)
        if self.decode is not None:
            check_bool("decode", self.decode)
        check_bool("sow_weights", self.sow_weights)

    def decoding(self, config: ModuleConfig) -> bool:
        """Whether this call continues the cache (the module's ``decode`` unless the call says)."""
        return config.decode if self.decode is None else self.decode


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
    gates: dict[str, Array] | None = None  # a recurrent kind's gate parameters (:mod:`jattn._linear.kinds`)


def gate_params(config: ModuleConfig) -> dict:
    """A module's gate parameters, name -> ``(shape, init)``: its recurrent kind's (:mod:`jattn._linear.kinds`), or none."""
    recurrent = module_kind(config.kind).recurrent
    if recurrent is None:
        return {}
    return recurrent.params(config.d_model, config.num_heads, config.head_depth, config.num_householder)


def init_cache(
    config: ModuleConfig, batch_size: int, max_length: int, window: int | None, pinned: tuple[int, ...], dtype: Any
) -> _cache.Cache:
    """An empty decoding cache for a module configured as ``config`` (see :mod:`jattn._modules.cache`)."""
    heads = (config.num_heads, config.num_kv_heads, config.head_depth)  # (N, K, D)
    kind = module_kind(config.kind)
    return _cache.init(kind, heads, config.feature_map, batch_size, max_length, window, pinned, dtype)


def _flatten_mask_batch(
    mask: Array | Mask | None, batch: tuple[int, ...], n: int, t: int, s: int
) -> Array | Mask | None:
    """A mask over ``x``'s batch dims ``batch`` as one over the flattened batch B (the rule of :func:`multihead`).

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


def normalized_rotated(
    config: ModuleConfig, layers: Layers, q: Array, k: Array, q_pos: Array, k_pos: Array
) -> tuple[Array, Array]:
    """QK normalisation then rotary embedding of ``q (B, T, N*D)`` and ``k (B, S, K*D)`` per head.

    ``q_pos`` and ``k_pos`` broadcast to ``(B, T)`` and ``(B, S)``: the absolute positions.
    """

    def per_head(a: Array, heads: int, norm: Callable[[Array], Array] | None, pos: Array) -> Array:
        b, length, f = a.shape
        a = a.reshape(b, length, heads, f // heads)  # (B, L, H, D)
        if norm is not None:
            a = norm(a)
        if config.rope:
            a = rotate(a, jnp.broadcast_to(pos, (b, length))[:, :, None], config.rope_base)  # positions (B, L, 1)
        return a.reshape(b, length, f)

    if not (config.normalize_qk or config.rope):
        return q, k
    keys = config.num_kv_heads * config.num_householder  # DeltaProduct: n_h keys a token, at its position
    return per_head(q, config.num_heads, layers.query_ln, q_pos), per_head(k, keys, layers.key_ln, k_pos)


def _full_pass(
    config: ModuleConfig,
    layers: Layers,
    qkv: tuple[Array, Array, Array],
    call: CallArguments,
    batch: tuple[int, ...],
    attend: dict[str, Any],
) -> tuple[Array, Array | None]:
    """Attention of ``q (B, T, N*D)`` to ``k, v (B, S, K*D)`` without a cache: ``out (B, T, N*E)`` and the weights."""
    q, k, v = qkv
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if call.lengths is not None:
        raise ValueError("lengths applies to decode=True only")
    kv_mask = None if call.context_mask is None else jnp.asarray(call.context_mask).reshape(b, s)  # (B, S)
    pos = jnp.arange(t, dtype=jnp.int32)[None]  # (1, T): positions of a self-attention pass
    q, k = normalized_rotated(config, layers, q, k, pos, pos)
    mask = _flatten_mask_batch(call.mask, batch, config.num_heads, t, s)
    out, weights, _ = multihead(
        q,
        k,
        v,
        mask=mask,
        kv_mask=kv_mask,
        causal=config.causal,
        sequence_axis=config.sequence_axis,
        score_mod=config.score_mod,
        **attend,
    )
    return out, weights


def _lengths(call: CallArguments, batch: tuple[int, ...], b: int) -> Array | None:
    """The call's ``lengths (...)`` over the batch dims ``batch`` as ``(B,)``."""
    if call.lengths is None:
        return None
    lengths = jnp.asarray(call.lengths)
    if lengths.shape != batch:
        raise ValueError(f"lengths must have shape (B,) = {batch}, got {lengths.shape} (B: the batch dims of x)")
    return lengths.reshape(b)


def _decode_step(
    config: ModuleConfig,
    layers: Layers,
    cache: _cache.Cache,
    qkv: tuple[Array, Array, Array],
    call: CallArguments,
    batch: tuple[int, ...],
    attend: dict[str, Any],
) -> tuple[Array, Array | None, _cache.Cache, Array]:
    """``q, k, v (B, T, ·)`` continue the tokens in ``cache``: ``out``, the weights, the new cache and ``bad (B, T)``."""
    q, k, v = qkv
    b, t = q.shape[:2]
    if "k_pages" in cache:
        raise ValueError("this module holds a paged cache (init_paged_cache): call it with paged=PagedBatch(...)")
    if cache["next"].shape[0] != b:
        raise ValueError(
            f"x has batch dims {batch} ({b} sequences) but the cache was made for batch_size={cache['next'].shape[0]}"
        )
    if call.mask is not None and not isinstance(call.mask, Mask):
        raise TypeError("with decode=True, mask must be a jattn.masks.Mask predicate (default causal())")
    mask = Causal() if call.mask is None else with_causal(call.mask) if config.causal else call.mask
    lengths = _lengths(call, batch, b)
    pos, valid, lengths, bad = _cache.positions(cache, t, lengths)  # (B, T), (B, T), (B,), (B, T)
    q, k = normalized_rotated(config, layers, q, k, pos, pos)
    step = Step(config.score_mod, mask, pos, valid, lengths, bad)
    return module_kind(config.kind).decode(q, k, v, cache, step, attend)


def forward(
    config: ModuleConfig,
    layers: Layers,
    x: Array,
    context: Array | None,
    call: CallArguments,
    *,
    cache: _cache.Cache | None = None,
    dropout_rng: Array | None = None,
) -> tuple[Array, Array | None, _cache.Cache | None]:
    """One module call: ``x (..., T, F)`` attends to itself (``context=None``) or ``context (..., S, F')``.

    The batch dims ``...`` (any number, none for unbatched input) are flattened to one ``B``;
    masks over them follow (:func:`_flatten_mask_batch`), ``context_mask (..., S)``, ``lengths (...)``.
    With ``cache`` (self-attention), the tokens continue the cached ones (:mod:`jattn._modules.cache`);
    ``mask`` must then be a predicate (default causal). Returns ``out (..., T, F_out)``, the
    weights ``(..., N, T, S)`` when asked (``return_weights`` or ``sow_weights``; S: all keys
    attended, cached ones first) and the updated cache (None without one). Dropout is applied
    when ``dropout_rng`` is given.
    """
    implementation = config.implementation if call.implementation is None else call.implementation
    block_size = config.block_size if call.block_size is None else call.block_size
    check_path(implementation, block_size)
    kind = module_kind(config.kind)
    refuse_path(kind, implementation, block_size)
    check_mask(call.mask)
    batch, t = x.shape[:-2], x.shape[-2]
    ctx = x if context is None else context
    xs = x.reshape(-1, t, x.shape[-1])  # (B, T, F): the batch dims flattened
    cs = ctx.reshape(-1, ctx.shape[-2], ctx.shape[-1])  # (B, S, F')
    qkv = layers.wq(xs), layers.wk(cs), layers.wv(cs)
    attend = dict(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        kind=kind,
        feature_map=config.feature_map,
        dropout_rate=config.dropout_rate if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng,
        precision=config.precision,
        return_weights=call.return_weights or call.sow_weights,
        implementation=implementation,
        block_size=block_size,
        sinks=None if layers.sinks is None else jnp.asarray(layers.sinks),
        num_householder=config.num_householder,
    )
    if kind.recurrent is not None:
        attend["gates"] = kind.recurrent.compute_gates(
            layers.gates or {}, xs, config.num_heads, config.head_depth, config.dtype
        )
    bad = None
    if cache is None:
        out, weights = _full_pass(config, layers, qkv, call, batch, attend)
    else:
        out, weights, cache, bad = _decode_step(config, layers, cache, qkv, call, batch, attend)
    if layers.wo is not None:
        out = layers.wo(out)
    if bad is not None:  # NaN where a traced fault could not raise
        out = jnp.where(bad[..., None], jnp.full((), jnp.nan, out.dtype), out)
    out = out.reshape(*batch, t, out.shape[-1])
    if weights is not None:
        weights = weights.reshape(*batch, *weights.shape[1:])  # (..., N, T, S)
    return out, weights, cache
