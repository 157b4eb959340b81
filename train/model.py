"""A small causal decoder built from jattn's NNX modules (readable in one sitting).

tokens (B, L) -> embeddings + positions -> num_layers x [x + mixer(LN x), x + MLP(LN x)]
-> LN -> logits (B, L, vocab). The mixer is jattn softmax attention under a causal mask
(optionally a sliding window with global tokens, and grouped kv heads), jattn linear attention,
one of the recurrent kinds of ``jattn.gated_linear_attention`` (``'retention'``, ``'ssd'``, ``'gla'``,
``'deltanet'``, ``'gated_deltanet'``, ``'kda'``, ``'rwkv7'``, ``'deltaproduct'``, ``'gated_deltaproduct'``: the module's ``kind``), or, for the control, ``'none'``: a token-local linear map that cannot look at other positions.
Under a mesh with a ``seq`` axis, softmax attention runs as ring attention over it. Positions
are a learned absolute table (``positions='learned'``, ``max_len`` rows) or ALiBi
(``positions='alibi'``: no table; every attention layer subtracts ``slope[head] · distance``
from its scores, with the paper's fixed slopes).

Serving (:mod:`train.serve`): :meth:`Decoder.init_paged_cache` gives every attention layer a paged KV pool and
:meth:`Decoder.paged` runs one ragged step of many requests' tokens on it. ``batch_invariant=True`` runs every
matmul on fixed tiles of :data:`ROW_TILE` rows (:func:`row_tiled_dot_general`), so that a row's result does not
depend on how many rows share the call: with it, a served request's logits are bitwise the training forward's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

import jattn.nnx
from jattn import masks

MIXERS = ("attention", "linear", *jattn.RECURRENT_KINDS, "none")
SCORE_FREE = ("linear", *jattn.RECURRENT_KINDS)  # mixers that form no scores (no ALiBi, windows or weights)
POSITIONS = ("learned", "alibi")
ROW_TILE = 16  # rows of one matmul tile in the batch-invariant mode
IMPLEMENTATIONS = jattn.IMPLEMENTATIONS  # paths of softmax attention (jattn.attention's implementation=)
SEQUENCE_AXIS = "seq"  # ring attention over this mesh axis when the current mesh has it (train/sharding.py)


def causal_mask(window: int = 0, global_tokens: tuple[int, ...] = ()) -> masks.Mask:
    """Causal, or causal ∩ (sliding window ∪ global tokens) when ``window > 0``."""
    if window <= 0:
        return masks.causal()
    local = masks.sliding_window(window)
    return masks.causal() & (local | masks.global_tokens(global_tokens) if global_tokens else local)


def row_tiled_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None, preferred_element_type=None,
                          **kwargs) -> Array:  # fmt: skip
    """``lhs (..., F) @ rhs (F, F')`` on tiles of :data:`ROW_TILE` rows, one tile a step of ``lax.map``.

    XLA's CPU matmul rounds a row differently depending on how many rows the call has (the kernel and its
    blocking depend on the shape); a fixed tile shape computed one tile at a time gives every row the same bits
    whatever else is in the batch. ``lax.dot_general``'s signature, for ``nnx.Linear(dot_general=...)``.
    """
    del kwargs  # out_sharding: none outside a mesh
    if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
        raise ValueError(f"row_tiled_dot_general takes (..., F) @ (F, F'), got {dimension_numbers}")
    rows = lhs.reshape(-1, lhs.shape[-1])  # (n, F)
    n = rows.shape[0]
    tiles = jnp.pad(rows, ((0, -n % ROW_TILE), (0, 0))).reshape(-1, ROW_TILE, rows.shape[1])  # (n_tiles, TILE, F)
    numbers = (((1,), (0,)), ((), ()))
    dot = lambda t: jax.lax.dot_general(t, rhs, numbers, precision, preferred_element_type)  # noqa: E731
    out = jax.lax.map(dot, tiles).reshape(-1, rhs.shape[1])[:n]  # (n, F')
    return out.reshape(*lhs.shape[:-1], rhs.shape[1])


def make_batch_invariant(model: nnx.Module) -> None:
    """Every ``nnx.Linear`` of ``model`` on :func:`row_tiled_dot_general` (a static attribute: parameters unchanged)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear):
            module.dot_general = row_tiled_dot_general


class ShortConv(nnx.Module):
    """A causal depthwise convolution over the last ``size`` steps, then SiLU: ``x (B, L, d_model)`` -> same shape.

    What the linear-attention papers (H3, Based, DeltaNet, Gated DeltaNet) put before the mixer: it hands
    each step its predecessors, which a recurrent state alone cannot look back at. Decoding keeps the last
    ``size - 1`` inputs (:meth:`init_cache`).
    """

    def __init__(self, d_model: int, size: int, *, rngs: nnx.Rngs) -> None:
        self.size = size
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (size, d_model)) / size**0.5)
        self.state = nnx.data(None)  # (B, size - 1, d_model) while decoding

    def init_cache(self, batch_size: int, d_model: int) -> None:
        self.state = nnx.Cache(jnp.zeros((batch_size, self.size - 1, d_model)))

    def __call__(self, x: Array, *, decode: bool) -> Array:
        before = self.state[...] if decode else jnp.zeros((x.shape[0], self.size - 1, x.shape[-1]), x.dtype)
        padded = jnp.concatenate([before.astype(x.dtype), x], axis=1)  # (B, size - 1 + L, d_model)
        if decode:
            self.state[...] = padded[:, -(self.size - 1) :] if self.size > 1 else before
        length, kernel = x.shape[1], self.kernel[...].astype(x.dtype)
        out = sum(padded[:, i : i + length] * kernel[i][None, None] for i in range(self.size))
        return jax.nn.silu(out)


class Block(nnx.Module):
    """Pre-norm residual block: sequence mixer then MLP."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None,
        mixer: str,
        mlp_ratio: int,
        *,
        implementation: str | None = None,
        block_size: int | None = None,
        score_mod: Callable[..., Array] | None = None,
        short_conv: int = 0,
        rngs: nnx.Rngs,
    ) -> None:
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.conv = ShortConv(d_model, short_conv, rngs=rngs) if short_conv else nnx.data(None)
        if mixer == "none":
            self.mixer = nnx.Linear(d_model, d_model, rngs=rngs)
        else:
            kind = "softmax" if mixer == "attention" else mixer
            self.mixer = jattn.nnx.SelfAttention(
                d_model,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                out_proj=True,
                kind=kind,
                sequence_axis=SEQUENCE_AXIS if kind == "softmax" else None,  # ring attention is softmax's
                implementation=implementation,
                block_size=block_size,
                score_mod=score_mod,
                rngs=rngs,
            )
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

    def __call__(self, x: Array, mask: masks.Mask, *, decode: bool, weights: bool) -> tuple[Array, Array | None]:
        """``x (B, L, d_model)`` -> new x and, if asked, attention weights ``(B, N, L, L)``."""
        h, w = self.ln1(x), None
        if self.conv is not None:
            h = self.conv(h, decode=decode)
        if isinstance(self.mixer, jattn.nnx.SelfAttention):
            h = self.mixer(h, mask, decode=decode, return_weights=weights)
            h, w = h if weights else (h, None)
        else:
            h = self.mixer(h)
        x = x + h
        return self._mlp(x), w

    def _mlp(self, x: Array) -> Array:
        """``x + MLP(LN x)``."""
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    def paged(self, x: Array, mask: masks.Mask, batch: jattn.nnx.PagedBatch) -> Array:
        """A serving step: ``x (Q, d_model)``, the flat ragged tokens of :class:`jattn.nnx.PagedBatch` -> new x."""
        if self.conv is not None or not isinstance(self.mixer, jattn.nnx.SelfAttention):
            raise ValueError("a paged step needs softmax attention without a short convolution")
        return self._mlp(x + self.mixer(self.ln1(x), mask, paged=batch))


class Decoder(nnx.Module):
    """Causal decoder over ``vocab_size`` tokens and sequences up to ``max_len``."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        *,
        d_model: int,
        num_heads: int,
        num_layers: int,
        num_kv_heads: int | None = None,
        mixer: str = "attention",
        positions: str = "learned",
        mlp_ratio: int = 4,
        window: int = 0,
        global_tokens: tuple[int, ...] = (),
        implementation: str | None = None,
        block_size: int | None = None,
        short_conv: int = 0,
        batch_invariant: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        """``implementation`` and ``block_size`` choose softmax attention's path (:func:`jattn.attention`).

        ``batch_invariant``: every matmul on fixed row tiles (:func:`make_batch_invariant`).

        ``short_conv``: the size of a :class:`ShortConv` before every mixer (0: none).

        ``positions``: ``'learned'`` (a ``(max_len, d_model)`` table added to the embeddings) or
        ``'alibi'`` (no table: ALiBi in every attention layer; needs softmax attention, and with
        ``mixer='none'`` the model has no position information at all).
        """
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        if positions == "alibi" and mixer in SCORE_FREE:
            raise ValueError(f"positions='alibi' needs softmax attention (mixer='attention'), got mixer={mixer!r}")
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        learned = positions == "learned"
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (max_len, d_model)) / d_model**0.5) if learned else None
        alibi = None if learned else jattn.score_mods.alibi(jattn.score_mods.alibi_slopes(num_heads))
        self.blocks = nnx.List(
            [
                Block(
                    d_model,
                    num_heads,
                    num_kv_heads,
                    mixer,
                    mlp_ratio,
                    implementation=implementation,
                    block_size=block_size,
                    score_mod=alibi,
                    short_conv=short_conv,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)
        self.mask = causal_mask(window, tuple(global_tokens))
        self.window, self.global_tokens = window, tuple(global_tokens)
        self.next = nnx.data(None)  # per-example next position while decoding
        if batch_invariant:
            make_batch_invariant(self)

    def __call__(
        self, tokens: Array, *, return_weights: bool = False, decode: bool = False
    ) -> Array | tuple[Array, list[Array | None]]:
        """``tokens (B, L)`` int -> logits ``(B, L, vocab)`` (and per-layer attention weights).

        With ``decode=True`` (after :meth:`init_cache`) the tokens continue the cached ones.
        """
        length = tokens.shape[-1]
        if decode:
            positions = self.next[...][:, None] + jnp.arange(length)[None]  # (B, L)
            self.next[...] = self.next[...] + length
        else:
            positions = jnp.s_[None, :length]  # rows 0..L-1 of the table, (1, L)
        x = self.embed(tokens)  # (B, L, d_model)
        if self.pos is not None:  # learned absolute positions (ALiBi acts inside attention instead)
            x = x + self.pos[...][positions]
        weights = []
        for block in self.blocks:
            x, w = block(x, self.mask, decode=decode, weights=return_weights)
            weights.append(w)
        logits = self.head(self.ln_f(x))
        return (logits, weights) if return_weights else logits

    def paged(self, tokens: Array, batch: jattn.nnx.PagedBatch, rows: Array | None = None) -> Array:
        """One serving step on the paged pools (after :meth:`init_paged_cache`): logits ``(R', vocab)``.

        ``tokens (Q,)`` int: the flat ragged tokens of the requests of ``batch`` (each request's keys and values are
        written into its pages, at ``batch.pages``/``batch.slots``); ``rows (R',)``: the rows whose logits are
        wanted (default all Q).
        """
        x = self.embed(tokens)  # (Q, d_model)
        if self.pos is not None:
            x = x + self.pos[...][batch.positions]
        for block in self.blocks:
            x = block.paged(x, self.mask, batch)
        if rows is not None:
            x = x[rows]
        return self.head(self.ln_f(x))

    def init_paged_cache(self, num_pages: int, page_size: int) -> None:
        """A paged KV pool of ``num_pages`` pages of ``page_size`` tokens in every attention layer."""
        for block in self.blocks:
            if not isinstance(block.mixer, jattn.nnx.SelfAttention) or block.conv is not None:
                raise ValueError("a paged cache needs softmax attention (mixer='attention') without short_conv")
            block.mixer.init_paged_cache(num_pages, page_size)

    def init_cache(self, batch_size: int, max_len: int) -> None:
        """Empty caches for greedy decoding: full, or a ring of ``window`` slots + pinned globals."""
        self.next = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))
        ring = dict(window=self.window, pinned=self.global_tokens) if self.window > 0 else {}
        for block in self.blocks:
            if isinstance(block.mixer, jattn.nnx.SelfAttention):
                block.mixer.init_cache(batch_size, max_len, **ring)
            if block.conv is not None:
                block.conv.init_cache(batch_size, self.embed.features)
