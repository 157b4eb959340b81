"""The paths of :func:`jattn.attention`, each one function of one signature: ``(Operands, Options) -> Result``.

:data:`PATHS` maps each name of :data:`jattn.IMPLEMENTATIONS` to its function; :data:`jattn.SUPPORT` has its
column (what it does with each argument). A path takes the call's checked operands and options
(:class:`jattn._checks.Operands`, :class:`jattn._checks.Options`) and returns ``out (..., T, E)`` with its
``lse (..., T)`` and ``max_logit (..., T)`` where it gives them (:class:`jattn._checks.Result`), or refuses a
"partly" cell by raising :class:`jattn._checks.KernelRefusalError`. The core names the results for
``jax.checkpoint`` and picks what the caller asked for; adding a path is a function here and a column there.
"""

from __future__ import annotations

from collections.abc import Callable

from jattn._blockwise import blockwise_path
from jattn._checks import Operands, Options, Result
from jattn._paths.choice import IMPLEMENTATIONS, SUPPORT
from jattn._paths.dense import dense_path
from jattn._paths.pallas import pallas_path
from jattn._paths.xla import cudnn_path, xla_path

__all__ = ["PATHS"]

PATHS: dict[str, Callable[[Operands, Options], Result]] = {
    "dense": dense_path,
    "blockwise": blockwise_path,
    "xla": xla_path,
    "cudnn": cudnn_path,
    "pallas": pallas_path,
}

if tuple(PATHS) != IMPLEMENTATIONS or any(set(cells) != set(PATHS) for cells in SUPPORT.values()):
    raise ImportError(f"jattn's paths {tuple(PATHS)} and SUPPORT's columns {IMPLEMENTATIONS} must be the same")
