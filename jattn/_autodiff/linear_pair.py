"""Two JAX primitives that are each other's transpose: a linear map with a hand-written transpose, at every order.

A derivative rule written with ``jax.custom_vjp`` gives reverse mode only (JAX refuses ``jvp`` of it),
and one written with ``jax.custom_jvp`` gets its reverse mode from JAX's transposition of the
tangent computation, slower than a hand-written backward (the blockwise tangent sweep transposed:
1.5x, docs: design notes). A :class:`LinearPair` keeps both: ``apply(res, t)``, linear in ``t``,
is one primitive, its transpose ``transpose(res, ct)`` the other, so that

- ``jax.jvp`` runs ``apply`` (forward mode), and reverse mode transposes it into ``transpose``
  (the hand-written backward), each from its fast implementation (``fast``);
- differentiating either in its residuals ``res`` (second order: grad of grad, Hessian-vector
  products) uses its reverse-differentiable implementation (``diff``, plain JAX loops of static
  length whose bodies are checkpointed), so JAX's own rules take every further order;
- ``vmap`` folds the mapped axis into the operands (``fold``) and binds the primitive again, or maps
  it element by element (:func:`jax.lax.map`) where it cannot fold.

Each primitive lowers to its fast implementation (:func:`jax.interpreters.mlir.lower_fun`), so it
runs, jit-compiles and exports like any JAX function. ``res`` and the linear operands are flat
lists of arrays; ``nres`` says where ``res`` ends. JAX's own ``linear_call`` (private in the pinned
JAX) does this for first order only: it has no batching rule and no derivative in its residuals.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from jattn._autodiff.batching import fold_or_map

__all__ = ["LinearPair"]

#: ``impl(direction, params, res, lin) -> outputs``: direction 0 applies the map, 1 its transpose.
Impl = Callable[[int, Hashable, list, list], list]
#: ``avals(direction, params, res, lin) -> output avals`` (they must be the types ``impl`` returns).
Avals = Callable[[int, Hashable, list, list], list]
#: ``fold(params, args, dims) -> (args, unfold)`` with the mapped axis folded in (``unfold`` restores
#: it on the outputs), or None where the operands cannot fold: then the call is mapped element by element.
Fold = Callable[[Hashable, list, list], tuple[list, Callable[[list], list]] | None]


class LinearPair:
    """A linear map ``apply(res, t)`` and its transpose, as two primitives (module docstring).

    ``fast`` and ``diff`` are :data:`Impl` (``diff`` reverse-differentiable in ``res``), ``avals``
    gives the outputs' types and ``fold`` folds a ``vmap`` (:data:`Fold`). :meth:`apply` binds the
    map, :meth:`transpose` its transpose; ``params`` (hashable) is passed through to all of them.
    """

    def __init__(self, name: str, *, fast: Impl, diff: Impl, avals: Avals, fold: Fold) -> None:
        """Registers the two primitives ``{name}_tangent`` and ``{name}_cotangent`` with JAX."""
        self.fast, self.diff, self.avals, self.fold = fast, diff, avals, fold
        self.prims = []
        for suffix in ("tangent", "cotangent"):
            prim = jex.core.Primitive(f"{name}_{suffix}")
            prim.multiple_results = True
            self.prims.append(prim)
        for direction, prim in enumerate(self.prims):
            self._register(direction, prim)

    def apply(self, params: Hashable, res: Sequence, lin: Sequence) -> list:
        """The map at ``res`` applied to the linear operands ``lin`` (forward mode)."""
        return self.prims[0].bind(*res, *lin, params=params, nres=len(res))

    def transpose(self, params: Hashable, res: Sequence, ct: Sequence) -> list:
        """The transpose at ``res`` applied to the cotangents ``ct`` of the map's outputs (reverse mode)."""
        return self.prims[1].bind(*res, *ct, params=params, nres=len(res))

    def _register(self, direction: int, prim) -> None:
        """Implementation, type, lowering, derivative, transpose and batching rules of one primitive."""

        def impl(*args, params, nres):
            return self.fast(direction, params, list(args[:nres]), list(args[nres:]))

        def abstract(*avals, params, nres):
            return self.avals(direction, params, list(avals[:nres]), list(avals[nres:]))

        prim.def_impl(impl)
        prim.def_abstract_eval(abstract)
        mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
        ad.primitive_jvps[prim] = lambda p, t, *, params, nres: self._jvp(direction, p, t, params, nres)
        ad.primitive_transposes[prim] = lambda ct, *a, params, nres: self._transposed(direction, ct, a, params, nres)
        batching.primitive_batchers[prim] = lambda a, d, *, params, nres: self._batched(direction, a, d, params, nres)

    def _bind(self, direction: int, params, res: list, lin: list) -> list:
        """The primitive of ``direction`` bound at ``res`` on ``lin``."""
        return self.prims[direction].bind(*res, *lin, params=params, nres=len(res))

    def _jvp(self, direction: int, primals, tangents, params, nres: int) -> tuple[list, list]:
        """``f(r, t)`` and its tangent ``f(r, dt) + ∂_r f(r, t)·dr``, the second from the differentiable form."""
        res, lin = list(primals[:nres]), list(primals[nres:])
        d_res, d_lin = list(tangents[:nres]), list(tangents[nres:])
        out = self._bind(direction, params, res, lin)
        d_out = self._bind(direction, params, res, [ad.instantiate_zeros(t) for t in d_lin])
        moved = [i for i, t in enumerate(d_res) if type(t) is not ad.Zero]
        if moved:  # the residuals' share, from the reverse-differentiable form (second order)

            def of_res(*xs):
                r = list(res)
                for i, x in zip(moved, xs, strict=True):
                    r[i] = x
                return self.diff(direction, params, r, lin)

            _, d_res_out = jax.jvp(of_res, tuple(res[i] for i in moved), tuple(d_res[i] for i in moved))
            d_out = [a + b for a, b in zip(d_out, d_res_out, strict=True)]
        return out, d_out

    def _transposed(self, direction: int, cts, args, params, nres: int) -> list:
        """The transpose rule: the other primitive on the cotangents; nothing for the residuals."""
        res, lin = list(args[:nres]), args[nres:]
        if any(ad.is_undefined_primal(x) for x in res):
            raise NotImplementedError("jattn: a LinearPair is linear in its operands after the residuals only")
        avals = self.avals(direction, params, [jax.typeof(x) for x in res], [_aval(x) for x in lin])
        cts = [jnp.zeros(a.shape, a.dtype) if type(c) is ad.Zero else c for c, a in zip(cts, avals, strict=True)]
        grads = self._bind(1 - direction, params, res, cts)
        return [None] * nres + [g if ad.is_undefined_primal(x) else None for g, x in zip(grads, lin, strict=True)]

    def _batched(self, direction: int, args, dims, params, nres: int) -> tuple[list, list]:
        """The batching rule: folded into the operands and bound again, or mapped element by element."""
        args, dims = list(args), list(dims)
        bind = lambda a: self._bind(direction, params, a[:nres], a[nres:])  # noqa: E731
        return fold_or_map(bind, self.fold(params, args, dims), args, dims)


def _aval(x):
    """The type of a linear operand of a transpose rule (an undefined primal holds its aval)."""
    return x.aval if ad.is_undefined_primal(x) else jax.typeof(x)
