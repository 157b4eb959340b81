"""What the Mosaic GPU kernels (Hopper sm_90, Blackwell sm_100) share: targets, products, refusals, version shims.

Pallas' Mosaic GPU backend (``jax.experimental.pallas.mosaic_gpu``) replaces its Triton backend (deprecated from
jax 0.11). Its kernels (:mod:`jattn._gpu.mosaic_kernels`) run one warpgroup a query block: the scores and ``p v``
are tensor-core products of shared-memory tiles that TMA copies in (:func:`product`, :func:`accumulate`), by
the :class:`Target` of ``Spec.backend``: Hopper's ``wgmma`` into registers (blocks 64 by 64), Blackwell's
``tcgen05`` into tensor memory (blocks 128 by 128; Hopper's ``wgmma`` is not on sm_100). Head dims are padded to
multiples of 64 (:func:`depth`), the dtypes are the tensor cores' 16-bit ones. On CPU the kernels run in Mosaic
GPU's own interpreter (jax 0.12+; 0.10's has no register layouts, so there the kernel is refused by name when it
would be interpreted) inside a ``pure_callback`` (:func:`launch`); lowering for CUDA needs no device.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._checks import KernelRefusalError

__all__ = [
    "EDGE_ROOM",
    "SHARED_WIDTH",
    "TARGETS",
    "WINDOW_BYTES",
    "Target",
    "acc_add",
    "acc_chunks",
    "acc_scratch",
    "acc_zero",
    "accumulate",
    "backend_for",
    "depth",
    "launch",
    "load",
    "over_columns",
    "product",
    "refuse_mosaic",
    "refuse_windows",
    "scores",
    "spread",
    "swizzled",
    "taken",
    "target",
    "width",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """One tensor-core generation: its matrix product, its tile (query and key block) and its register layout."""

    name: str  # the product and the architecture, for messages
    block: int  # the query and key block: the product's rows (M), the key tile as wide
    layout: plgpu.Layout  # a (block, n) float32 tile's registers; its reductions hold a row's values
    tensor_memory: bool  # False: wgmma into registers (Hopper); True: tcgen05 into tensor memory (Blackwell)


#: ``Spec.backend`` -> its target: Hopper's ``wgmma`` (one warpgroup, 64 rows), Blackwell's ``tcgen05`` (128 rows).
TARGETS = {
    "mosaic_gpu": Target("wgmma (sm_90)", 64, plgpu.Layout.WGMMA, False),
    "mosaic_gpu_tcgen05": Target("tcgen05 (sm_100)", 128, plgpu.Layout.TCGEN05, True),
}


def backend_for(compute_capability: int) -> str:
    """The kernels for an NVIDIA compute capability (90 for sm_90): ``Spec.backend`` / ``gpu_attention``'s ``backend``.

    Hopper (sm_90) ``"mosaic_gpu"`` (wgmma), datacenter Blackwell (sm_100, sm_103) ``"mosaic_gpu_tcgen05"``;
    the rest ``"triton"``: Ampere and Ada (sm_80-89) have neither product, consumer Blackwell (sm_120) no tcgen05.
    """
    if compute_capability == 90:
        return "mosaic_gpu"
    return "mosaic_gpu_tcgen05" if 100 <= compute_capability < 110 else "triton"


def target(spec) -> Target:
    """The :class:`Target` of a kernel call's ``Spec``."""
    return TARGETS[spec.backend]


#: jax 0.12's interpreter runs Mosaic GPU kernels on CPU; 0.10's lacks register layouts and ``run_state``.
INTERPRETS = jax.__version_info__ >= (0, 12)

#: Whether the interpreter checks the kernels' shared memory for data races (slower; tests switch it on).
DETECT_RACES = False

_WHERE = "implementation='pallas' with the Mosaic GPU kernel (sm_90 / sm_100)"
_TAKE = "use implementation='blockwise' or 'dense', or the Triton kernel (sm_80-89)"
_NEW_LOAD = "idx" not in inspect.signature(plgpu.load).parameters


#: The largest ``2 Dw + Ew`` (``D`` and ``E`` padded as the kernels pad them: :func:`width`) at which every kernel
#: of a target (forward, dq, dk/dv, the one-pass jvp, the tangent) fits the 227 KiB of shared memory a block may
#: ask on sm_90 and sm_100 (Mosaic GPU's lowering checks it against that figure ahead of time, and raises). The
#: largest kernels are the jvp's and the tangent's: four tiles of depth D (q, k and their tangents), two of E
#: (v and its tangent); every kernel stages its outputs in the loop's tiles once the loop is done (a
#: ``RefUnion``). KiB per kernel (forward, dq, dk/dv, jvp, tangent), measured by lowering for CUDA
#: (``test_every_kernel_fits_shared_memory_within_the_table_and_not_beyond`` in tests/test_mosaic_gpu.py checks
#: the edges both ways, with the features that add shared memory):
#: wgmma, (Dw, Ew) = (256, 256): 162, 194, 194, 194, 194 (every pair fits);
#: tcgen05 (128, 128): 176, 146, 146, 208, 208; (64, 256): 192, 178, 178, 208, 208;
#: over at (128, 256): the forward (240 KiB: two buffers of k and v), the jvp and the tangent (272 KiB).
#: Wider calls are refused by name: the automatic choice takes the Triton kernel for them.
SHARED_WIDTH = {"mosaic_gpu": 768, "mosaic_gpu_tcgen05": 384}


#: Bytes left in the largest kernel at the edge of :data:`SHARED_WIDTH` with one ``segment_ids()`` (two id
#: windows), a floating row value (ALiBi's slope) and sinks: room for more windows there. Measured by lowering:
#: wgmma at (256, 256) dq 202,824 of 232,448 (its k and v in two buffers; the tangent 200,752); tcgen05 at
#: (128, 128) the tangent 215,100. Below the edge, 64 columns less leave 8 KiB (wgmma) or 16 KiB (tcgen05) more.
EDGE_ROOM = {"mosaic_gpu": 232_448 - 202_824, "mosaic_gpu_tcgen05": 232_448 - 215_100}

#: Bytes one segment-id window takes: Mosaic GPU starts every shared tile at a multiple of 1 KiB, so a window of
#: 64 or 128 int32 ids takes 1 KiB (measured: each ``segment_ids()`` adds 2,048 bytes on either target).
WINDOW_BYTES = 1024


def refuse_windows(backend: str, D: int, E: int, windows: int) -> None:
    """Raises :class:`KernelRefusalError` where the mask's segment-id windows overflow shared memory; else nothing.

    ``windows``: one ``(block,)`` int32 tile per side of each ``segment_ids()``, at head depths ``D``, ``E``.
    """
    block, room = TARGETS[backend].block, EDGE_ROOM[backend]
    if 2 * width(D) + width(E) < SHARED_WIDTH[backend]:
        room += 64 * block * 2
    if (windows - 2) * max(block * 4, WINDOW_BYTES) > room:
        raise KernelRefusalError(
            f"{_WHERE} at D={D}, E={E} takes fewer segment_ids() in the mask (got {windows // 2}): their id windows "
            f"would take its kernels past the 227 KiB of shared memory a block has; {_TAKE}"
        )


def width(n: int) -> int:
    """Head depth ``n`` as the kernels pad it: a power of two (16 at least), then :func:`depth`."""
    return depth(max(16, 1 << (n - 1).bit_length()))


def depth(n: int) -> int:
    """A head dim padded for ``wgmma``: a multiple of 64 (the 128-byte swizzle of 16-bit rows)."""
    return -(-n // 64) * 64


def refuse_mosaic(backend: str, dtype, D: int, E: int, *, interpret: bool, blocks) -> None:
    """Raises :class:`KernelRefusalError` naming what the Mosaic GPU kernels of ``backend`` cannot take, else nothing."""
    block = TARGETS[backend].block
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise KernelRefusalError(
            f"{_WHERE} takes bfloat16 and float16, got {jnp.dtype(dtype)}: wgmma multiplies float32 as tf32 (a 10-bit "
            f"mantissa), below the float32 precision jattn's kernels keep; {_TAKE}"
        )
    if max(D, E) > 256:
        raise KernelRefusalError(f"{_WHERE} takes head depths up to 256, got D={D}, E={E}; {_TAKE}")
    if 2 * width(D) + width(E) > SHARED_WIDTH[backend]:
        raise KernelRefusalError(
            f"{_WHERE} takes head depths with 2 D + E up to {SHARED_WIDTH[backend]} (padded) on "
            f"{TARGETS[backend].name}, got D={D}, E={E} (padded {width(D)}, {width(E)}): its kernels' tiles would "
            f"need more than the 227 KiB of shared memory a block has; {_TAKE}"
        )
    if blocks is not None and tuple(blocks) != (block, block):
        raise KernelRefusalError(
            f"{_WHERE} takes blocks ({block}, {block}) only ({TARGETS[backend].name}), got {blocks}; {_TAKE}"
        )
    if TARGETS[backend].tensor_memory and not INTERPRETS:
        raise KernelRefusalError(
            f"{_WHERE}: its tcgen05 kernel (sm_100) needs jax 0.12 (jax {jax.__version__}'s Mosaic GPU lowering "
            f"finds incompatible register layouts in it); {_TAKE}"
        )
    if interpret and not INTERPRETS:
        raise KernelRefusalError(
            f"{_WHERE} is interpreted on CPU from jax 0.12 (jax {jax.__version__}'s Mosaic GPU interpreter has no "
            f"register layouts); {_TAKE}"
        )


#: One Mosaic GPU interpreter at a time in this process. JAX keeps the interpreter's shared memory in one global,
#: set up by the kernel that starts first and cleared by the one that ends: two kernels interpreted at once
#: (independent kernels of one program, which XLA may run side by side, e.g. dq and dk/dv) would clear each
#: other's memory mid-run (seen under load: an AssertionError in the interpreter, or wrong values).
_INTERPRETING = threading.Lock()


def launch(body, *, name: str, interpret: bool, out_type, detect_races: bool | None = None, **kernel):
    """``plgpu.kernel(body, ...)``: compiled, or run by Mosaic GPU's interpreter inside a ``jax.pure_callback``.

    ``name``: the kernel's name in the lowered module, in profiles and in ``make compile-check``'s lines.

    The interpreter threads ordered IO effects through the program, which jattn's derivative primitives
    (:mod:`jattn._autodiff`, lowered from their implementations) do not declare; the callback hides them: a
    pure function of its operands, as the compiled kernel is. Interpreted kernels run one at a time
    (:data:`_INTERPRETING`); ``detect_races`` (default :data:`DETECT_RACES`) has the interpreter raise at a race.
    """
    body = _named(body, name)
    if not interpret:
        return plgpu.kernel(body, out_type=out_type, **kernel)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # no public name yet (jax 0.12)

    races = DETECT_RACES if detect_races is None else detect_races
    run = jax.jit(plgpu.kernel(body, out_type=out_type, interpret=InterpretGPUParams(detect_races=races), **kernel))

    def host(*xs):
        with _INTERPRETING:
            return jax.device_get(run(*xs))

    def call(*args):
        return jax.pure_callback(host, out_type, *args, vmap_method="sequential")

    return call


def _named(body, name: str):
    """``body`` under ``name``: Mosaic GPU names a kernel after its body's ``__name__`` (a ``partial`` has none)."""

    def kernel(*refs):
        return body(*refs)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def load(ref, layout):
    """``ref``'s whole value in registers in ``layout`` (jax 0.10's ``plgpu.load`` takes an index)."""
    return plgpu.load(ref, layout=layout) if _NEW_LOAD else plgpu.load(ref, (), layout=layout)


def swizzled(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """A shared-memory tile of 16-bit rows as ``wgmma`` reads them: (8, 64) tiles, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def product(spec, a, b, shape: tuple[int, int], plus: tuple | None = None) -> Array:
    """``a @ b`` ``(m, n)`` float32 in registers: ``a`` a shared tile, ``b`` a tile or ``.T`` (the target's product).

    ``plus``: a second pair ``(a2, b2)`` whose product the same accumulator adds (one tile in registers, not two).
    """
    pairs = ((a, b),) if plus is None else ((a, b), plus)
    if target(spec).tensor_memory:
        return _tcgen05(pairs, shape)

    def run(acc_ref):
        for x, y in pairs:
            plgpu.wgmma(acc_ref, x, y)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def over_columns(spec, n: int, body, carry):
    """``body(cols, carry) -> carry`` over a tile's ``n`` columns: all at once (Hopper), :data:`CHUNK` at a time.

    On Blackwell a 128-row tile gives each thread a whole row: 128 float32 scores, another 128 for a second
    score-sized tile (``dp``, a tangent), which with dropout's bits or a score modification pass the 255
    registers a thread has. A column chunk at a time (its products formed by :func:`scores`, accumulated by
    :func:`acc_add`: ``ds (m, cols) @ k[cols]`` is the product's share of those keys) halves that.
    """
    width = CHUNK if target(spec).tensor_memory else n
    for c in range(0, n, width):
        carry = body(pl.ds(c, width), carry)
    return carry


def scores(spec, a, b, cols, plus: tuple | None = None) -> Array:
    """``a @ b[cols].T`` ``(m, cols)`` float32: ``a`` and ``b`` shared tiles (``m`` and ``b``'s rows, a depth).

    ``plus``: a second pair ``(a2, b2)`` of the same form whose product the same accumulator adds.
    """
    second = None if plus is None else (plus[0], taken(plus[1], cols).T)
    return product(spec, a, taken(b, cols).T, (a.shape[0], cols.size), plus=second)


def taken(ref, cols):
    """``ref``'s rows ``cols`` (a ``pl.ds``): the ref itself where they are all of them, or ``cols`` is None."""
    return ref if cols is None or cols.size == ref.shape[0] else ref.at[cols]


def _tcgen05(pairs, shape: tuple[int, int]) -> Array:
    """The sum of the pairs' products ``a @ b`` by ``tcgen05`` into tensor memory, loaded into registers."""

    def run(acc_tmem, done):
        for n, (a, b) in enumerate(pairs):
            last = n == len(pairs) - 1
            plgpu.tcgen05_mma(acc_tmem, a, b, done if last else None, accumulate=n > 0)
        plgpu.barrier_wait(done)
        x = plgpu.async_load_tmem(acc_tmem)
        plgpu.wait_load_tmem()
        return x

    return pl.run_scoped(run, plgpu.TMEM(shape, jnp.float32), plgpu.Barrier(orders_tensor_core=True))


#: Columns of a tensor-memory accumulator moved through registers at once (a thread's 64 of them, at 128 rows).
CHUNK = 64


#: Columns of tensor memory (Blackwell: 512 of 32-bit values, at 128 lanes); a product's scores take a block's.
TMEM_COLUMNS = 512


def acc_scratch(spec, *shapes: tuple[int, int]) -> list:
    """The scratch of ``(rows, cols)`` float32 accumulators: tensor memory on Blackwell, else none.

    None on Hopper, nor where they would not fit beside a product's scores (:data:`TMEM_COLUMNS`): in registers.
    """
    tmem = target(spec).tensor_memory and sum(c for _, c in shapes) + target(spec).block <= TMEM_COLUMNS
    return [plgpu.TMEM(shape, jnp.float32) for shape in shapes] if tmem else []


def acc_zero(spec, tmem, shape: tuple[int, int]) -> Array | None:
    """A zero accumulator: float32 registers ``shape`` (Hopper), or ``tmem`` zeroed in place and None (Blackwell)."""
    if tmem is None:
        return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), target(spec).layout)
    for c in range(0, shape[1], CHUNK):
        zeros = plgpu.layout_cast(jnp.zeros((shape[0], CHUNK), jnp.float32), target(spec).layout)
        plgpu.async_store_tmem(tmem.at[:, pl.ds(c, CHUNK)], zeros)
    plgpu.commit_tmem()
    return None


def acc_add(spec, acc: Array | None, tmem, a: Array, b, alpha: Array | None = None) -> Array | None:
    """``acc alpha + a @ b`` (rows scaled by ``alpha (m,)`` if given): ``a (m, k)`` 16-bit registers, ``b`` a tile.

    In registers (``tmem`` None): the new accumulator. In tensor memory (Blackwell): updated in place, None;
    a thread holds :data:`CHUNK` of its columns at a time to scale them, and ``a`` goes through a shared tile.
    """
    if tmem is None:
        return accumulate(spec, acc if alpha is None else acc * spread(alpha, acc.shape), a, b)

    def run(a_smem, done):
        a_smem[...] = a
        for c in range(0, tmem.shape[1], CHUNK) if alpha is not None else ():
            chunk = tmem.at[:, pl.ds(c, CHUNK)]
            x = plgpu.async_load_tmem(chunk)
            plgpu.wait_load_tmem()
            plgpu.async_store_tmem(chunk, x * spread(alpha, x.shape))
        plgpu.commit_tmem()
        plgpu.commit_smem()
        plgpu.tcgen05_mma(tmem, a_smem, b, done, accumulate=True)
        plgpu.barrier_wait(done)

    pl.run_scoped(run, swizzled(a.shape, a.dtype), plgpu.Barrier(orders_tensor_core=True))
    return None


def acc_chunks(acc: Array | None, tmem):
    """``(columns, float32 registers)`` of an accumulator: all of it at once, or :data:`CHUNK` columns at a time."""
    if tmem is None:
        yield pl.ds(0, acc.shape[1]), acc
        return
    for c in range(0, tmem.shape[1], CHUNK):
        x = plgpu.async_load_tmem(tmem.at[:, pl.ds(c, CHUNK)])
        plgpu.wait_load_tmem()
        yield pl.ds(c, CHUNK), x


def spread(x: Array, shape, axis: int = 0) -> Array:
    """A row value ``(m,)`` spread over a tile's columns (``axis=1``: a column value over its rows)."""
    return jax.lax.broadcast_in_dim(x, shape, [axis])


def accumulate(spec, acc: Array, a: Array, b) -> Array:
    """``acc + a @ b`` into the float32 registers ``acc (m, n)``: ``a`` 16-bit registers (the weights), ``b`` a tile.

    Hopper's ``wgmma`` reads ``a`` from registers into its accumulator; Blackwell's ``tcgen05`` reads shared
    memory, so ``a`` goes through a shared tile first.
    """
    if target(spec).tensor_memory:

        def through(a_smem):
            a_smem[...] = a
            plgpu.commit_smem()
            return acc + _tcgen05(((a_smem, b),), acc.shape)

        return pl.run_scoped(through, swizzled(a.shape, a.dtype))

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(acc))
