"""The one XLA flag jattn sets, on import, before JAX starts its CPU backend: a route around an XLA:CPU miscompile.

jaxlib 0.10.2's XLA:CPU hands fused chains of elementwise operations and reductions to YNNPACK
("ynn fusions"). One of them is wrong: a reduction over a product with an operand broadcast along
a leading axis, whose result is broadcast again, gives wrong values past the first block of its
output (docs: transformations, "XLA:CPU's YNNPACK fusions", has a jax-only reproducer). The
softmax backward's row sums ``Σ out ⊙ d out`` with ``out`` shared by every tangent, i.e. second
order under ``vmap`` (``jax.hessian``, batched Hessian-vector products), build exactly that.

Importing jattn adds ``--xla_cpu_experimental_ynn_fusion_type=dot,individual_dot`` to
``XLA_FLAGS`` on the jaxlib releases where the reproducer was found wrong (:data:`AFFECTED`): YNNPACK
keeps the matrix products and XLA's own emitters take the rest (measured on one core: a training
step of ``train.model.Decoder`` 1.4x faster, not slower). Which releases those are is what the
reproducer showed on each, not a version range: on 2026-12-07 (AMD EPYC Zen 4, AVX-512), jaxlib 0.10.2
gave 24.6 without the flag and 1.7e-6 with it; 0.10.0, 0.10.1, 0.11.0, 0.11.2, 0.12.0 and 0.12.1 gave
1.7e-6 without it (the 2-core Ice Lake Xeon had found 0.10.2 wrong too). ``tests/test_xla_flags.py``
runs the reproducer on the installed jaxlib without the flag and fails where it disagrees with the
table (a release fixed, or a new one broken). XLA reads ``XLA_FLAGS`` once, when JAX starts its first
backend, so the flag takes only where jattn is imported before the first computation; otherwise jattn
warns. Nothing is changed where the user already set the flag or where ``JATTN_XLA_FLAGS=0``.
"""

from __future__ import annotations

import os
import warnings

import jaxlib

__all__ = ["FLAG", "apply"]

#: The flag and the value jattn sets: YNNPACK fusions of matrix products only.
FLAG = "--xla_cpu_experimental_ynn_fusion_type"
VALUE = "dot,individual_dot"
#: jaxlib releases whose XLA:CPU gave the reproducer wrong values without the flag (each knows the flag).
AFFECTED = frozenset({"0.10.2"})


def apply(environ=os.environ, version: str = jaxlib.__version__, started: bool | None = None) -> str:
    """Adds :data:`FLAG` to ``environ["XLA_FLAGS"]`` where it is needed and can take; returns what it did.

    ``'set'`` (added), ``'user'`` (the flag is there already), ``'off'`` (``JATTN_XLA_FLAGS=0``),
    ``'unaffected'`` (a jaxlib not in :data:`AFFECTED`) or ``'late'`` (JAX's backend already started: a
    warning says how to avoid the miscompile). ``started`` (tests) stands in for asking JAX.
    """
    flags = environ.get("XLA_FLAGS", "")
    if environ.get("JATTN_XLA_FLAGS") == "0":
        return "off"
    if any(f.split("=")[0] == FLAG for f in flags.split()):
        return "user"
    if version not in AFFECTED:
        return "unaffected"
    if _started() if started is None else started:
        warnings.warn(
            f"JAX's backend started before jattn was imported, so XLA:CPU's YNNPACK fusions could not be limited: "
            f"on jaxlib {version} some second-order derivatives under vmap compile to wrong values "
            f"(docs: transformations, 'XLA:CPU's YNNPACK fusions'). Import jattn before the first JAX "
            f"computation, or start Python with XLA_FLAGS='{FLAG}={VALUE}'.",
            RuntimeWarning,
            stacklevel=3,
        )
        return "late"
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={VALUE}".strip()
    return "set"


def _started() -> bool:
    """Whether JAX has started a backend (and so read ``XLA_FLAGS`` already)."""
    from jax._src import xla_bridge  # no public way to ask; the import is cheap (jax is loaded)

    return xla_bridge.backends_are_initialized()
