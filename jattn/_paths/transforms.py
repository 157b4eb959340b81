"""What each path does under each JAX transformation: :data:`TRANSFORMS`, the docs' table, tested cell by cell.

A cell is "yes" (the transformation works on that path and equals the float64 reference's), "partly:
..." (where it works), or "no: ..." (a ``ValueError`` that names the transformation, the path and a
path that takes it, where jattn sees the call; see :func:`refusals`). The columns are the paths of
:data:`jattn.IMPLEMENTATIONS`, with blockwise twice (on XLA's tiles, and with the fused CPU forward that
the automatic choice takes on CPUs with AVX-512, AVX2 + FMA or NEON), ring attention and the Flax modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jattn._checks import KernelRefusalError

__all__ = ["PATHS", "TRANSFORMS", "refusals"]

#: The columns of :data:`TRANSFORMS`.
PATHS = ("dense", "blockwise", "fused", "ring", "modules", "xla", "cudnn", "pallas")

_YES = "yes"
_FORWARD = "no: the kernel has a reverse-mode rule only (a jax.custom_vjp); use 'blockwise' or 'dense'"
_SECOND = "no: the kernel's backward has no derivative; use 'blockwise' or 'dense'"
_LATE = " (JAX's own error: JAX meets the kernel after jattn's call has returned)"
_TPU_FORWARD = "; TPU " + _FORWARD[4:].replace("the kernel", "splash")
_GPU_SECOND = "the kernel's derivatives differentiated through the blockwise path (XLA tiles, O(T) memory)"
_GPU_TANGENT = "partly: GPU forward mode in the kernels (O(T) memory)"


def _row(**cells: str) -> dict[str, str]:
    """A row of :data:`TRANSFORMS`: "yes" in every column not named."""
    return {p: cells.get(p, _YES) for p in PATHS}


#: Transformation -> path -> "yes" / "partly: ..." / "no: ...". "fused": blockwise with the fused CPU
#: forward; "modules": ``jattn.nnx`` / ``jattn.linen`` attention (on the path they choose or are given).
TRANSFORMS: dict[str, dict[str, str]] = {
    "jit": _row(),
    "vmap": _row(),
    "grad": _row(),
    "grad of grad, reverse-over-reverse HVP": _row(
        cudnn=_SECOND + _LATE,
        pallas=f"partly: GPU {_GPU_SECOND}; TPU " + _SECOND[4:] + _LATE,
    ),
    "jvp, forward-over-reverse HVP": _row(
        cudnn=_FORWARD, pallas=f"{_GPU_TANGENT}, the HVP {_GPU_SECOND}{_TPU_FORWARD}"
    ),
    "grad of jvp (a loss through jvp), with and without jax.checkpoint": _row(
        cudnn=_FORWARD, pallas=f"partly: GPU {_GPU_SECOND}{_TPU_FORWARD}"
    ),
    "jacfwd": _row(cudnn=_FORWARD, pallas=_GPU_TANGENT + _TPU_FORWARD),
    "hessian": _row(cudnn=_FORWARD, pallas=f"partly: GPU {_GPU_SECOND}{_TPU_FORWARD}"),
    "linearize": _row(cudnn=_FORWARD + _LATE, pallas=_GPU_TANGENT + _TPU_FORWARD + _LATE),
    "jax.checkpoint, save_only_these_names(*jattn.CHECKPOINT_NAMES)": _row(
        xla="partly: the names are on the results; jax.nn's own residuals are unnamed",
        cudnn="partly: the names are on the results; the kernel's own residuals are unnamed",
        pallas="partly: the names are on the results; the kernel's own residuals are unnamed",
    ),
    "lax.scan over layers": _row(),
    "nnx.scan / nnx.vmap / nnx.remat of a module": _row(),
    "shard_map": _row(),
    "eval_shape": _row(),
    "jax.export (serialize, deserialize, call)": _row(
        fused="yes: exported on XLA's tiles, a portable artifact (jit keeps the kernel)",
        cudnn="no: jax.export refuses cuDNN's custom call; use 'xla' or 'blockwise'",
        pallas="partly: interpreted on CPU, Mosaic on TPU; JAX's export refuses the GPU kernel's Triton call",
    ),
}

_JAX_SAYS = {
    "can't apply forward-mode autodiff": ("forward mode (jax.jvp, jacfwd, hessian, linearize)", _FORWARD),
    "Linearization failed to produce known values": ("second-order reverse mode (grad of grad)", _SECOND),
    "Differentiation rule for 'custom_lin'": ("forward mode under reverse mode (grad of jvp)", _FORWARD),
}


@contextlib.contextmanager
def refusals(path: str) -> Iterator[None]:
    """Turns JAX's refusal to differentiate a custom-VJP kernel of ``path`` into the table's ``ValueError``.

    Where the transformation reaches jattn's call: not where JAX meets the kernel after the call has
    returned (grad of grad, ``linearize``, or a function traced under ``jit`` before it is transformed);
    the table's cells say which. The error is a :class:`jattn._checks.KernelRefusalError`, so with
    ``implementation=None`` the automatic choice tries its next path (under ``jvp`` the kernel's
    translation has been traced by then: dead code under ``jit``).
    """
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as e:
        for says, (what, cell) in _JAX_SAYS.items():
            if says in str(e):
                raise KernelRefusalError(f"{what} of implementation={path!r}: {cell.removeprefix('no: ')}") from e
        raise
