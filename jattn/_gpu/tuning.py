"""The GPU kernel's launch choices per chip, head depth and input dtype, from Triton's compile statistics.

:data:`TABLE` maps ``(arch, dtype class, padded head depth)`` to a :class:`Choice`: the tiles ``(bq, bk)``
every kernel of a call shares, each kernel's Triton launch (warps, software-pipeline stages) and the
float32 dots' algorithm. :func:`choose` reads it at trace time for the compute capability the call is
lowered for (:func:`jattn._platform.compute_capability`). Interpret mode (CPU) keeps its own tiles and
exact float32 dots: a choice here changes how a GPU computes, never what the tests compare.

Figures above each entry: shared memory (KiB), registers per thread, spill stores (B) per kernel, from
``make compile-check`` (bench/triton_compile.py: Triton 3.8.0's compiler and its ptxas on jax 0.10.2's
Triton IR of a causal call at T=256, plain and with dropout, ALiBi and a soft cap, and sinks: the
largest). Compile statistics only: no run time was measured (no GPU at hand).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

__all__ = ["ARCHS", "KERNELS", "TABLE", "Choice", "Launch", "choose", "dtype_class"]

#: The kernels one call may launch (the names :mod:`jattn._gpu.kernels` gives its ``pallas_call``s).
KERNELS = ("forward", "forward_tangent", "tangent", "dq", "dkdv")

#: The compute capabilities the table has rows for; a chip takes the row of the largest one it reaches.
ARCHS = (80, 90)


class Launch(NamedTuple):
    """One kernel's Triton launch: warps per program and software-pipeline stages of its loads."""

    warps: int
    stages: int


@dataclasses.dataclass(frozen=True)
class Choice:
    """The tiles, each kernel's :class:`Launch` and the float32 dots' algorithm of one table cell.

    ``precision`` (float32 inputs only): ``"ieee"`` (exact float32 products, no tensor cores: every entry
    of :data:`TABLE`), or, to measure them (``python -m bench.triton_compile --precision``), ``"tf32"``
    (inputs rounded to 10 bits), ``"tf32x3"`` and ``"bf16x3"`` (three TF32 or bfloat16 products).
    """

    blocks: tuple[int, int]
    forward: Launch
    forward_tangent: Launch
    tangent: Launch
    dq: Launch
    dkdv: Launch
    precision: str = "ieee"

    def launch(self, kernel: str) -> Launch:
        """The :class:`Launch` of ``kernel`` (one of :data:`KERNELS`)."""
        return getattr(self, kernel)


def _launches(blocks: tuple[int, int], warps: int, precision: str = "ieee", **by_kernel: int) -> Choice:
    """A :class:`Choice` whose kernels launch ``warps`` warps (``by_kernel``: a kernel's own), 2 stages each.

    Stages: the kernels' key loop branches on each tile's kind, so Triton pipelines no load across it;
    1 and 2 stages compiled to the same registers and spills (bfloat16 D=128, 4 and 8 warps, both archs).
    """
    launch = {k: Launch(by_kernel.get(k, warps), 2) for k in KERNELS}
    return Choice(blocks, **launch, precision=precision)


#: ``(arch, dtype class, Dp) -> Choice``; dtype class ``"16"`` (bfloat16, float16) or ``"32"`` (float32),
#: Dp the head depth padded to a power of two (64 stands for 16-64). Above each entry, per kernel (fwd,
#: jvp = the one-pass forward+tangent, tan, dq, dkdv): shared memory KiB / registers / spill-store bytes,
#: the largest over the plain and the featured kernels (and bfloat16 and float16). 64 x 64 tiles at 4
#: warps, the former fixed launch, spilled on both archs at every D (bfloat16 D=128 sm_80: jvp 1600 B,
#: dk/dv 1520 B; float32: tens of KB to 166 KB, or shared memory over an A100's). Targets (``make compile-check`` fails beyond them): no spill for
#: 16-bit inputs at D <= 128, at most 1 KiB at D = 256 and for float32; float32 dots exact (``"ieee"``).
TABLE: dict[tuple[int, str, int], Choice] = {
    # sm_80 (A100; sm_86 and sm_89 take this row: every entry fits their 99 KiB of shared memory)
    # fwd 12/161/0, jvp 28/252/0, tan 28/248/0, dq 22/168/0, dkdv 20/168/0
    (80, "16", 64): _launches((64, 32), 4),
    # fwd 28/199/0, jvp 56/255/0, tan 56/255/0, dq 48/243/0, dkdv 36/254/0
    (80, "16", 128): _launches((64, 32), 4, forward_tangent=8),
    # fwd 34/154/0, jvp 80/255/0, tan 80/213/0, dq 64/164/8, dkdv 34/232/0
    (80, "16", 256): _launches((32, 32), 8),
    # fwd 24/100/0, jvp 48/255/0, tan 48/222/0, dq 32/112/0, dkdv 36/116/0
    (80, "32", 64): _launches((32, 32), 8),
    # fwd 40/170/0, jvp 80/255/596, tan 80/255/476, dq 48/138/16, dkdv 50/121/0
    (80, "32", 128): _launches((16, 32), 8),
    # fwd 48/80/0, jvp 96/255/848, tan 96/255/608, dq 64/77/0, dkdv 65/108/0
    (80, "32", 256): _launches((16, 16), 8),
    # sm_90 (H100)
    # fwd 16/122/0, jvp 32/216/0, tan 32/166/0, dq 24/141/0, dkdv 40/164/0
    (90, "16", 64): _launches((64, 32), 4),
    # fwd 29/128/0, jvp 64/176/0, tan 64/142/0, dq 48/128/0, dkdv 32/183/0
    (90, "16", 128): _launches((32, 64), 8),
    # fwd 34/154/0, jvp 80/255/0, tan 80/177/0, dq 64/150/0, dkdv 34/216/0
    (90, "16", 256): _launches((32, 32), 8),
    # fwd 24/108/0, jvp 48/255/0, tan 48/202/0, dq 32/123/0, dkdv 36/110/0
    (90, "32", 64): _launches((32, 32), 8),
    # fwd 32/92/0, jvp 64/255/780, tan 64/255/492, dq 48/150/0, dkdv 50/100/0
    (90, "32", 128): _launches((32, 16), 8),
    # fwd 48/78/0, jvp 96/255/828, tan 96/255/568, dq 64/77/0, dkdv 65/100/0
    (90, "32", 256): _launches((16, 16), 8),
}


def dtype_class(dtype) -> str:
    """``"32"`` for float32 inputs, ``"16"`` for the 16-bit ones (the table's column)."""
    return "32" if jnp.dtype(dtype).itemsize >= 4 else "16"


def choose(arch: int, dtype, Dp: int) -> Choice:
    """The :data:`TABLE` cell of compute capability ``arch`` (e.g. 90), input ``dtype`` and padded head depth ``Dp``.

    A chip takes the row of the largest table arch it reaches (sm_86/sm_89: sm_80's; below sm_80: sm_80's).
    """
    row = max((a for a in ARCHS if a <= arch), default=ARCHS[0])
    return TABLE[(row, dtype_class(dtype), max(64, Dp))]
