"""A Mosaic GPU tile's score modification and dropout: the Triton kernel's, on whole ``(bq, bk)`` register tiles.

The score modification's tile part (:class:`jattn._gpu.score_mod.TileMod`) is evaluated on the scaled scores
with the tile's absolute positions as whole iotas (the ``wgmma`` layout has no ``(bq, 1)`` vectors) and each
row value (a scalar per kernel row, read from global memory) broadcast over the tile, so its derivative in a
value is a tile too: the kernels sum it over the keys, per query row. Dropout's bits are
:func:`jattn._dropout.keep_mask`'s (the blockwise path's) at the tile's grid positions. A transposed tile
(the dk/dv kernel's, keys first) passes transposed positions: every operation here is elementwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._checks import KernelRefusalError
from jattn._dropout import keep_mask
from jattn._gpu.mosaic_support import target
from jattn._gpu.score_mod import _run, merge

__all__ = ["check_mod", "dropped", "modified", "modified_jvp", "modified_vjp", "row_values"]


def check_mod(spec) -> None:
    """Raises :class:`KernelRefusalError` where a row value of the score modification is not a scalar."""
    if spec.mod is not None and any(v.aval.shape for v in spec.mod.rows):
        raise KernelRefusalError(
            "implementation='pallas' with the Mosaic GPU kernel takes a score_mod whose values per batch and head "
            f"are scalars (ALiBi's slope), got {[v.aval for v in spec.mod.rows]}; use implementation='blockwise'"
        )


def row_values(refs, r) -> tuple:
    """Row ``r``'s value of each of the score modification's arrays ``(b,)`` in global memory."""
    return tuple(ref[r] for ref in refs)


def _tiles(spec, values, shape) -> tuple:
    return tuple(plgpu.layout_cast(jnp.full(shape, v), target(spec).layout) for v in values)


def _apply(mod, x: Array, t: Array, s: Array, values: tuple) -> Array:
    env = {mod.score: x, mod.q_pos: t, mod.kv_pos: s}
    env.update(zip(mod.rows, values, strict=True))
    _run(mod.eqns, env)
    out = mod.out.val if hasattr(mod.out, "val") else env[mod.out]
    return jnp.broadcast_to(jnp.asarray(out).astype(jnp.float32), x.shape)


def modified(spec, x: Array, t: Array, s: Array, values: tuple) -> Array:
    """The modified scores of scaled scores ``x`` at absolute positions ``t``, ``s`` (``x``'s shape)."""
    return x if spec.mod is None else _apply(spec.mod, x, t, s, _tiles(spec, values, x.shape))


def modified_vjp(spec, x: Array, t: Array, s: Array, values: tuple):
    """``(x', pull)``: :func:`modified` and ``pull(dx) -> (ds, dvalues)``, each floating value's gradient a tile."""
    if spec.mod is None:
        return x, lambda dx: (dx, ())
    mod, full = spec.mod, _tiles(spec, values, x.shape)
    floats = tuple(c for c, f in zip(full, mod.floats, strict=True) if f)
    x, pull = jax.vjp(lambda x, fl: _apply(mod, x, t, s, merge(full, mod.floats, fl)), x, floats)
    return x, lambda dx: _without_add_any(pull, dx)


def _without_add_any(fn, *args):
    """``fn(*args)`` with its ``add_any`` (a transpose's sum of cotangents) bound as ``add``.

    jax 0.10's Mosaic GPU lowering has no rule for ``add_any``; it is ``add`` on arrays.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, jax.tree.leaves(args), strict=True))
    read = lambda v: v.val if hasattr(v, "val") else env[v]  # noqa: E731
    for eqn in closed.jaxpr.eqns:
        prim = lax.add_p if eqn.primitive.name == "add_any" else eqn.primitive
        ans = prim.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, ans if prim.multiple_results else [ans], strict=True))
    return jax.tree.unflatten(jax.tree.structure(shapes), [read(v) for v in closed.jaxpr.outvars])


def modified_jvp(spec, x: Array, dx: Array, t: Array, s: Array, values: tuple, dvalues: tuple):
    """``(x', dx')``: :func:`modified` and its tangent for ``dx`` and the floating values' tangents ``dvalues``."""
    if spec.mod is None:
        return x, dx
    mod, full = spec.mod, _tiles(spec, values, x.shape)
    floats = tuple(c for c, f in zip(full, mod.floats, strict=True) if f)
    at = lambda x, fl: _apply(mod, x, t, s, merge(full, mod.floats, fl))  # noqa: E731
    return jax.jvp(at, (x, floats), (dx, _tiles(spec, dvalues, x.shape)))


def dropped(spec, seed, t: Array, s: Array, p: Array) -> Array:
    """``p`` times dropout's factor at grid positions ``t``, ``s``: ``1 / keep_prob`` where row ``seed``'s bit keeps."""
    if not spec.dropout:
        return p
    return jnp.where(keep_mask(seed, t, s, spec.dropout), p * (1.0 / (1.0 - spec.dropout)), 0.0)
