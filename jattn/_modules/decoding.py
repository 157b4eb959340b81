"""One decoding step of a module from its cache: the softmax slots, linear attention's state, a recurrent state.

The module call (:mod:`jattn._modules.call`) finds the new tokens' positions, applies QK norm and rotary embedding
at them, and hands the step here through its kind's record (:mod:`jattn._modules.kinds`): each function takes the
projected ``q (B, T, N*D)``, ``k, v (B, T, K*D)``, the cache and the :class:`Step`, and returns ``out (B, T, N*E)``,
the weights (softmax kind, where asked), the cache after the step and ``bad (B, T)`` (outputs to poison with NaN).
Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax import Array

from jattn._masks import Mask
from jattn._modules import cache as _cache
from jattn._modules.multihead import at_positions, multihead

__all__ = ["Step", "linear_step", "softmax_step", "state_step"]


class Step(NamedTuple):
    """A decoding step's facts besides q, k, v and the cache.

    The module's ``score_mod``, the call's mask (causal and-ed in where the module is), the new tokens' positions
    ``pos (B, T)``, ``valid (B, T)``, ``lengths (B,)`` and ``bad (B, T)`` so far.
    """

    score_mod: Any
    mask: Mask
    pos: Array
    valid: Array
    lengths: Array
    bad: Array


def softmax_step(q: Array, k: Array, v: Array, cache: _cache.Cache, step: Step, attend: dict) -> tuple:
    """The cached slots then this step's keys, under the mask at absolute positions; the new keys written."""
    keys, values, allowed = _cache.read(cache, k, v, step.pos, step.valid, step.mask)  # (B, C + T, K*D) x2, mask
    bad = step.bad | _cache.dropped_seen(cache, step.pos, step.valid, step.mask)  # a ring that lost what is seen
    mod = step.score_mod
    if mod is not None:  # the core sees the (T, C + T) grid; the mod gets the tokens' absolute positions
        mod = at_positions(mod, step.pos, _cache.key_positions(cache, step.pos, step.valid))
    out, weights, _ = multihead(q, keys, values, mask=allowed, score_mod=mod, **attend)
    return out, weights, _cache.write(cache, k, v, step.pos, step.valid, step.lengths), bad


def linear_step(q: Array, k: Array, v: Array, cache: _cache.Cache, step: Step, attend: dict) -> tuple:
    """Linear attention continuing the cache's state."""
    state = _cache.linear_state(cache)
    out, weights, state = multihead(q, k, v, mask=step.mask, kv_mask=step.valid, linear_state=state, **attend)
    return out, weights, _cache.write_linear(cache, state, step.lengths), step.bad


def state_step(q: Array, k: Array, v: Array, cache: _cache.Cache, step: Step, attend: dict) -> tuple:
    """A recurrent kind continuing the cache's state (a log kind's level states at the cache's position)."""
    out, weights, state = multihead(
        q, k, v, mask=step.mask, kv_mask=step.valid, linear_state=cache["state"], start=cache["next"][:, None, None],
        **attend,
    )  # fmt: skip
    return out, weights, _cache.write_state(cache, state, step.lengths), step.bad
