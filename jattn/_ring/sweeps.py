"""The sweeps of ring attention: forward, backward and tangent, each P steps around the ring.

Shapes are the local slices of :mod:`jattn._ring.attention` with leading dimensions flattened to ``B``: q
``(B, T, D)``, k ``(B, S, D)``, v ``(B, S, E)`` in ``C`` chunks of ``tc`` queries and ``sc`` keys
(C = 1 contiguous, 2 zigzag). :class:`Ring` holds the static facts of a call. At step n device r
holds the key slice of device ``r - n`` (mod P) and folds each (query chunk, key chunk) pair in:
the forward into its online-softmax state (:func:`jattn._online.accumulate`), the backward into dq
here and into dk, dv that travel with the keys (:func:`backward`), the tangent into ``A`` and ``c``
with the lse known, as :mod:`jattn._blockwise.tangent` does for tiles, while dk and dv travel with k
and v (:func:`tangent`). ``remat=True`` checkpoints each step: the loops' second-order form
(:mod:`jattn._ring.rules`) then keeps a step's carry, not its tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jattn._arrays import vary
from jattn._masks import EMPTY, Mask
from jattn._online import (
    accumulate,
    backward_rows,
    bind_mod,
    empty_state,
    finish,
    per_block,
    scaled_scores,
    score_grads,
    sink_grads,
    tile_grads,
    transposed,
)
from jattn._softmax import exp_below_one

__all__ = ["Ring", "backward", "forward", "tangent"]


@dataclasses.dataclass(frozen=True, eq=False)
class Ring:
    """Static facts of one ring call (hashable by identity; built once per trace)."""

    axis_name: str
    p: int  # devices on the ring
    owned: np.ndarray  # (P, C) global chunk of each local chunk
    kinds: np.ndarray  # (P·C, P·C) EMPTY / PARTIAL / FULL of (query chunk, key chunk)
    predicate: Mask | None
    tc: int  # local query chunk length
    sc: int  # local key chunk length
    q_offset: int
    scale: float
    segments: bool
    compute: jnp.dtype
    mod: object = None  # the closure-converted score_mod (jattn._online.convert_mod), or None
    sinks: bool = False

    def kind(self, r: Array, src: Array, a: int, b: int) -> Array:
        owned, kinds = jnp.asarray(self.owned, jnp.int32), jnp.asarray(self.kinds)
        return kinds[owned[r, a], owned[src, b]].astype(jnp.int32)

    def positions(self, r, src, a: int, b: int) -> tuple[Array, Array]:
        """Global positions ``(tc,)`` of local query chunk a and ``(sc,)`` of key chunk b of device src."""
        owned = jnp.asarray(self.owned, jnp.int32)
        i = self.q_offset + owned[r, a] * self.tc + jnp.arange(self.tc, dtype=jnp.int32)
        return i, owned[src, b] * self.sc + jnp.arange(self.sc, dtype=jnp.int32)

    def modifier(self, rows, r, src, a: int, b: int):
        """``mod(s, consts)`` of this chunk pair (:func:`jattn._online.bind_mod`), or None."""
        return None if self.mod is None else bind_mod(self.mod, rows, *self.positions(r, src, a, b), self.compute)

    def scores(self, qc, kc, qsc, ksc, r, src, a, b, masked, precision):
        """Scaled scores ``(B, tc, sc)`` of local query chunk a against key chunk b of device src, and the mask."""
        s = scaled_scores(qc, kc, self.scale, self.compute, precision)
        if not masked:
            return s, None
        i, j = self.positions(r, src, a, b)
        keep = jnp.ones((1, self.tc, self.sc), bool)
        if self.predicate is not None:
            keep = self.predicate.allowed(i[:, None], j[None, :])[None]
        if self.segments:
            keep = keep & (qsc[:, :, None] == ksc[:, None, :])
        return s, keep

    def shift(self, *xs: Array) -> tuple[Array, ...]:
        """Sends each array to the next device on the ring."""
        perm = [(d, (d + 1) % self.p) for d in range(self.p)]
        return tuple(jax.lax.ppermute(x, self.axis_name, perm) for x in xs)


def _unpack(travelling: tuple[Array, ...], c: int, segments: bool) -> list[list[Array | None]]:
    """Chunks of each travelling array; the key segment ids (last) travel only when there are any."""
    parts = [_chunks(x, c) for x in travelling]
    return parts if segments else [*parts, [None] * c]


def _chunks(x: Array, c: int) -> list[Array]:
    """``(B, C·n, ...) -> C`` arrays ``(B, n, ...)``."""
    return jnp.split(x, c, axis=1)


def _around(ring: Ring, step, carry, travelling, remat: bool = False):
    """Runs ``step(n, carry, travelling) -> (carry, travelling)`` for n = 0..P-1.

    ``travelling`` goes to the next device between steps (P-1 hops, a loop of one compiled step);
    ``remat``: each step checkpointed.
    """
    step = jax.checkpoint(step) if remat else step

    def body(n, c):
        carry, travelling = step(n, *c)
        return carry, ring.shift(*travelling)

    carry, travelling = jax.lax.fori_loop(0, ring.p - 1, body, (carry, travelling))
    return step(ring.p - 1, carry, travelling)


def forward(q, k, v, q_seg, kv_seg, rows, sinks, consts, ring: Ring, precision) -> tuple[Array, Array, Array]:
    """``out (B, T, E)``, ``lse (B, T)`` and the row max logit ``(B, T)`` of the local queries against every key."""
    c = ring.owned.shape[1]
    r = jax.lax.axis_index(ring.axis_name)
    qc, qsc = _chunks(q, c), _chunks(q_seg, c)

    def step(n, states, travelling):
        src = (r - jnp.asarray(n, r.dtype)) % ring.p
        kc, vc, ksc = _unpack(travelling, c, ring.segments)
        states = list(states)
        for a in range(c):
            for b in range(c):

                def update(state, masked, a=a, b=b):
                    s, keep = ring.scores(qc[a], kc[b], qsc[a], ksc[b], r, src, a, b, masked, precision)
                    mod = ring.modifier(rows, r, src, a, b)
                    s = s if mod is None else mod(s, consts)
                    return accumulate(state, s, keep, vc[b], precision, ring.compute)

                states[a] = per_block(ring.kind(r, src, a, b), update, states[a])
        return tuple(states), travelling

    init = tuple(vary(empty_state(q.shape[0], ring.tc, v.shape[-1], ring.compute), q) for _ in range(c))
    states, _ = _around(ring, step, init, (k, v, kv_seg) if ring.segments else (k, v))
    sink = sinks[:, None].astype(ring.compute) if ring.sinks else None
    outs = zip(*(finish(st, v.dtype, sink) for st in states), strict=True)
    return tuple(jnp.concatenate(x, 1) for x in outs)


def _shared_sum(g: Array, like: Array, axis_name: str) -> Array:
    """The gradient ``g`` of ``like`` from this device, summed over the ring where ``like`` is shared by all devices."""
    return g if axis_name in jax.typeof(like).manual_axis_type.varying else jax.lax.psum(g, axis_name)


def _ring_sink_grads(ring: Ring, sinks: Array, lse: Array, delta: Array) -> Array:
    """The gradient of the sink logits ``(B,)`` (zeros without sinks), from the saved ``lse (B, T)`` (-inf on rows with no key).

    ``delta (B, T)`` is :func:`jattn._online.backward_rows`'s; summed over the ring where the sinks are shared.
    """
    if not ring.sinks:
        return jnp.zeros_like(sinks)
    dsinks = sink_grads(sinks[:, None].astype(ring.compute), lse, delta).sum(-1).astype(sinks.dtype)
    return _shared_sum(dsinks, sinks, ring.axis_name)


def _zero_const_grads(consts: tuple[Array, ...], axis_name: str) -> tuple[Array, ...]:
    """Zero gradients of the arrays a score_mod closes over, each varying over the ring where the array does."""
    # A modification's pullback psums the gradient of an array shared by the devices itself (the
    # transpose of making it varying), so dc starts with each array's own type.
    return tuple(
        vary(jnp.zeros(x.shape, x.dtype), x) if axis_name in jax.typeof(x).manual_axis_type.varying else
        jnp.zeros(x.shape, x.dtype) for x in consts
    )  # fmt: skip


def backward(res: tuple, d_out: Array, d_lse: Array, ring: Ring, precision, remat: bool = False) -> tuple:
    """``(dq, dk, dv, d sinks, d consts)`` from the cotangents of out and lse: a second ring.

    ``res = (q, k, v, q_seg, kv_seg, rows, sinks, consts, out, lse)``; dq accumulates here, dk and dv
    travel with their key slice and arrive home after P steps.
    """
    q, k, v, q_seg, kv_seg, rows, sinks, consts, out, lse = res
    c, compute = ring.owned.shape[1], ring.compute
    finite, delta = backward_rows(out, d_out, lse, compute, d_lse)  # (B, T) each
    dsinks = _ring_sink_grads(ring, sinks, lse, delta)
    lse = finite
    r = jax.lax.axis_index(ring.axis_name)
    scale = jnp.asarray(ring.scale, compute)
    qc, qsc, doc = _chunks(q, c), _chunks(q_seg, c), _chunks(d_out, c)
    qtc, dotc = [transposed(x) for x in qc], [transposed(x) for x in doc]  # for tile_grads
    shared = consts
    lsec, deltac = _chunks(lse, c), _chunks(delta, c)

    def step(n, carry, travelling):
        dq, dc = carry
        src = (r - jnp.asarray(n, r.dtype)) % ring.p
        kc, vc, ksc = _unpack(travelling[2:], c, ring.segments)
        dkc, dvc = (jnp.split(x, c, axis=-1) for x in travelling[:2])  # dk, dv travel with k, v, transposed
        dq = list(dq)
        for a in range(c):
            for b in range(c):

                def update(carry, masked, a=a, b=b, live=None):
                    dq_a, dk_b, dv_b, dc = carry
                    s, keep = ring.scores(qc[a], kc[b], qsc[a], ksc[b], r, src, a, b, masked, precision)
                    keep = keep if live is None else keep & live
                    mod = ring.modifier(rows, r, src, a, b)
                    p, ds, gc, _ = score_grads(
                        s, keep, lsec[a], doc[a], vc[b], deltac[a], scale, precision, compute, mod, consts
                    )
                    gq, gk, gv = tile_grads(p, ds, qtc[a], kc[b], dotc[a], precision, compute)
                    return dq_a + gq, dk_b + gk, dv_b + gv, jax.tree.map(jnp.add, dc, gc)

                kind, carry = ring.kind(r, src, a, b), (dq[a], dkc[b], dvc[b], dc)
                if ring.mod is None:
                    dq[a], dkc[b], dvc[b], dc = per_block(kind, update, carry)
                else:
                    # The gradient of an array shared by the devices ends in a psum (the transpose of
                    # making it varying) inside the modification's pullback: every device must run
                    # it, so no branch; an empty pair contributes 0 through its all-False mask.
                    dq[a], dkc[b], dvc[b], dc = update(carry, True, live=kind != EMPTY)
        return (tuple(dq), dc), (jnp.concatenate(dkc, -1), jnp.concatenate(dvc, -1), *travelling[2:])

    dq = tuple(vary(jnp.zeros(x.shape, compute), q) for x in qc)
    dc = _zero_const_grads(consts, ring.axis_name)
    # dk and dv travel transposed, (B, D|E, S), as tile_grads gives them: each tile's share is added
    # without a transpose, which XLA would fold back into a slow dsᵀ q form
    dk, dv = vary(tuple(jnp.zeros((x.shape[0], x.shape[2], x.shape[1]), compute) for x in (k, v)), k)
    travelling = (dk, dv, k, v, kv_seg) if ring.segments else (dk, dv, k, v)
    (dq, dc), (dk, dv, *_) = _around(ring, step, (dq, dc), travelling, remat)
    dk, dv = (transposed(x) for x in ring.shift(dk, dv))  # the last hop takes each slice's gradients home
    dq = jnp.concatenate(dq, 1)
    dc = tuple(g.astype(x.dtype) for g, x in zip(dc, shared, strict=True))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, dc


def tangent(res: tuple, lin: tuple, ring: Ring, precision, remat: bool = False) -> tuple[Array, Array]:
    """``d out (B, T, E)`` and ``d lse (B, T)`` for the tangents ``lin = (dq, dk, dv, d sinks, d consts)``.

    ``res`` as for :func:`backward`. With the lse known each chunk pair adds ``A += P·dv + (P∘dx)·v`` and
    ``c += rowsum(P∘dx)``, ``dx = (dq kᵀ + q dkᵀ)·scale`` (through the score modification's jvp), while
    dk and dv travel with k and v; then ``d lse = c + e^(sink - lse)·d sink`` and ``d out = A - d lse · out``.
    """
    q, k, v, q_seg, kv_seg, rows, sinks, consts, out, lse = res
    dq, dk, dv, d_sinks, d_consts = lin
    c, compute = ring.owned.shape[1], ring.compute
    finite = jnp.where(lse == -jnp.inf, jnp.zeros_like(lse), lse)
    r = jax.lax.axis_index(ring.axis_name)
    qc, dqc, qsc, lsec = _chunks(q, c), _chunks(dq, c), _chunks(q_seg, c), _chunks(finite, c)

    def step(n, acc, travelling):
        src = (r - jnp.asarray(n, r.dtype)) % ring.p
        kc, vc, dkc, dvc, ksc = _unpack(travelling, c, ring.segments)
        acc = list(acc)
        for a in range(c):
            for b in range(c):

                def update(carry, masked, a=a, b=b):
                    s, keep = ring.scores(qc[a], kc[b], qsc[a], ksc[b], r, src, a, b, masked, precision)
                    ds = scaled_scores(dqc[a], kc[b], ring.scale, compute, precision)
                    ds = ds + scaled_scores(qc[a], dkc[b], ring.scale, compute, precision)
                    mod = ring.modifier(rows, r, src, a, b)
                    if mod is not None:
                        s, ds = jax.jvp(mod, (s, consts), (ds, d_consts))
                    p = exp_below_one(s - lsec[a][..., None])
                    pds = p * ds
                    if keep is not None:
                        p, pds = jnp.where(keep, p, 0), jnp.where(keep, pds, 0)
                    acc_a, c_a = carry
                    acc_a = acc_a + _dot(p, dvc[b], compute, precision) + _dot(pds, vc[b], compute, precision)
                    return acc_a, c_a + jnp.sum(pds, -1)

                acc[a] = per_block(ring.kind(r, src, a, b), update, acc[a])
        return tuple(acc), travelling

    zeros = (jnp.zeros((q.shape[0], ring.tc, v.shape[-1]), compute), jnp.zeros((q.shape[0], ring.tc), compute))
    init = tuple(vary(zeros, q, k, out) for _ in range(c))
    travelling = (k, v, dk, dv, kv_seg) if ring.segments else (k, v, dk, dv)
    acc, _ = _around(ring, step, init, travelling, remat)
    a, cc = (jnp.concatenate(x, 1) for x in zip(*acc, strict=True))
    if ring.sinks:
        cc = cc + jnp.exp(sinks[:, None].astype(compute) - finite) * d_sinks[:, None].astype(compute)
    cc = jnp.where(lse == -jnp.inf, jnp.zeros_like(cc), cc)
    d_out = (a - cc[..., None] * out.astype(compute)).astype(out.dtype)
    return vary((d_out, cc.astype(lse.dtype)), out, lse)


def _dot(p: Array, vb: Array, compute, precision) -> Array:
    """``p (B, t, s) @ vb (B, s, E)`` accumulated in ``compute``."""
    return jnp.einsum("bts,bse->bte", p, vb.astype(compute), precision=precision, preferred_element_type=compute)
