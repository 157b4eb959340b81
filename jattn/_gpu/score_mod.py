"""A ``score_mod`` read inside the GPU kernel: split into what each row needs and what each tile computes.

jattn's score modification is ``(score, batch, head, q_pos, kv_pos) -> score`` (:mod:`jattn.score_mods`).
It is traced once (:func:`jax.make_jaxpr`, every array it closes over, concrete or traced, a const)
and its equations are split in two (:func:`convert`):

* the *row* part: what depends only on ``batch``, ``head`` and the closed-over arrays (ALiBi's
  ``slopes[head]``, a learned per-head scale). It runs outside the kernel, once per row of the
  flattened leading dims (``jax.vmap`` over :func:`jattn._arrays.head_rows`), and ordinary JAX
  autodiff carries its gradients back to the arrays;
* the *tile* part: the rest, evaluated in the kernel on ``score (bq, bk)`` float32, ``q_pos
  (bq, 1)`` and ``kv_pos (1, bk)`` int32 absolute positions and the row's values, which the
  kernels read by row index (a scalar per row for ALiBi: no gather in the kernel, as Triton wants).

The dq kernel pulls each tile's ``dx`` back through the tile part to the scores and to the row
values (accumulated per row and query block, summed outside). The kernel's reference path (its
second order) reads the same row values through :func:`on_rows` (the tile part traced for one score when
the call is, :func:`pointwise`): they are its operands, so the second derivative reaches them (and,
outside, the arrays the modification closes over).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.extend import core as jex

__all__ = ["TileMod", "backend_name", "convert", "merge", "on_rows", "pointwise", "unlowerable"]


def _run(eqns, env: dict) -> None:
    """Evaluates ``eqns`` in order, reading and writing variables in ``env``."""

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for eqn in eqns:
        ans = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans], strict=True))


def merge(values: tuple, floats: tuple[bool, ...], floating: tuple) -> tuple:
    """``values`` with its floating entries (``floats`` True) replaced, in order, by ``floating``."""
    it = iter(floating)
    return tuple(next(it) if f else c for c, f in zip(values, floats, strict=True))


@dataclasses.dataclass(frozen=True, eq=False)
class TileMod:
    """The tile part of a score modification: the kernel's ``apply`` and ``pullback`` (see the module docstring).

    ``floats`` says which row values are floating (they get gradients); ``count`` how many there are.
    """

    eqns: tuple
    score: object  # the variables of score, q_pos, kv_pos, the row values, and the result
    q_pos: object
    kv_pos: object
    rows: tuple
    out: object
    floats: tuple[bool, ...]

    @property
    def count(self) -> int:
        """How many row values the tile part reads."""
        return len(self.rows)

    def apply(self, s: Array, q_pos: Array, kv_pos: Array, values) -> Array:
        """The modified scores ``(bq, bk)`` float32 of ``s (bq, bk)`` at ``q_pos (bq,)``, ``kv_pos (bk,)``, with the row's values."""
        env = {self.score: s, self.q_pos: q_pos[:, None], self.kv_pos: kv_pos[None, :]}
        env.update(zip(self.rows, values, strict=True))
        _run(self.eqns, env)
        x = self.out.val if isinstance(self.out, jex.Literal) else env[self.out]
        return jnp.broadcast_to(jnp.asarray(x).astype(jnp.float32), s.shape)

    def pullback(self, s: Array, q_pos: Array, kv_pos: Array, values) -> tuple:
        """``(x, pull)``: the modified scores and ``pull(dx) -> (ds, dvalues)``, ``dvalues`` of the floating values."""
        floats = tuple(c for c, f in zip(values, self.floats, strict=True) if f)

        def at(s, fl):
            return self.apply(s, q_pos, kv_pos, merge(values, self.floats, fl))

        return jax.vjp(at, s, floats)

    def tangent(self, s: Array, ds: Array, q_pos: Array, kv_pos: Array, values, dvalues) -> tuple[Array, Array]:
        """``(x, dx)``: the modified scores and their tangent for ``ds`` and the floating values' tangents ``dvalues``."""
        floats = tuple(c for c, f in zip(values, self.floats, strict=True) if f)

        def at(s, fl):
            return self.apply(s, q_pos, kv_pos, merge(values, self.floats, fl))

        return jax.jvp(at, (s, floats), (ds, tuple(dvalues)))


def _primitives(jaxpr) -> set[str]:
    """The names of the primitives of ``jaxpr`` and of every jaxpr inside its equations (pjit, custom_jvp, ...)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jex.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def _lowering_rules(backend: str) -> set[str] | None:
    """The primitives Pallas' lowering for ``backend`` has a rule for, or None where this JAX does not say.

    JAX keeps the tables in private modules (``jax._src.pallas.triton.lowering``; Mosaic GPU's, keyed by
    lowering and primitive semantics, in ``jax._src.pallas.mosaic_gpu.lowering``: jattn's kernels use the
    default, lane lowering of warpgroup primitives); they are read, not changed. A table this JAX does not
    have (``None``) refuses nothing here: JAX's own lowering error is then the answer.
    """
    try:
        if backend == "triton":
            from jax._src.pallas.triton import lowering

            table = getattr(lowering, "triton_lowering_rules", {})
        else:
            from jax._src.pallas.mosaic_gpu import core, lowering
            from jax.experimental.mosaic.gpu import core as mgpu

            key = (mgpu.LoweringSemantics.Lane, core.PrimitiveSemantics.Warpgroup)
            table = getattr(lowering, "mosaic_lowering_rules", {}).get(key, {})
    except (ImportError, AttributeError):
        return None
    names = {p.name for p in table}
    # the Mosaic GPU kernels bind a pullback's add_any as add (jax 0.10 has no rule for it: mosaic_mod)
    return (names | ({"add_any"} if backend != "triton" else set())) if names else None


def backend_name(backend: str) -> str:
    """``backend`` as messages name it: "Triton" or "Mosaic GPU"."""
    return "Triton" if backend == "triton" else "Mosaic GPU"


def unlowerable(mod: TileMod, bq: int, bk: int, backend: str = "triton") -> tuple[str, ...]:
    """The primitives of ``mod``'s tile part, forward, pullback and tangent, that ``backend`` cannot lower (sorted).

    ``()`` if none. A gather (T5's ``table[bucket, head]``, the bucket read per score) is one on both Triton
    and Mosaic GPU: the kernel refuses such a modification by name instead of failing inside JAX's lowering.
    """
    rules = _lowering_rules(backend)
    if rules is None:
        return ()
    s, q_pos, kv_pos = jnp.zeros((bq, bk), jnp.float32), jnp.zeros((bq,), jnp.int32), jnp.zeros((bk,), jnp.int32)
    values = tuple(jnp.zeros(v.aval.shape, v.aval.dtype) for v in mod.rows)

    def both(s, values):
        x, pull = mod.pullback(s, q_pos, kv_pos, values)
        floats = tuple(c for c, f in zip(values, mod.floats, strict=True) if f)
        return x, pull(jnp.ones_like(x)), mod.tangent(s, s, q_pos, kv_pos, values, floats)

    found = _primitives(jax.make_jaxpr(both)(s, values).jaxpr)
    return tuple(sorted(found - rules))


def convert(score_mod: Callable[..., Array] | None, bq: int, bk: int, rows: Array) -> tuple[TileMod | None, tuple]:
    """``(TileMod, values)`` of ``score_mod`` for tiles ``(bq, bk)``: ``values`` each ``(b, ...)``, one per row of ``rows (b, 2)``.

    ``(None, ())`` without a modification.
    """
    if score_mod is None:
        return None, ()
    mod, row_values = _split(score_mod, bq, bk)
    return mod, tuple(jax.vmap(row_values)(rows[:, 0], rows[:, 1])) if mod.count else ()


def pointwise(score_mod: Callable[..., Array] | None, like: TileMod | None) -> TileMod | None:
    """The tile part of ``score_mod`` traced for one score, ``(1, 1)``, now; the same row values as ``like``'s.

    :func:`on_rows` maps it over tiles of any shape. It is traced when the call is (the arrays the
    modification closes over are live then, traced ones included): a derivative taken later (second order)
    must not trace ``score_mod`` again, since its closed-over tracers belong to a transformation that has
    ended by then (JAX raises ``UnexpectedTracerError``).
    """
    if score_mod is None:
        return None
    mod = _split(score_mod, 1, 1)[0]
    if [v.aval for v in mod.rows] != [v.aval for v in like.rows]:
        raise ValueError(
            f"score_mod reads different row values for a tile of (1, 1) ({[v.aval for v in mod.rows]}) and of the "
            f"kernel's blocks ({[v.aval for v in like.rows]}): a score modification must be a function of each "
            "score, its batch, head and positions only"
        )
    return mod


def on_rows(mod: TileMod, heads: int, values: tuple) -> Callable:
    """The tile part ``mod`` (:func:`pointwise`) as a score modification of the kernel's row ``values`` (each ``(b, ...)``).

    A score modification for another path on the call's operands, ``heads`` rows per batch
    (``prod(lead[1:])``): each score's row ``batch · heads + head`` reads its values and goes through
    the tile part, score by score, so derivatives taken through it reach the values (the arrays the
    modification closes over are read through them only).
    """

    def one(s: Array, q_pos: Array, kv_pos: Array, values: tuple) -> Array:  # one score
        return mod.apply(s[None, None], q_pos[None], kv_pos[None], values)[0, 0]

    per_score = jax.vmap(jax.vmap(jax.vmap(one, (0, None, 0, None)), (0, 0, None, None)), (0, 0, 0, 0))

    def modified(s: Array, batch: Array, head: Array, q_pos: Array, kv_pos: Array) -> Array:
        t, u = s.shape[-2:]
        shape = jnp.broadcast_shapes(*(x.shape[:-2] for x in (s, batch, head, q_pos, kv_pos)))
        g = math.prod(shape)
        row = jnp.broadcast_to(batch * heads + head, (*shape, 1, 1)).reshape(g)
        flat = jnp.broadcast_to(s, (*shape, t, u)).reshape(g, t, u).astype(jnp.float32)
        qp = jnp.broadcast_to(q_pos, (*shape, t, 1)).reshape(g, t)
        kp = jnp.broadcast_to(kv_pos, (*shape, 1, u)).reshape(g, u)
        x = per_score(flat, qp, kp, tuple(jnp.take(x, row, axis=0) for x in values))
        return x.reshape(*shape, t, u)

    return modified


def _split(score_mod: Callable[..., Array], bq: int, bk: int) -> tuple[TileMod, Callable]:
    """``(TileMod, row_values)``: the tile part for tiles ``(bq, bk)`` and ``row_values(batch, head) -> values``."""
    index = jnp.zeros((), jnp.int32)
    example = (
        jnp.zeros((bq, bk), jnp.float32),
        index,
        index,
        jnp.zeros((bq, 1), jnp.int32),
        jnp.zeros((1, bk), jnp.int32),
    )
    closed = jax.make_jaxpr(score_mod)(*example)
    jaxpr = closed.jaxpr
    s, batch, head, q_pos, kv_pos = jaxpr.invars
    row_level = {*jaxpr.constvars, batch, head}
    row_eqns, tile_eqns = [], []
    for eqn in jaxpr.eqns:
        if all(isinstance(v, jex.Literal) or v in row_level for v in eqn.invars):
            row_eqns.append(eqn)
            row_level.update(eqn.outvars)
        else:
            tile_eqns.append(eqn)
    used = [v for e in tile_eqns for v in e.invars if not isinstance(v, jex.Literal)] + list(jaxpr.outvars)
    needed = tuple(dict.fromkeys(v for v in used if not isinstance(v, jex.Literal) and v in row_level))

    def row_values(b, h):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update({batch: b, head: h})
        _run(row_eqns, env)
        return tuple(env[v] for v in needed)

    floats = tuple(bool(jnp.issubdtype(v.aval.dtype, jnp.floating)) for v in needed)
    return TileMod(tuple(tile_eqns), s, q_pos, kv_pos, needed, jaxpr.outvars[0], floats), row_values
