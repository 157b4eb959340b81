"""A module call on a paged KV pool: the flat ragged tokens of many requests, one step of serving.

The pool is a third kind of cache beside the contiguous and ring caches (:mod:`jattn._modules.cache`): one dict
``{"k_pages": (P, Z, K, D), "v_pages": (P, Z, K, E)}`` per module, shared by every request, whose pages the caller
allocates (a request's keys ``0..kv_len-1`` sit at ``page_table[r, j // Z]``, slot ``j % Z``). A paged call
projects the tokens, applies QK norm and rotary embedding at their positions, writes their keys and values into the
slots :class:`PagedBatch` names, attends with :func:`jattn.paged_attention` and projects the output. Keys are
stored after QK norm and rotary embedding, as in the contiguous cache. Dimension key: :mod:`jattn._core`; ``Q``
query tokens, ``R`` requests, ``P`` pages of ``Z`` tokens, ``M`` pages a request.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import Array

from jattn._masks import Causal, Mask
from jattn._modules.cache import Cache
from jattn._modules.call import Layers, normalized_rotated
from jattn._modules.kinds import kind_names, module_kind
from jattn._modules.multihead import with_causal
from jattn._modules.options import ModuleConfig
from jattn._paged import paged_attention
from jattn._scalars import check_dtype, check_int

__all__ = ["PagedBatch", "init_paged_cache", "is_paged", "paged_forward"]


class PagedBatch(NamedTuple):
    """One ragged step of serving: which request each token belongs to, where its key goes, its position.

    Shapes (``Q`` tokens, possibly padded past ``cu_q_lens[R]``; ``R`` requests, possibly padded with empty ones)::

        page_table  (R, M) int32  request r's keys 0..kv_lens[r]-1 at page_table[r, j // Z], slot j % Z
        kv_lens     (R,) int32    each request's keys after this step (its new tokens included)
        cu_q_lens   (R + 1,) int32  request r's tokens are rows cu_q_lens[r]:cu_q_lens[r+1] of x
        pages       (Q,) int32    the page each token's key and value are written to (>= P: not written, padding)
        slots       (Q,) int32    the slot in that page
        positions   (Q,) int32    each token's absolute position (rotary embedding; = its key's index)

    Request r's tokens are its last positions: ``positions[cu_q_lens[r] + i] = kv_lens[r] - q_len + i``, and
    ``(pages, slots)`` is then ``page_table[r, p // Z], p % Z`` for ``p = positions``: the caller's bookkeeping,
    which this call trusts (see :func:`jattn.paged_attention` for what it checks).
    """

    page_table: Array
    kv_lens: Array
    cu_q_lens: Array
    pages: Array
    slots: Array
    positions: Array


def is_paged(cache: Cache | None) -> bool:
    """Whether ``cache`` is a paged pool (made by :func:`init_paged_cache`)."""
    return cache is not None and "k_pages" in cache


def init_paged_cache(config: ModuleConfig, num_pages: int, page_size: int, dtype: Any) -> Cache:
    """An empty pool: ``k_pages (P, Z, K, D)`` and ``v_pages (P, Z, K, D)`` zeros of ``dtype`` (softmax kind only)."""
    num_pages = check_int("num_pages", num_pages, min=1)
    page_size = check_int("page_size", page_size, min=1)
    check_dtype("dtype", dtype)
    if not module_kind(config.kind).paged:
        paged = ", ".join(repr(name) for name in kind_names() if module_kind(name).paged)
        raise ValueError(f"a paged cache holds keys and values of kind={paged}, got kind={config.kind!r}")
    shape = (num_pages, page_size, config.num_kv_heads, config.head_depth)
    return {"k_pages": jnp.zeros(shape, dtype), "v_pages": jnp.zeros(shape, dtype)}


def _check(config: ModuleConfig, x: Array, pool: Cache, batch: PagedBatch, mask: Mask | None) -> None:
    if not is_paged(pool):
        raise ValueError("paged=... needs a paged cache: init_paged_cache(num_pages, page_size) first")
    if not isinstance(batch, PagedBatch):
        raise TypeError(f"paged must be a PagedBatch, got {type(batch).__name__}")
    if x.ndim != 2:
        raise ValueError(f"with paged=..., x must be the flat ragged tokens (Q, d_model), got shape {x.shape}")
    q = x.shape[0]
    for name in ("pages", "slots", "positions"):
        if jnp.shape(getattr(batch, name)) != (q,):
            raise ValueError(f"PagedBatch.{name} must have shape (Q,) = ({q},), got {jnp.shape(getattr(batch, name))}")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError("with paged=..., mask must be a jattn.masks.Mask predicate (default causal())")
    del config


def _write(pool: Cache, k: Array, v: Array, batch: PagedBatch) -> Cache:
    """The pool with ``k (Q, K, D)``, ``v (Q, K, E)`` at ``(pages, slots)``; tokens with a page ``>= P`` dropped."""
    pages, slots = jnp.asarray(batch.pages, jnp.int32), jnp.asarray(batch.slots, jnp.int32)
    kp, vp = pool["k_pages"], pool["v_pages"]
    return pool | {
        "k_pages": kp.at[pages, slots].set(k.astype(kp.dtype), mode="drop"),
        "v_pages": vp.at[pages, slots].set(v.astype(vp.dtype), mode="drop"),
    }


def paged_forward(
    config: ModuleConfig,
    layers: Layers,
    x: Array,
    pool: Cache,
    batch: PagedBatch,
    mask: Mask | None,
    implementation: str | None,
) -> tuple[Array, Cache]:
    """One serving step of ``x (Q, F)``: ``out (Q, F_out)`` and the pool with the tokens' keys and values written.

    ``mask``: a predicate on positions (None: causal; the module's ``causal=True`` ands causal in);
    ``implementation``: :func:`jattn.paged_attention`'s (``'fused'``, ``'xla'`` or None).
    """
    _check(config, x, pool, batch, mask)
    n, kv, d = config.num_heads, config.num_kv_heads, config.head_depth
    xs = x[None]  # (1, Q, F): the module's projections and QK functions take (B, L, F)
    q, k, v = layers.wq(xs), layers.wk(xs), layers.wv(xs)  # (1, Q, N*D), (1, Q, K*D) x2
    pos = jnp.asarray(batch.positions, jnp.int32)[None]  # (1, Q)
    q, k = normalized_rotated(config, layers, q, k, pos, pos)
    count = x.shape[0]
    pool = _write(pool, k.reshape(count, kv, d), v.reshape(count, kv, -1), batch)
    mask = Causal() if mask is None else with_causal(mask) if config.causal else mask
    dtype = pool["k_pages"].dtype
    out = paged_attention(
        q.reshape(count, n, d).astype(dtype), pool["k_pages"], pool["v_pages"],
        jnp.asarray(batch.page_table, jnp.int32), jnp.asarray(batch.kv_lens, jnp.int32),
        jnp.asarray(batch.cu_q_lens, jnp.int32), mask=mask, score_mod=config.score_mod,
        sinks=None if layers.sinks is None else jnp.asarray(layers.sinks), implementation=implementation,
    )  # fmt: skip
    out = out.reshape(1, count, -1).astype(q.dtype)  # (1, Q, N*E)
    if layers.wo is not None:
        out = layers.wo(out)
    return out[0], pool
