"""A function and its tangent in one pass as one JAX primitive, split in two wherever JAX partially evaluates it.

A ``jax.custom_jvp`` rule that computes the primal and the tangent separately runs two sweeps where
one would do (attention's forward and its tangent share the scores and the softmax: docs, design
notes). Bound as one primitive, ``f(x)`` and ``∂f(x)·dx`` come from one kernel (``fast``), but
reverse mode needs the primal known before the tangent: linearisation (``jax.grad``,
``jax.linearize``) evaluates what depends only on ``x`` and stages the rest, and an indivisible
primitive with one unknown operand would make all of its outputs unknown. So a
:class:`OnePassJvp` tells JAX's two partial evaluators to trace ``split`` instead (the same values
as the primal function and a linear map of ``dx``, written so that JAX can transpose the second):

- ``jax.jvp`` (under ``jit``, ``vmap``, ``scan``...) binds the primitive: one pass;
- ``jax.linearize``, ``jax.grad`` and every reverse mode over it see ``split`` (the custom
  partial-evaluation rule of :class:`jax.interpreters.partial_eval.JaxprTrace`), and so do
  ``jax.checkpoint`` and ``scan``'s partial evaluation of a jaxpr that holds the primitive (its
  ``partial_eval_jaxpr_custom`` rule traces ``split`` into a ``closed_call`` and hands it on);
- its own derivative is ``split``'s (``jax.jvp`` of it): higher orders keep working;
- ``vmap`` folds the mapped axis into the operands (``fold``) or maps element by element;
- it lowers to ``fast``, or to ``split`` where the program is lowered for :func:`jax.export` (whose
  primitives then choose their portable forms).

Operands are flat lists: ``xs`` (where the function is evaluated), then ``dxs`` (their tangents);
``n`` says where ``xs`` ends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.extend as jex
from jax.extend import linear_util as lu
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from jattn._autodiff.batching import fold_or_map

__all__ = ["OnePassJvp"]

#: ``impl(params, xs, dxs) -> [*f(xs), *∂f(xs)·dxs]``, the outputs flat.
Impl = Callable[[Hashable, list, list], list]
#: ``avals(params, xs, dxs) -> the outputs' types``.
Avals = Callable[[Hashable, list, list], list]
#: ``fold(params, args, dims) -> (args, unfold)`` with ``vmap``'s axis folded in, or None (element by element).
Fold = Callable[[Hashable, list, list], tuple[list, Callable[[list], list]] | None]


class OnePassJvp:
    """``f(x)`` and ``∂f(x)·dx`` as one primitive ``{name}`` (module docstring).

    ``fast`` computes both in one pass, ``split`` the same values as the primal function and a
    linear map of ``dxs`` (reverse-differentiable and transposable), ``avals`` the outputs' types,
    ``fold`` folds a ``vmap``; the outputs are ``f``'s ``primals`` and then their tangents. :meth:`bind` applies it; ``params`` (hashable) reaches all of them.
    """

    def __init__(self, name: str, *, primals: int, fast: Impl, split: Impl, avals: Avals, fold: Fold) -> None:
        """Registers the primitive with JAX: implementation, type, lowering, derivative, batching, partial evaluation."""
        self.fast, self.split, self.avals, self.fold, self.primals = fast, split, avals, fold, primals
        prim = self.prim = jex.core.Primitive(name)
        prim.multiple_results = True
        prim.def_impl(lambda *args, params, n: fast(params, list(args[:n]), list(args[n:])))
        prim.def_abstract_eval(lambda *avals_, params, n: avals(params, list(avals_[:n]), list(avals_[n:])))
        mlir.register_lowering(prim, self._lowering)
        ad.primitive_jvps[prim] = self._jvp
        batching.primitive_batchers[prim] = self._batched
        pe.custom_partial_eval_rules[prim] = self._partial_eval
        pe.partial_eval_jaxpr_custom_rules[prim] = self._partial_eval_jaxpr

    def bind(self, params: Hashable, xs: Sequence, dxs: Sequence) -> list:
        """``[*f(xs), *∂f(xs)·dxs]``: the function at ``xs`` and its tangent along ``dxs``."""
        return self.prim.bind(*xs, *dxs, params=params, n=len(xs))

    def _split(self, params, n: int) -> Callable:
        """``split`` on the flat operands."""
        return lambda *args: self.split(params, list(args[:n]), list(args[n:]))

    def _lowering(self, ctx, *args, params, n: int):
        """``fast``, or ``split`` where the program is lowered for :func:`jax.export` (a portable artifact)."""
        if ctx.module_context.lowering_parameters.for_export:
            impl = self._split(params, n)
        else:
            impl = lambda *a: self.fast(params, list(a[:n]), list(a[n:]))  # noqa: E731
        return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)

    def _jvp(self, primals, tangents, *, params, n: int) -> tuple[list, list]:
        """The primitive's own derivative: ``split``'s."""
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        outs, d_outs = jax.jvp(self._split(params, n), tuple(primals), tuple(tangents))
        return list(outs), list(d_outs)

    def _partial_eval(self, trace, *tracers, params, n: int):
        """Linearisation: the primitive where every operand is known, else ``split`` traced in its place."""
        if all(t.is_known() for t in tracers):
            return trace.default_process_primitive(self.prim, tracers, dict(params=params, n=n))
        with jex.core.set_current_trace(trace):
            return self._split(params, n)(*tracers)

    def _partial_eval_jaxpr(self, saveable, unks_in, inst_in, eqn):
        """A jaxpr's partial evaluation (``jax.checkpoint``, ``scan``): ``split`` as a ``closed_call`` in the equation's place."""
        params, n = eqn.params["params"], eqn.params["n"]
        fn = self._split(params, n)
        split = lu.wrap_init(fn, debug_info=jax.api_util.debug_info("jattn one-pass jvp, split", fn, eqn.invars, {}))
        # traced on the operands' own types (their varying mesh axes under shard_map included)
        body, _, consts = pe.trace_to_jaxpr_dynamic(split, [v.aval for v in eqn.invars])
        jaxpr = jex.core.ClosedJaxpr(body, consts)
        closed_call = jex.core.primitives.closed_call_p
        call = jex.core.new_jaxpr_eqn(
            eqn.invars, eqn.outvars, closed_call, dict(call_jaxpr=jaxpr), jaxpr.effects, eqn.source_info, eqn.ctx
        )
        return pe.partial_eval_jaxpr_custom_rules[closed_call](saveable, unks_in, inst_in, call)

    def _batched(self, args, dims, *, params, n: int) -> tuple[list, list]:
        """Folded into the operands and bound again, or mapped element by element (:func:`jattn._autodiff.batching.fold_or_map`).

        Where only the tangents are mapped (``jax.jacfwd``), ``split`` under ``vmap``: ``f(x)`` stays
        unmapped, as ``jacfwd`` requires, and is computed once.
        """
        args, dims = list(args), list(dims)
        if all(d is None for d in dims[:n]):
            of_dxs = lambda *dxs: self.split(params, args[:n], list(dxs))  # noqa: E731
            axes = [None] * self.primals + [0] * self.primals  # f's outputs, then one tangent each
            return jax.vmap(of_dxs, in_axes=dims[n:], out_axes=axes)(*args[n:]), axes
        bind = lambda a: self.bind(params, a[:n], a[n:])  # noqa: E731
        return fold_or_map(bind, self.fold(params, args, dims), args, dims)
