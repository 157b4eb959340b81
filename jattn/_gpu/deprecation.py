"""JAX's deprecation of Pallas' Triton backend (jax 0.11+), answered where jattn lowers its Triton kernel.

JAX warns (a ``DeprecationWarning``) each time a Pallas Triton kernel is lowered: inside the user's
``jit``, in JAX's frames, after jattn's code has traced the call. jattn chooses that kernel knowingly
(the GPUs its Mosaic GPU kernel does not serve, :data:`jattn._gpu.attention.BACKENDS`), so while it traces
one for a GPU it puts a filter for exactly that message in front of the warnings filters (the lowering
that follows sees it; a filter a test or a user adds before the call is overridden only for this
message) and logs one notice of its own, once a process, on the ``jattn`` logger.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax

__all__ = ["MESSAGE", "TRITON_DEPRECATED", "answer_triton_deprecation"]

#: The start of JAX's warning (``jax._src.pallas.triton.pallas_call_registration``, jax 0.11.0 to 0.12.1 at least).
MESSAGE = "The Pallas Triton backend is deprecated"

#: Whether the installed JAX deprecates the Pallas Triton backend (0.11.0 on).
TRITON_DEPRECATED = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def answer_triton_deprecation(compute_capability: int) -> None:
    """Silences JAX's Triton deprecation for the lowering that follows, logging jattn's notice once a process."""
    if not TRITON_DEPRECATED:
        return
    warnings.filterwarnings("ignore", message=MESSAGE, category=DeprecationWarning)
    _notice(compute_capability)


@functools.cache
def _notice(compute_capability: int) -> None:
    """The one notice of jattn for ``compute_capability`` (e.g. 80 for sm_80)."""
    major, minor = divmod(compute_capability, 10)
    logging.getLogger("jattn").warning(
        "jattn lowers its Triton GPU kernel for compute capability %d.%d, on JAX's Pallas Triton backend, which "
        "JAX %s deprecates (its warning is silenced for jattn's kernel). On a JAX without it, implementation=None "
        "passes over the kernel on these GPUs (to 'cudnn', then the blockwise path); implementation= chooses now.",
        major, minor, jax.__version__,
    )  # fmt: skip
