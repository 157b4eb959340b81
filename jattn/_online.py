"""The online-softmax maths shared by the blockwise path and ring attention.

Shapes follow :mod:`jattn._core`, with leading dimensions flattened to one axis ``B``: a query
tile ``(B, t, D)`` meets a key tile ``(B, s, D)`` and a value tile ``(B, s, E)``. The running
state of ``t`` query rows is the row max ``m (B, t)``, the normaliser ``l (B, t)`` and the
unnormalised output ``acc (B, t, E)``; a key tile with scores ``x`` updates them as

    m' = max(m, rowmax x),  l' = l·e^(m - m') + rowsum e^(x - m'),  acc' = acc·e^(m - m') + e^(x - m') v

The backward pass recomputes a tile's weights ``p = e^(x - lse)`` from the saved log-sum-exp and
accumulates ``dq += ds k``, ``dk += dsᵀ q``, ``dv += pᵀ dO`` with ``ds = p (dO vᵀ - delta) scale``
and ``delta = rowsum(dO ∘ O)`` (:func:`tile_grads`). Everything accumulates in
:func:`compute_dtype`: float32 for bf16/f16/f32, float64 for float64. Both exponentials of a
tile, ``e^(x - m')`` and ``e^(x - lse)``, are :func:`jattn._softmax.exp_below_one`: the exponent
is clamped at 0, so a float32 polynomial without XLA's overflow guards serves, within 1.5 ulp
for weights above ``e^-1`` and ``2^-23.5`` absolute below.

Score modifications (``score_mod``) change a tile's scaled scores before the mask: the forward
folds ``x = mod(s)`` instead of ``s``; the backward recomputes ``x`` under ``jax.vjp`` and pulls
``dx = p (dp - delta)`` back to ``ds`` and to the arrays the modification closes over
(:func:`score_grads`). Attention sinks (a logit per row that joins the denominator without a
value) enter only at the end (:func:`finish`): the log-sum-exp then includes them, so the
backward's ``p = e^(x - lse)`` and ``ds`` are unchanged, and the sink's own gradient is
``-e^(sink - lse) · delta`` per row (:func:`sink_grads`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array

from jattn._masks import EMPTY, FULL, PARTIAL
from jattn._softmax import exp_below_one

__all__ = [
    "accumulate",
    "backward_rows",
    "bind_mod",
    "convert_mod",
    "empty_state",
    "finish",
    "mod_args",
    "per_block",
    "scaled_scores",
    "score_grads",
    "sink_grads",
    "tile_grads",
    "transposed",
]


def scaled_scores(qb: Array, kb: Array, scale: float, compute, precision) -> Array:
    """``scale · q kᵀ`` of one tile: ``(B, t, D) x (B, s, D) -> (B, t, s)`` in the compute dtype.

    ``scale == 1.0`` (a q that carries the scale already) skips the multiplication.
    """
    s = jnp.einsum(
        "btd,bsd->bts", qb.astype(compute), kb.astype(compute), precision=precision, preferred_element_type=compute
    )
    return s if isinstance(scale, float) and scale == 1.0 else s * jnp.asarray(scale, compute)


def per_block(
    kind: Array | int, update, carry, uniform: int | None = None, kinds: tuple[int, ...] | None = None, split=None
):
    """Runs ``update(carry, masked)`` on a PARTIAL or FULL tile; an EMPTY one is skipped.

    ``kind`` is the tile's kind, traced (a branch on it) or an int (that kind's code alone).

    ``split`` (optional) maps kinds of :data:`jattn._masks.kinds.SPLIT_AREA` to the functions ``f(carry)`` that take
    their tiles, which only occur when given. ``uniform`` (a kind) says statically that every tile
    has that kind: no branch; else ``kinds`` (optional) lists the kinds that occur, and only their
    branches are compiled: it must hold every value ``kind`` can take (any other would run the
    EMPTY branch).
    """
    branches = {EMPTY: lambda c: c, PARTIAL: functools.partial(update, masked=True)}
    branches[FULL] = functools.partial(update, masked=False)
    branches.update(split or {})
    if uniform is not None or isinstance(kind, int):  # one kind, known statically: no branch
        return branches[kind if uniform is None else uniform](carry)
    keys = sorted(branches if kinds is None else {EMPTY, *kinds})
    slot = jnp.asarray([keys.index(k) if k in keys else 0 for k in range(max(keys) + 1)], jnp.int32)
    return jax.lax.switch(slot[kind.astype(jnp.int32)], [branches[k] for k in keys], carry)


def empty_state(b: int, t: int, e: int, compute) -> tuple[Array, Array, Array]:
    """The state of ``t`` query rows before any key: ``m``, ``l`` ``(B, t)``, ``acc`` ``(B, t, E)``."""
    return jnp.full((b, t), -jnp.inf, compute), jnp.zeros((b, t), compute), jnp.zeros((b, t, e), compute)


def accumulate(state, s: Array, keep: Array | None, vb: Array, precision, compute, drop: Array | None = None):
    """Folds one key tile (scores ``s (B, t, s)``, optional mask ``keep``, values ``vb (B, s, E)``) into the state.

    ``drop (B, t, s)`` (optional) is dropout's factor on each weight (``1 / keep_prob`` or 0,
    :func:`jattn._dropout.keep_scale`): the normaliser sums the undropped weights, the output the
    dropped ones, so the result is ``softmax(x) ∘ drop`` applied to v.
    """
    m, norm, acc = state
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
    # exp(min(x - m, 0)): the clamp of shifted_exp in one pass; exactly 0 at masked entries.
    p = exp_below_one(s - m_safe[..., None])
    alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
    # float32 weights against v upcast: rounding p to v's dtype here would leave the backward's
    # delta = rowsum(dO·O) out of step with the unrounded p it recomputes (see jattn._core).
    pv = jnp.einsum(
        "bts,bse->bte",
        p if drop is None else p * drop,
        vb.astype(compute),
        precision=precision,
        preferred_element_type=compute,
    )
    return m_new, norm * alpha + jnp.sum(p, -1), acc * alpha[..., None] + pv


def finish(state, dtype, sink: Array | None = None) -> tuple[Array, Array, Array]:
    """``out (B, t, E)`` in ``dtype``, ``lse (B, t)`` and the row max logit ``(B, t)``.

    Rows that saw no key give 0 output, max ``-inf`` and lse ``-inf``. ``sink`` ``(B, 1)`` (or
    ``(B, t)``) adds ``e^sink`` to each row's denominator without a value: the lse includes it
    (an empty row's lse is its sink), the max logit does not (it is the max over scored keys).
    """
    m, norm, acc = state
    top = m
    if sink is not None:
        top = jnp.maximum(m, sink)
        safe_top = jnp.where(top == -jnp.inf, jnp.zeros_like(top), top)
        alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - safe_top))
        norm = norm * alpha + jnp.exp(sink - safe_top)
        acc = acc * alpha[..., None]
    safe = jnp.where(norm == 0, jnp.ones_like(norm), norm)
    lse = jnp.where(norm == 0, -jnp.inf, top + jnp.log(safe))
    return (acc / safe[..., None]).astype(dtype), lse, m


def sink_grads(sink: Array, lse: Array, delta: Array) -> Array:
    """``d sink (B, t)`` per row: ``-e^(sink - lse) · delta`` (0 on rows with 0 output, whose delta is 0).

    ``sink`` ``(B, 1|t)``, ``lse (B, t)`` the saved log-sum-exp (sink included), ``delta`` from
    :func:`backward_rows` (``rowsum(dO ∘ O)`` less the lse's cotangent).
    """
    w = jnp.exp(jnp.where(lse == -jnp.inf, -jnp.inf, sink - jnp.where(lse == -jnp.inf, 0, lse).astype(sink.dtype)))
    return -w * delta


def mod_args(rows: Array, q_pos: Array, kv_pos: Array) -> tuple[Array, Array, Array, Array]:
    """``score_mod``'s index arguments for a tile: ``batch``, ``head`` ``(B, 1, 1)``, ``q_pos (1, t, 1)``, ``kv_pos (1, 1, s)``.

    ``rows (B, 2)`` holds each flattened leading row's (batch, head); positions are int32.
    """
    return rows[:, 0, None, None], rows[:, 1, None, None], q_pos[None, :, None], kv_pos[None, None, :]


def backward_rows(out: Array, d_out: Array, lse: Array, compute, d_lse: Array | None = None) -> tuple[Array, Array]:
    """Per query row for the backward: a finite ``lse (B, T)`` (0 on empty rows) and ``delta = rowsum(dO ∘ O) - d_lse``.

    ``d_lse (B, T)`` (optional) is the cotangent of the log-sum-exp: since ``d lse / dx = p``, it
    adds ``p · d_lse`` to each tile's ``dx = p (dp - delta)``, and to a sink's gradient
    ``-e^(sink - lse) · delta`` its ``e^(sink - lse) · d_lse`` (:func:`sink_grads`).
    """
    delta = jnp.sum(d_out.astype(compute) * out.astype(compute), -1)
    if d_lse is not None:  # an lse of -inf (a row with no key) depends on nothing
        delta = delta - jnp.where(lse == -jnp.inf, jnp.zeros((), compute), d_lse.astype(compute))
    lse = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), lse)  # empty rows have p = 0 by the mask anyway
    return lse, delta


def convert_mod(score_mod, b: int, t: int, s: int, compute, like=None) -> tuple:
    """``score_mod`` closure-converted for tiles ``(b, t, s)``: ``(fn, consts)``, or ``(None, ())`` without one.

    ``fn(score, batch, head, q_pos, kv_pos, *consts)`` takes the arrays ``score_mod`` closes over
    (a learned table, slopes) as explicit arguments (:func:`jax.closure_convert`), so a custom VJP
    can return their gradients. ``fn`` is specialised to these tile shapes (and, with ``like``,
    a function applied to the example arguments, to their types: inside ``shard_map`` they vary
    over the ring's axis).
    """
    if score_mod is None:
        return None, ()
    rows = jnp.zeros((b, 2), jnp.int32)
    example = (jnp.zeros((b, t, s), compute), *mod_args(rows, jnp.zeros((t,), jnp.int32), jnp.zeros((s,), jnp.int32)))
    fn, consts = jax.closure_convert(score_mod, *(example if like is None else like(example)))
    return fn, tuple(consts)


def bind_mod(fn, rows: Array, q_pos: Array, kv_pos: Array, compute):
    """``mod(s, consts)`` for one tile: ``fn`` of :func:`convert_mod` at this tile's rows and positions."""

    def mod(s, consts):
        x = fn(s, *mod_args(rows, q_pos, kv_pos), *consts)
        return jnp.broadcast_to(jnp.asarray(x).astype(compute), s.shape)

    return mod


def score_grads(s, keep, lse, do, vb, delta, scale, precision, compute, mod=None, consts=(), drop=None) -> tuple:
    """``p``, ``ds = p (dp - delta) scale`` of one tile, each ``(B, t, s)``, the gradients of ``consts`` and ``ds / scale``.

    With dropout's factor ``drop (B, t, s)`` (:func:`accumulate`) the first result is the dropped
    ``p ∘ drop`` (dv's weights) and ``dp = (dO vᵀ) ∘ drop``; ``delta = rowsum(dO ∘ O)`` is still
    ``rowsum(p ∘ dp)``, so ``ds`` keeps its form.

    From the saved ``lse (B, t)``, which must be finite (0 for empty rows, whose ``p`` is 0 by
    the mask); ``delta = rowsum(dO ∘ O)``. ``mod(s, consts)`` (optional) is the score
    modification: ``p`` is taken at ``mod(s)`` and ``p (dp - delta)`` is pulled back through it
    to ``s`` and to ``consts`` (a tuple of arrays; ``()`` without a modification). The last
    result, the gradient of the unscaled logits ``s``, is an additive bias's gradient.
    """
    if mod is None:
        x, pull = s, None
    else:
        x, pull = jax.vjp(mod, s, consts)
    p = exp_below_one(x - lse[..., None])  # clamped at 1, as shifted_exp
    if keep is not None:
        p = jnp.where(keep, p, jnp.zeros((), p.dtype))
    dp = jnp.einsum("bte,bse->bts", do, vb, precision=precision, preferred_element_type=compute)
    if drop is not None:
        dp = dp * drop
    dx = p * (dp - delta[..., None])
    dconsts = ()
    if pull is not None:
        dx, dconsts = pull(dx)
    return p if drop is None else p * drop, dx * scale, dconsts, dx


def tile_grads(p: Array, ds: Array, qt: Array, kb: Array, dot: Array, precision, compute) -> tuple[Array, Array, Array]:
    """One tile's shares of the gradients: ``dq (B, t, D)`` and, transposed, ``dkᵀ (B, D, s)``, ``dvᵀ (B, E, s)``.

    From ``p, ds (B, t, s)`` (:func:`score_grads`), the query block transposed ``qt (B, D, t)``,
    ``kb (B, s, D)`` and the output cotangent transposed ``dot (B, E, t)`` (:func:`transposed`:
    once per query block), accumulated in ``compute``. dk and dv are computed transposed, as
    ``qᵀ ds`` and ``dOᵀ p``, each operand contracted on its natural axis: XLA:CPU hands those to
    its fast matmul, where ``dsᵀ q`` (contracting the tile's first axis) ran at 60% of the rate.
    Keep them transposed where they accumulate: XLA folds a transpose of the result back into
    the slow form.
    """

    def dot_(spec, a, b):
        return jnp.einsum(spec, a, b.astype(compute), precision=precision, preferred_element_type=compute)

    dkt, dvt = dot_("bdt,bts->bds", qt.astype(compute), ds), dot_("bet,bts->bes", dot.astype(compute), p)
    return dot_("bts,bsd->btd", ds, kb), dkt, dvt


def transposed(x: Array) -> Array:
    """``(B, t, X)`` as ``(B, X, t)``: the query side of :func:`tile_grads`, and its dk, dv back."""
    return jnp.swapaxes(x, 1, 2)
