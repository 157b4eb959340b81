"""Flax NNX attention modules: thin layers over the jattn core.

Softmax attention is :func:`jattn.attention`; ``kind='linear'`` uses :func:`jattn.linear_attention`.

Parameters (the article's names): ``wq`` (``d_model -> N*D``), ``wk`` and ``wv`` (keys/values
features ``-> K*D``, K = ``num_kv_heads``) and, when there is an output projection, ``wo``
(``N*D -> out features``); each an ``nnx.Linear`` holding ``kernel`` and, with ``use_bias``,
``bias``. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from jattn import _heads
from jattn._checks import check_dtype, check_int, int_array, is_traced
from jattn._linear import LinearState, feature_fn
from jattn._masks import Causal, Mask

__all__ = ["CrossAttention", "SelfAttention"]

_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()


class _Attention(nnx.Module):
    """Projections, heads, dropout and output projection shared by the attention modules."""

    def __init__(
        self,
        d_model: int,
        kv_features: int,
        *,
        num_heads: int = 1,
        num_kv_heads: int | None = None,
        qkv_features: int | None = None,
        out_features: int | None = None,
        out_proj: bool | None = None,
        use_bias: bool = False,
        kind: str = "softmax",
        feature_map: str | Callable[[Array], Array] = "elu",
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        sequence_axis: str | None = None,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
        kernel_init: nnx.Initializer = _KERNEL_INIT,
        bias_init: nnx.Initializer = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        self.num_kv_heads, self.head_depth = _heads.check_heads(d_model, num_heads, num_kv_heads, qkv_features)
        _heads.check_kind(kind, feature_map)
        _heads.check_options(
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
        d_model, kv_features, num_heads = int(d_model), int(kv_features), int(num_heads)
        out_features = None if out_features is None else int(out_features)
        self.d_model, self.kv_features, self.num_heads = d_model, kv_features, num_heads
        self.kind, self.feature_map = kind, feature_map
        self.dropout_rate, self.deterministic, self.precision = dropout_rate, deterministic, precision
        self.sequence_axis = sequence_axis
        _heads.check_path(implementation, block_size)
        self.implementation, self.block_size = implementation, block_size
        if out_proj is None:
            out_proj = num_heads > 1 or out_features is not None
        if out_features is not None and not out_proj:
            raise ValueError(f"out_features={out_features} needs out_proj=True")

        def linear(fin: int, fout: int) -> nnx.Linear:
            return nnx.Linear(
                fin,
                fout,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=precision,
                kernel_init=kernel_init,
                bias_init=bias_init,
                rngs=rngs,
            )

        features = num_heads * self.head_depth
        self.wq = linear(d_model, features)
        self.wk = linear(kv_features, self.num_kv_heads * self.head_depth)
        self.wv = linear(kv_features, self.num_kv_heads * self.head_depth)
        self.wo = linear(features, out_features or d_model) if out_proj else None
        self.dropout_rngs = rngs.dropout.fork() if dropout_rate > 0 else None

    def _dropout_rng(self, deterministic: bool | None, rngs: nnx.Rngs | None) -> Array | None:
        deterministic = self.deterministic if deterministic is None else deterministic
        if self.dropout_rate == 0 or deterministic:
            return None
        stream = rngs.dropout if rngs is not None else self.dropout_rngs
        return stream()

    def _attend(
        self,
        q: Array,
        k: Array,
        v: Array,
        mask: Array | Mask | None,
        kv_mask: Array | None,
        rng: Array | None,
        return_weights: bool,
        linear_state: LinearState | None = None,
        ring: bool = True,
        path: tuple[str | None, int | tuple[int, int] | None] = (None, None),
    ) -> tuple[Array, Array | None, LinearState | None]:
        implementation, block_size = path
        _heads.check_path(implementation, block_size)
        out, weights, state = _heads.multihead(
            q,
            k,
            v,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            mask=mask,
            kv_mask=kv_mask,
            kind=self.kind,
            feature_map=self.feature_map,
            dropout_rate=self.dropout_rate if rng is not None else 0.0,
            dropout_rng=rng,
            precision=self.precision,
            return_weights=return_weights,
            linear_state=linear_state,
            sequence_axis=self.sequence_axis if ring else None,
            implementation=self.implementation if implementation is None else implementation,
            block_size=self.block_size if block_size is None else block_size,
        )
        if self.wo is not None:
            out = self.wo(out)
        return out, weights, state


class SelfAttention(_Attention):
    """Multi-head self-attention over ``x`` of shape ``(B, T, d_model)``.

    The default construction is the article's module: three bias-free linear maps
    ``d_model -> d_model`` (``wq``, ``wk``, ``wv``), one head, scale ``1/sqrt(d_model)`` and
    output ``(B, T, d_model)`` without an output projection.

    Args:
      d_model: input features.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (default N); N/K query heads share one kv head
        (grouped-query attention; K=1 is multi-query). Must divide N.
      qkv_features: total query features N*D (default d_model); kv heads have the same D.
      out_features: output features; setting it implies an output projection.
      out_proj: add the output projection ``wo``; default True when ``num_heads > 1`` or
        ``out_features`` is set. Without it the output has qkv_features features.
      use_bias: biases on the projections.
      kind: ``'softmax'`` (default) or ``'linear'`` (:func:`jattn.linear_attention`, whose
        only masks are None and ``masks.causal()``).
      feature_map: the feature map of linear attention.
      dropout_rate: dropout on the attention weights (softmax kind), in ``[0, 1)``.
      deterministic: default for the call-time switch; dropout is off when True.
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: parameter dtype.
      precision: matmul precision for projections and attention.
      sequence_axis: a mesh axis the sequence is sharded over; when the current mesh
        (``jax.set_mesh``) has it with more than one device, softmax attention runs as ring
        attention over it (:func:`jattn.sequence_parallel_attention`; masks: None or a
        position-only predicate, no dropout). Decoding uses the plain core.
      implementation: the path of :func:`jattn.attention` (``'dense'``, ``'blockwise'``,
        ``'xla'``, ``'cudnn'``; default None: chosen per call). Mask predicates reach the core
        as they are, so the blockwise path skips their empty tiles; overridable per call.
      block_size: the blockwise tiles ``(block_q, block_kv)`` or one int (default: chosen from
        the mask); overridable per call.
      kernel_init, bias_init: initialisers of the projections.
      rngs: ``nnx.Rngs`` for the parameters (``params``) and dropout (``dropout``).

    Decoding: :meth:`init_cache`, then calls with ``decode=True`` (see there).
    """

    def __init__(self, d_model: int, **options: Any) -> None:
        super().__init__(d_model, d_model, **options)
        self.cache: dict[str, nnx.Cache] | None = nnx.data(None)
        self.cache_layout = (None, ())  # (ring window, pinned positions) of the cache

    def __call__(
        self,
        x: Array,
        mask: Array | Mask | None = None,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
        decode: bool = False,
        lengths: Array | None = None,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (B, T, d_model)`` to itself.

        Args:
          x: ``(B, T, d_model)`` inputs.
          mask: boolean array (True = attend): ``(T, T)``, ``(B, T, T)`` per example (the same
            for every head) or ``(B, N, T, T)``, any axis may be 1; or a
            :class:`jattn.masks.Mask` such as ``masks.causal()``.
          deterministic: overrides the constructor's switch; dropout is off when True.
          rngs: overrides the constructor's dropout stream.
          return_weights: also return the attention weights ``(B, N, T, T)`` (before dropout).
          decode: attend to the cache as well and append these tokens to it (after
            :meth:`init_cache`); ``mask`` must then be a Mask predicate (default causal).
          lengths: with ``decode``, how many of the T tokens of each example ``(B,)`` are
            real (a ragged batch), integers in ``[0, T]``; the rest are neither attended to nor
            cached. Out of range they raise a ValueError, or, traced (under ``jit``), are
            clipped to ``[0, T]`` and make that example's outputs NaN.
          implementation, block_size: override the constructor's (None: keep them).

        Returns:
          ``(B, T, F)`` with F the out features (or qkv features without ``wo``), and the
          weights when ``return_weights``.
        """
        _heads.check_input("x", x, self.d_model)
        _heads.check_call(deterministic, return_weights, decode)
        if lengths is not None and not decode:
            raise ValueError("lengths applies to decode=True only")
        rng = self._dropout_rng(deterministic, rngs)
        path = (implementation, block_size)
        if decode:
            out, weights = self._decode(x, mask, lengths, rng, return_weights, path)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            out, weights, _ = self._attend(q, k, v, mask, None, rng, return_weights, path=path)
        return (out, weights) if return_weights else out

    # -- decoding ------------------------------------------------------------------------------

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        window: int | None = None,
        pinned: tuple[int, ...] = (),
        dtype: Any = jnp.float32,
    ) -> None:
        """Allocates an empty cache for ``batch_size`` sequences.

        Softmax kind: keys and values of the K kv heads only, in ``max_length`` slots; with
        ``window=w`` a ring buffer of ``w`` slots (enough for ``sliding_window(w)``) plus one
        pinned slot for each position in ``pinned`` (the global tokens), instead. Linear kind:
        the recurrent state ``(kv, z)``. Each example has its own next position.

        Args:
          batch_size: positive int B.
          max_length: positive int, the most positions the full softmax cache holds. Decoding
            past it raises a ValueError or, traced (under ``jit``), gives NaN outputs for the
            positions past it (which are not cached). The window and linear caches have no
            such limit.
          window: None or a positive int (softmax kind only).
          pinned: distinct non-negative int positions kept beside the window (needs ``window``).
          dtype: floating dtype of the cached keys and values (or state).
        """
        b = check_int("batch_size", batch_size, min=1)
        max_length = check_int("max_length", max_length, min=1)
        check_dtype("dtype", dtype)
        if window is not None:
            window = check_int("window", window, min=1)
        if isinstance(pinned, str) or not isinstance(pinned, Sequence | np.ndarray):
            raise TypeError(f"pinned must be a sequence of non-negative int positions, got {pinned!r}")
        pinned = tuple(check_int(f"pinned[{n}]", p, min=0) for n, p in enumerate(pinned))
        if len(set(pinned)) != len(pinned):
            raise ValueError(f"pinned positions must be distinct, got {pinned}")
        if pinned and window is None:
            raise ValueError(f"pinned={pinned} needs a window (pinned slots sit beside a ring buffer)")
        if self.kind == "linear" and window is not None:
            raise ValueError(f"window={window} applies to the softmax kind; the linear cache is a recurrent state")
        kv, d = self.num_kv_heads, self.head_depth
        cache: dict[str, Array] = {"next": jnp.zeros((b,), jnp.int32)}
        if self.kind == "linear":
            g = self.num_heads // kv
            f = jax.eval_shape(lambda a: feature_fn(self.feature_map)(a), jax.ShapeDtypeStruct((d,), dtype)).shape[-1]
            cache |= {"kv": jnp.zeros((b, kv, g, f, d), dtype), "z": jnp.zeros((b, kv, g, f), dtype)}
        else:
            slots = max_length if window is None else window + len(pinned)
            cache |= {
                "k": jnp.zeros((b, slots, kv, d), dtype),
                "v": jnp.zeros((b, slots, kv, d), dtype),
                "pos": jnp.full((b, slots), -1, jnp.int32),  # absolute position held by a slot; -1 empty
            }
        self.cache = nnx.data({name: nnx.Cache(value) for name, value in cache.items()})
        self.cache_layout = (window, pinned)

    def _decode(
        self,
        x: Array,
        mask: Array | Mask | None,
        lengths: Array | None,
        rng: Array | None,
        return_weights: bool,
        path: tuple[str | None, int | tuple[int, int] | None] = (None, None),
    ) -> tuple[Array, Array | None]:
        if self.cache is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        c = {name: var[...] for name, var in self.cache.items()}
        b, t, _ = x.shape
        if c["next"].shape[0] != b:
            raise ValueError(f"x has batch {b} but the cache was made for batch_size={c['next'].shape[0]}")
        mask = Causal() if mask is None else mask
        if not isinstance(mask, Mask):
            raise TypeError("with decode=True, mask must be a jattn.masks.Mask predicate (default causal())")
        lengths, bad = self._lengths(lengths, b, t)  # (B,), (B,) examples with a bad length (traced)
        bad = bad[:, None]  # (B, 1): NaN outputs
        pos = c["next"][:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # (B, T) absolute positions
        valid = jnp.arange(t, dtype=jnp.int32)[None] < lengths[:, None]  # (B, T)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.kind == "linear":
            state = LinearState(c["kv"], c["z"])
            out, weights, state = self._attend(q, k, v, mask, valid, rng, return_weights, state, ring=False, path=path)
            self._store({"kv": state.kv, "z": state.z, "next": c["next"] + lengths})
            return _poison(out, bad), weights
        window, _ = self.cache_layout
        capacity = c["pos"].shape[1]
        if window is None:  # the full cache holds positions [0, max_length)
            past = valid & (pos >= capacity)  # (B, T)
            if not is_traced(past) and bool(jnp.any(past)):
                raise ValueError(
                    f"decoding past init_cache(max_length={capacity}): positions up to "
                    f"{np.asarray(c['next'] + lengths).tolist()} (per example) do not fit; allocate a longer cache"
                )
            bad = bad | past  # (B, T)
        # Keys: the cached slots, then this call's tokens; masked by the predicate on positions.
        kv_pos = jnp.concatenate([c["pos"], jnp.where(valid, pos, -1)], axis=1)  # (B, C + T)
        i, j = pos[:, None, :, None], kv_pos[:, None, None, :]
        dense = mask.allowed(i, j) & (j >= 0)  # (B, 1, T, C + T)
        keys = jnp.concatenate([c["k"].reshape(b, -1, c["k"].shape[-2] * c["k"].shape[-1]).astype(k.dtype), k], 1)
        vals = jnp.concatenate([c["v"].reshape(b, -1, c["v"].shape[-2] * c["v"].shape[-1]).astype(v.dtype), v], 1)
        out, weights, _ = self._attend(q, keys, vals, dense, None, rng, return_weights, ring=False, path=path)
        slot = self._slots(pos, valid, c["next"] + lengths, capacity)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], slot.shape)
        heads = (b, t, *c["k"].shape[-2:])
        self._store(
            {
                "k": c["k"].at[rows, slot].set(k.reshape(heads).astype(c["k"].dtype), mode="drop"),
                "v": c["v"].at[rows, slot].set(v.reshape(heads).astype(c["v"].dtype), mode="drop"),
                "pos": c["pos"].at[rows, slot].set(pos, mode="drop"),
                "next": c["next"] + lengths,
            }
        )
        return _poison(out, bad), weights

    @staticmethod
    def _lengths(lengths: Array | None, b: int, t: int) -> tuple[Array, Array]:
        """Checked ``lengths (B,)`` in ``[0, T]`` and which examples had a bad (traced) length ``(B,)``."""
        if lengths is None:
            return jnp.full((b,), t, jnp.int32), jnp.zeros((b,), bool)
        lengths = int_array("lengths", lengths, ndim=1, shape=f"(B,) = ({b},)").astype(jnp.int32)
        if lengths.shape != (b,):
            raise ValueError(f"lengths must have shape (B,) = ({b},), got {lengths.shape}")
        bad = (lengths < 0) | (lengths > t)
        if not is_traced(bad) and bool(jnp.any(bad)):
            raise ValueError(f"lengths must be in [0, T={t}], got {np.asarray(lengths).tolist()}")
        return jnp.clip(lengths, 0, t), bad

    def _store(self, values: dict[str, Array]) -> None:
        for name, value in values.items():
            self.cache[name][...] = value

    def _slots(self, pos: Array, valid: Array, end: Array, size: int) -> Array:
        """Cache slot of each new token ``(B, T)``; ``size`` (out of range, dropped) for none."""
        window, pinned = self.cache_layout
        if window is None:
            return jnp.where(valid & (pos < size), pos, size)
        slot = len(pinned) + pos % window
        keep = valid & (pos >= end[:, None] - window)  # only the newest `window` tokens survive
        for n, p in enumerate(pinned):
            slot = jnp.where(pos == p, n, slot)
            keep = keep | (valid & (pos == p))
        return jnp.where(keep, slot, size)


def _poison(out: Array, bad: Array) -> Array:
    """``out (B, T, F)`` with NaN where ``bad`` (broadcastable to ``(B, T)``) is set."""
    return jnp.where(bad[..., None], jnp.full((), jnp.nan, out.dtype), out)


class CrossAttention(_Attention):
    """Multi-head cross-attention from ``x`` to a context of another length and feature size.

    Queries come from ``x (B, T, d_model)``, keys and values from
    ``context (B, S, context_features)``.

    Parameters and options as :class:`SelfAttention`; ``wk`` and ``wv`` map
    ``context_features -> K*D``.
    """

    def __init__(self, d_model: int, context_features: int, **options: Any) -> None:
        super().__init__(d_model, context_features, **options)

    def __call__(
        self,
        x: Array,
        context: Array,
        mask: Array | Mask | None = None,
        *,
        context_mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
        implementation: str | None = None,
        block_size: int | tuple[int, int] | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attends ``x (B, T, d_model)`` to ``context (B, S, context_features)``.

        Args:
          mask: as for :class:`SelfAttention`, over ``(B, N, T, S)``.
          context_mask: boolean ``(B, S)``, False marks context padding (never attended to);
            a query that sees no valid context returns 0 (before ``wo``).
          deterministic, rngs, return_weights, implementation, block_size: as for
            :class:`SelfAttention`.
        """
        _heads.check_context(x, self.d_model, context, self.kv_features, context_mask)
        _heads.check_call(deterministic, return_weights, False)
        rng = self._dropout_rng(deterministic, rngs)
        q, k, v = self.wq(x), self.wk(context), self.wv(context)
        path = (implementation, block_size)
        out, weights, _ = self._attend(q, k, v, mask, context_mask, rng, return_weights, path=path)
        return (out, weights) if return_weights else out
