"""What the Mosaic GPU kernels (Hopper sm_90, Blackwell sm_100) share: their blocks, refusals and jax-version shims.

Pallas' Mosaic GPU backend (``jax.experimental.pallas.mosaic_gpu``) replaces its Triton backend (deprecated from
jax 0.11). Its kernels (:mod:`jattn._gpu.mosaic_kernels`) run one warpgroup a query block of :data:`BLOCK`
rows: the scores and ``p v`` are warpgroup matrix products (``wgmma``) of shared-memory tiles that TMA copies
in, so the blocks are 64 by 64, the head dims multiples of 64 (:func:`depth`) and the dtypes the tensor cores'
16-bit ones. On CPU they run in Mosaic GPU's own interpret mode (jax 0.12+; 0.10's interpreter has no register
layouts, so there the kernel is refused by name when it would be interpreted); lowering for CUDA needs no device.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._checks import KernelRefusalError

__all__ = ["BLOCK", "accumulate", "depth", "launch", "load", "product", "refuse_mosaic", "swizzled"]

#: The query and key block: one warpgroup's ``wgmma`` rows (64), and the key tile as wide.
BLOCK = 64

#: jax 0.12's interpreter runs Mosaic GPU kernels on CPU; 0.10's lacks register layouts and ``run_state``.
INTERPRETS = jax.__version_info__ >= (0, 12)

_WHERE = "implementation='pallas' with the Mosaic GPU kernel (sm_90 / sm_100)"
_TAKE = "use implementation='blockwise' or 'dense', or the Triton kernel (sm_80-89)"
_NEW_LOAD = "idx" not in inspect.signature(plgpu.load).parameters


def depth(n: int) -> int:
    """A head dim padded for ``wgmma``: a multiple of 64 (the 128-byte swizzle of 16-bit rows)."""
    return -(-n // 64) * 64


def refuse_mosaic(dtype, D: int, E: int, *, interpret: bool, dropout: float, score_mod, blocks) -> None:
    """Raises :class:`KernelRefusalError` naming what the Mosaic GPU kernels cannot take, else nothing."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise KernelRefusalError(
            f"{_WHERE} takes bfloat16 and float16, got {jnp.dtype(dtype)}: wgmma multiplies float32 as tf32 (a 10-bit "
            f"mantissa), below the float32 precision jattn's kernels keep; {_TAKE}"
        )
    if max(D, E) > 256:
        raise KernelRefusalError(f"{_WHERE} takes head depths up to 256, got D={D}, E={E}; {_TAKE}")
    if blocks is not None and tuple(blocks) != (BLOCK, BLOCK):
        raise KernelRefusalError(
            f"{_WHERE} takes blocks ({BLOCK}, {BLOCK}) only (one warpgroup), got {blocks}; {_TAKE}"
        )
    if interpret and not INTERPRETS:
        raise KernelRefusalError(
            f"{_WHERE} is interpreted on CPU from jax 0.12 (jax {jax.__version__}'s Mosaic GPU interpreter has no "
            f"register layouts); {_TAKE}"
        )


def launch(body, *, interpret: bool, out_type, **kernel):
    """``plgpu.kernel(body, ...)``: compiled, or run by Mosaic GPU's interpreter inside a ``jax.pure_callback``.

    The interpreter threads ordered IO effects through the program, which jattn's derivative primitives
    (:mod:`jattn._autodiff`, lowered from their implementations) do not declare; the callback hides them: a
    pure function of its operands, as the compiled kernel is.
    """
    if not interpret:
        return plgpu.kernel(body, out_type=out_type, **kernel)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # no public name yet (jax 0.12)

    run = jax.jit(plgpu.kernel(body, out_type=out_type, interpret=InterpretGPUParams(), **kernel))

    def call(*args):
        return jax.pure_callback(lambda *xs: jax.device_get(run(*xs)), out_type, *args, vmap_method="sequential")

    return call


def load(ref, layout):
    """``ref``'s whole value in registers in ``layout`` (jax 0.10's ``plgpu.load`` takes an index)."""
    return plgpu.load(ref, layout=layout) if _NEW_LOAD else plgpu.load(ref, (), layout=layout)


def swizzled(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """A shared-memory tile of 16-bit rows as ``wgmma`` reads them: (8, 64) tiles, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def product(a, b, shape: tuple[int, int]) -> Array:
    """``a @ b`` ``(m, n)`` float32 by ``wgmma``: ``a`` a shared tile or 16-bit registers, ``b`` a tile (or ``.T``)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate(acc: Array, a, b) -> Array:
    """``acc + a @ b`` by ``wgmma`` into the float32 accumulator ``acc (m, n)`` (``a``, ``b`` as :func:`product`'s)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(acc))
