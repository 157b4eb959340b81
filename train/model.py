"""A small causal decoder built from jattn's NNX modules (readable in one sitting).

tokens (B, L) -> embeddings + positions -> n_layers x [x + mixer(LN x), x + MLP(LN x)]
-> LN -> logits (B, L, vocab). The mixer is jattn attention under a causal mask, or, for the
control, ``'none'``: a token-local linear map that cannot look at other positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

import jattn.nnx

MIXERS = ("attention", "none")


class Block(nnx.Module):
    """Pre-norm residual block: sequence mixer then MLP."""

    def __init__(self, d_model: int, num_heads: int, mixer: str, mlp_ratio: int, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        if mixer == "attention":
            self.mixer = jattn.nnx.SelfAttention(d_model, num_heads=num_heads, out_proj=True, rngs=rngs)
        else:
            self.mixer = nnx.Linear(d_model, d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

    def __call__(self, x: Array, mask: Array) -> tuple[Array, Array | None]:
        """``x (B, L, d_model)``, causal ``mask (L, L)`` -> new x and weights ``(B, N, L, L)``."""
        h = self.ln1(x)
        weights = None
        if isinstance(self.mixer, jattn.nnx.SelfAttention):
            h, weights = self.mixer(h, mask, return_weights=True)
        else:
            h = self.mixer(h)
        x = x + h
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x)))), weights


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
        mixer: str = "attention",
        mlp_ratio: int = 4,
        rngs: nnx.Rngs,
    ) -> None:
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (max_len, d_model)) / d_model**0.5)
        self.blocks = nnx.List([Block(d_model, num_heads, mixer, mlp_ratio, rngs=rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, tokens: Array, *, return_weights: bool = False) -> Array | tuple[Array, list[Array]]:
        """``tokens (B, L)`` int -> logits ``(B, L, vocab)`` (and per-layer attention weights)."""
        length = tokens.shape[-1]
        x = self.embed(tokens) + self.pos[...][None, :length]  # (B, L, d_model)
        mask = jnp.tril(jnp.ones((length, length), bool))  # causal: query t sees keys s <= t
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        logits = self.head(self.ln_f(x))
        return (logits, weights) if return_weights else logits
