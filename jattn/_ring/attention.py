"""Sequence-parallel ring attention, for use inside :func:`jax.shard_map`.

Each of the P devices along a mesh axis holds one slice of the sequence: queries ``(B, T, D)``
and keys/values ``(B, S, D|E)`` of a global sequence of P·T queries and P·S keys (dimension key:
:mod:`jattn._core`, with T and S the *local* lengths). P steps; at step n device r holds the
key/value slice of device ``r - n`` (mod P), folds it into its online-softmax state with the same
update as the blockwise path (:func:`jattn._online.accumulate`), then passes it on with
``lax.ppermute`` to device ``r + 1``. After P steps every query has seen every key, and no device
ever holds more than two slices.

Layouts of the global sequence over devices:

* ``'contiguous'``: device r holds positions ``[r·T, (r+1)·T)``.
* ``'zigzag'``: the sequence is cut into 2P chunks and device r holds chunks r and 2P-1-r, so
  under a causal mask every device does the same work at every step (load balance). Use
  :func:`zigzag` / :func:`unzigzag` to lay a global array out this way.

Masks are :class:`jattn.masks.Mask` predicates of *global* positions (queries aligned
bottom-right as in the core: query positions start at ``P·S - P·T``). Each (query chunk, key
chunk) pair is classified statically from the layout; an empty pair is skipped, a full one
drops the mask. Packed sequences use ``segment_ids``, whose key part travels around the ring
with the keys.

The sweeps are in :mod:`jattn._ring.sweeps`. The backward pass is a second ring: dq accumulates on
its device while the dk and dv of a key slice travel with that slice (transposed, as the tile
gradients come) and arrive home after P steps; forward mode is a third, whose tangents dk and dv
travel with k and v. Their derivative rules (every order, :mod:`jattn._ring.rules`) are those of
the blockwise path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._arrays import compute_dtype, flat_lead, head_rows, vary
from jattn._checks import broadcast_all, check_mask, check_qkv, check_score_mod, check_sinks, default_scale
from jattn._masks import FULL, PARTIAL, KeyBelow, Mask
from jattn._online import convert_mod
from jattn._ring.rules import ring as ring_rule
from jattn._ring.sweeps import Ring

__all__ = ["ring_attention", "sequence_parallel_attention", "unzigzag", "zigzag"]

LAYOUTS = ("contiguous", "zigzag")


def _owned(layout: str, p: int) -> np.ndarray:
    """``(P, C)``: the global chunk indices each device holds, in local order."""
    r = np.arange(p)
    return r[:, None] if layout == "contiguous" else np.stack([r, 2 * p - 1 - r], 1)


def zigzag(x: ArrayLike, num_devices: int, axis: int = -2) -> Array:
    """Reorders the sequence ``axis`` of a global array into the ``'zigzag'`` layout.

    After it, contiguous sharding over ``num_devices`` gives device r the chunks r and 2P-1-r.
    """
    x = jnp.asarray(x)
    n = x.shape[axis]
    if n % (2 * num_devices):
        raise ValueError(f"zigzag needs a length divisible by 2 * num_devices = {2 * num_devices}, got {x.shape}")
    chunks = jnp.split(x, 2 * num_devices, axis)
    return jnp.concatenate([chunks[g] for g in _owned("zigzag", num_devices).reshape(-1)], axis)


def unzigzag(x: ArrayLike, num_devices: int, axis: int = -2) -> Array:
    """The inverse of :func:`zigzag`."""
    x = jnp.asarray(x)
    if x.shape[axis] % (2 * num_devices):
        raise ValueError(f"unzigzag needs a length divisible by 2 * num_devices = {2 * num_devices}, got {x.shape}")
    chunks = jnp.split(x, 2 * num_devices, axis)
    order = np.argsort(_owned("zigzag", num_devices).reshape(-1))
    return jnp.concatenate([chunks[g] for g in order], axis)


def _check_mask(mask: object) -> None:
    check_mask(mask)
    if mask is not None and (not isinstance(mask, Mask) or mask.per_example or mask.per_row):
        raise ValueError(f"ring_attention takes a position-only jattn.masks predicate (or segment_ids), got {mask!r}")


def _check_segments(segment_ids, lead: tuple[int, ...], T: int, S: int):
    """``(q_segments (B, T), kv_segments (B, S))`` int arrays, batch on the first leading axis."""
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids must be one array or a pair (q, kv), got {len(segment_ids)} items")
        q_seg, kv_seg = map(jnp.asarray, segment_ids)
    else:
        q_seg = kv_seg = jnp.asarray(segment_ids)
    if not lead:
        raise ValueError("segment_ids need a batch axis in q, k, v (..., T, D)")
    for name, x, n in (("q segment_ids", q_seg, T), ("kv segment_ids", kv_seg, S)):
        if x.shape != (lead[0], n):
            raise ValueError(f"{name} must have shape (B, local length) = {(lead[0], n)}, got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be integer, got {x.dtype}")
    rest = math.prod(lead[1:])

    def flat(x, n):  # (B, n) -> (B·rest, n), matching the flattened leading axes of q
        return jnp.broadcast_to(x.astype(jnp.int32)[:, None], (lead[0], rest, n)).reshape(-1, n)

    return flat(q_seg, T), flat(kv_seg, S)


def ring_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    axis_name: str,
    mask: Mask | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    q_offset: int | None = None,
    kv_length: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    return_lse: bool = False,
    score_mod=None,
    sinks: ArrayLike | None = None,
    return_max_logit: bool = False,
) -> Array | tuple[Array, ...]:
    """Attention over a sequence sharded along mesh axis ``axis_name``; call inside ``jax.shard_map``.

    Shapes are the *local* slices (dimension key in :mod:`jattn._core`)::

        q    (..., T, D)   this device's queries; the global sequence has P·T
        k    (..., S, D)   this device's keys;    the global sequence has P·S
        v    (..., S, E)
        out  (..., T, E)   this device's outputs (lse (..., T) with ``return_lse``)

    Leading dimensions broadcast as in :func:`jattn.attention`. The result equals
    ``attention`` on the gathered global arrays (same contract: fully masked rows give 0 and
    zero gradients, low precision accumulates in float32), forward and backward.

    Args:
      q, k, v: local slices, one floating dtype.
      axis_name: the mesh axis the sequence is sharded over (P devices).
      mask: a :class:`jattn.masks.Mask` predicate of global positions (``causal()``,
        ``sliding_window(..)``, ``global_tokens(..)``, combinations); per-example masks are
        not accepted here: use ``segment_ids``.
      segment_ids: packed-sequence ids of the local slice, ``(B, T)`` for self-attention or a
        pair ``(q_segments (B, T), kv_segments (B, S))``; query and key attend only within
        equal ids (combined with ``mask``). B is the first leading axis of q.
      scale: logit scale, default ``1/sqrt(D)``.
      layout: ``'contiguous'`` or ``'zigzag'`` (see the module docstring); the same for q
        and kv.
      q_offset: global position of the first query; default ``P·S - P·T`` (bottom-right).
      kv_length: number of real keys in the global sequence; keys at positions from it on
        (padding that makes the length divisible) are masked.
      precision: matmul precision.
      return_lse: also return the log-sum-exp ``(..., T)``.
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score`` as in :func:`jattn.attention`,
        with *global* positions; arrays it closes over get gradients (summed over the ring
        where they are the same on every device).
      sinks: sink logits broadcastable to the leading dimensions, as in :func:`jattn.attention`.
      return_max_logit: also return the row max logit ``(..., T)`` (after ``return_lse``'s lse),
        a monitor without a gradient (the lse has one).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_mask(mask)
    check_score_mod(score_mod)
    p = jax.lax.axis_size(axis_name)
    c = 1 if layout == "contiguous" else 2
    T, S = q.shape[-2], k.shape[-2]
    if T % c or S % c:
        raise ValueError(f"layout='zigzag' needs even local lengths, got q {q.shape} and k {k.shape}")
    lead = broadcast_all(q=q, k=k, v=v)
    b = math.prod(lead)
    compute = compute_dtype(q.dtype)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        check_sinks(sinks, lead, q.dtype)
    sinks_f = jnp.zeros((b,), compute) if sinks is None else jnp.broadcast_to(sinks, lead).reshape(b)
    mod, consts = convert_mod(score_mod, b, T // c, S // c, compute, like=lambda xs: vary(xs, k))
    if segment_ids is None:
        q_seg, kv_seg = vary((jnp.zeros((b, T), jnp.int32), jnp.zeros((b, S), jnp.int32)), k)
    else:
        q_seg, kv_seg = _check_segments(segment_ids, lead, T, S)
    predicate = mask
    if kv_length is not None:
        predicate = KeyBelow(int(kv_length)) if mask is None else mask & KeyBelow(int(kv_length))
    q_offset = p * S - p * T if q_offset is None else int(q_offset)
    if predicate is None:
        kinds = np.full((p * c, p * c), FULL, np.int8)
    else:
        kinds = predicate.block_kinds(p * T, p * S, T // c, S // c, q_offset=q_offset)
    if segment_ids is not None:
        kinds = np.where(kinds == FULL, PARTIAL, kinds).astype(np.int8)
    ring = Ring(
        axis_name=axis_name,
        p=p,
        owned=_owned(layout, p),
        kinds=kinds,
        predicate=predicate,
        tc=T // c,
        sc=S // c,
        q_offset=q_offset,
        scale=float(default_scale(scale, q.shape[-1])),
        segments=segment_ids is not None,
        compute=compute,
        mod=mod,
        sinks=sinks is not None,
    )
    qkv = (flat_lead(x, lead) for x in (q, k, v))
    rows = vary(head_rows(lead), k)
    out, lse, top = ring_rule(*qkv, q_seg, kv_seg, rows, sinks_f, consts, ring, precision)
    out, lse, top = out.reshape(*lead, T, v.shape[-1]), lse.reshape(*lead, T), top.reshape(*lead, T)
    extra = ((lse,) if return_lse else ()) + ((top,) if return_max_logit else ())
    return (out, *extra) if extra else out


def sequence_parallel_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    axis_name: str,
    mask: Mask | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    layout: str = "zigzag",
    precision: jax.lax.PrecisionLike = None,
) -> Array:
    """:func:`ring_attention` on *global* arrays, sharding their sequence axis over ``axis_name``.

    q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)`` -> ``(..., T, E)``, equal to
    ``attention(q, k, v, mask=mask)``. Runs ``jax.shard_map`` over ``axis_name`` only (other
    mesh axes, such as a data axis, stay under the compiler's automatic sharding), pads T and S
    to a multiple of the ring (masking the padded keys), and lays the sequence out in
    ``layout`` order. ``mesh`` defaults to the one set by ``jax.set_mesh``. Use inside ``jit``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v)
    _check_mask(mask)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    p = mesh.shape[axis_name]
    unit = p * (1 if layout == "contiguous" else 2)
    T, S = q.shape[-2], k.shape[-2]

    def pad(x):  # (..., L, X) -> (..., L', X), L' a multiple of unit, laid out in layout order
        # Zeros are concatenated rather than jnp.pad-ded: the transpose of pad (a negative pad) comes
        # back from XLA's SPMD partitioner with the padded shape (jax 0.10.2, seen on CPU).
        zeros = jnp.zeros((*x.shape[:-2], -x.shape[-2] % unit, x.shape[-1]), x.dtype)
        x = jnp.concatenate([x, zeros], axis=-2)
        return zigzag(x, p) if layout == "zigzag" else x

    ring = functools.partial(
        ring_attention,
        axis_name=axis_name,
        mask=mask,
        layout=layout,
        q_offset=S - T,
        kv_length=S if S % unit else None,
        precision=precision,
    )

    def spec(x):
        return jax.sharding.PartitionSpec(*(None,) * (x.ndim - 2), axis_name, None)

    qp, kp, vp = pad(q), pad(k), pad(v)
    out = jax.shard_map(
        ring,
        mesh=mesh,
        in_specs=(spec(qp), spec(kp), spec(vp)),
        out_specs=spec(qp),
        axis_names={axis_name},
    )(qp, kp, vp)
    out = unzigzag(out, p) if layout == "zigzag" else out
    return out[..., :T, :]
