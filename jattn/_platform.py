"""Facts about where a call runs, and the measured constants the tile choices rest on.

The platform (JAX's default backend at trace time), the CPU cores and threads one program's ops
are split over, and the tile costs and sizes measured on them. Everything here is read at trace
time through this module (``_platform.platform()``, ``_platform.TILE_BYTES``), so a test may
set these names to trace for another platform or thread count: this is the one internal module
the tests patch. None of it changes a result, only the tiles a result is computed on.
"""

from __future__ import annotations

import importlib.util
import math
import os

import jax

__all__ = [
    "BACKWARD_SIDE",
    "SPLIT_MIN",
    "STAIRS_MIN",
    "TILE_BYTES",
    "TILINGS",
    "compute_capability",
    "cores",
    "cpu_threads",
    "group_size",
    "has_pallas_triton",
    "platform",
    "tiling",
]


#: Bytes of one score tile on CPU: the leading axis B is cut into groups of rows whose tile
#: ``(group, bq, bk)`` stays about this size, and the groups run one after another. A tile over all
#: of B (32 MiB at B·N = 32 and 512 x 512 tiles) leaves the caches and halves the matmul rate. XLA
#: splits each op of a tile over its threads, so the best size grows with them: on 2 threads 4 MiB
#: (four heads of a float32 512 x 512 tile) measured 6-16% faster than 1 MiB; on 1 thread a group
#: is an eighth of this (512 KiB: one head of the 1024 x 128 tiles chosen there), whose tiles stay
#: in the core's L2 cache (docs: design notes). GPU and TPU keep one tile over all of B.
TILE_BYTES = 2**22


#: The smallest tile side (query rows and keys) whose LOWER tiles (:data:`jattn._masks.kinds.LOWER`:
#: partial, top-right quarter empty, as on the causal diagonal) are computed as their two non-empty
#: parts, 3/4 of the tile, and whose TOP_EMPTY tiles (:data:`jattn._masks.kinds.TOP_EMPTY`: the first
#: quarters of rows empty) as their other rows; smaller tiles are computed whole. Only without a
#: score modification, bias or dropout, whose tile-shaped arrays would have to be cut too.
SPLIT_MIN = 128

#: The smallest tile side whose STAIRS tiles (:data:`jattn._masks.kinds.STAIRS`) are computed as four
#: parts, below it as LOWER's two: causal forward on 2 threads, T=2048, 512² tiles 146 ms as LOWER
#: and 148 ms as STAIRS, 1024² ones 137-141 ms as STAIRS (docs: design notes, "Blockwise tiles").
STAIRS_MIN = 1024


def platform() -> str:
    """The platform the tiles are shaped for: JAX's default backend at trace time (``'cpu'``, ``'gpu'``, ``'tpu'``)."""
    return jax.default_backend()


def compute_capability() -> int:
    """The NVIDIA compute capability GPU kernels are lowered for at trace time, as an int (90 for sm_90).

    The abstract device of an enclosing abstract mesh where it names a GPU (ahead-of-time lowering for
    another chip: ``jax.sharding.AbstractDevice(device_kind="NVIDIA A100", ...)``, jax 0.11+), else the
    default device's; 90 where neither is a GPU (jax 0.10's Pallas lowers for sm_90 without one).
    """
    for where in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info"):  # jax 0.12+, jax 0.11
        try:  # JAX's own reading of the target, its table of device kinds
            return int(importlib.import_module(where).get_gpu_info().compute_capability) or 90
        except (ImportError, ValueError, RuntimeError, AttributeError):
            continue
    cc = getattr(jax.devices()[0], "compute_capability", None)  # a CUDA device: "9.0"
    return round(float(cc) * 10) if isinstance(cc, str) and cc[:1].isdigit() else 90


def has_pallas_triton() -> bool:
    """Whether the installed JAX has Pallas' Triton backend (deprecated in jax 0.11; a later release removes it)."""
    return importlib.util.find_spec("jax._src.pallas.triton") is not None


def cores() -> int:
    """The cores this process may run on (its CPU affinity): XLA:CPU's threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads() -> int:
    """The threads one program's ops are split over: :func:`cores` over an enclosing ``shard_map``'s shards.

    Per-device programs run at once on one thread pool. Affinity only: a cgroup CPU quota,
    ``--xla_cpu_multi_thread_eigen=false`` or a jit sharded over CPU devices without ``shard_map``
    are not seen (they change the speed of a tile, never its result).
    """
    mesh = jax.sharding.get_abstract_mesh()
    return max(1, cores() // math.prod(mesh.shape[a] for a in mesh.manual_axes))


def group_size(b: int, bq: int, bk: int, itemsize: int, platform: str, threads: int) -> int:
    """Rows of B per tile: all of them off CPU, else the largest divisor of B whose tile fits :data:`TILE_BYTES`.

    On one CPU thread the budget is an eighth of :data:`TILE_BYTES`; a tile bigger than the
    budget (2048 x 2048 float32 is 16 MiB) is one row of B.
    """
    if platform != "cpu":
        return b
    cap = max(1, (TILE_BYTES if threads > 1 else TILE_BYTES // 8) // (bq * bk * itemsize))
    return max(d for d in range(1, min(b, cap) + 1) if b % d == 0)


def _fixed_cost(tiles: tuple[tuple[int, int], ...], overhead: int) -> dict[tuple[int, int], float]:
    """Each tile's cost of one score entry when a tile costs ``overhead`` entries more than its area."""
    return {t: 1 + overhead / (t[0] * t[1]) for t in tiles}


#: The tiles ``(query rows, keys)`` the blockwise path chooses from, by where it runs, each with the
#: cost of one score entry in it, in order of preference (docs: design notes, "Blockwise tiles"). On one
#: CPU thread, tall narrow tiles of one head stay in the core's L2 cache (1024 x 128 float32: 512
#: KiB), and a tile costs 64² entries more than its area. On more threads XLA splits every op of a
#: tile over them and only big tiles pay for the split: measured on 2 threads (causal and full
#: forward, T = 2048 to 16384, alternated), an entry of a 2048² tile costs 0.86-0.94 of one in a
#: 512² tile, of a 1024² tile 0.96-0.98 and of a 256² tile 1.47-1.55 (128²: the 256² trend).
#: Elsewhere (GPU, TPU) the square tiles fitted before on CPU.
TILINGS = {
    "cpu, 1 thread": _fixed_cost(((1024, 128), (512, 256), (256, 128), (128, 128)), 64 * 64),
    "cpu": {(2048, 2048): 0.9, (1024, 1024): 0.97, (512, 512): 1.0, (256, 256): 1.5, (128, 128): 3.0},
    "other": _fixed_cost(((512, 512), (256, 256), (128, 128)), 112 * 112),
}
#: The largest tile side of the backward, by tiling, where a mask leaves tiles of several kinds
#: (causal, windows; else, and without an entry, the forward's tiles). On several CPU threads the
#: backward holds three score-sized tiles (p, dp, ds) where the forward holds one, and causal
#: fwd+bwd on 2 threads measured (backward on 2048², 1024², 512², forward on 2048²): T=8192 5.89,
#: 5.68, 5.54 s; T=16384 22.0, 20.7, 20.6 s. Full attention keeps one 2048² tile a head (T=2048:
#: 630 ms against 669 on 1024²; docs: design notes, "Blockwise tiles").
BACKWARD_SIDE = {"cpu": 512}


def tiling() -> str:
    """The key of :data:`TILINGS` for the default backend (and, on CPU, the threads) at trace time."""
    if platform() != "cpu":
        return "other"
    return "cpu, 1 thread" if cpu_threads() == 1 else "cpu"
