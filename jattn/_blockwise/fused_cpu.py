"""The fused CPU kernels of blockwise attention: ``fused_cpu.cc`` as XLA FFI custom calls.

Shapes follow :mod:`jattn._core` with leading dimensions flattened to ``B``: q ``(B, T, D)``,
k ``(B, S, D)``, v ``(B, S, E)``. XLA runs a tile's ops one after another, each split over the
threads; the kernels give each thread whole (row of B, query block) tasks and keep the score
tile in its core's cache between the two products, with the online softmax in between (docs:
design notes). They serve the masks that give each query row one interval of keys
(:func:`jattn._masks.positions.key_interval`: none, causal, sliding windows and their ``&``), cut per
row by padding lengths and segment ids (``rows``, :mod:`jattn._blockwise.fused_rows`), with grouped query heads
(``group``: k and v a row per ``group`` rows of q), in float32 (16-bit inputs are upcast): the forward (:func:`forward`, with the lse), its backward
(:func:`backward`: dq, dk, dv from the lse and ``delta``, one task per row of B), its tangent
with the lse known (:func:`tangent`) and the forward and tangent in one pass (:func:`forward_tangent`).

The C++ source is written once over a small vector layer and compiled on first use with the
system's ``g++`` (``$CXX``) for this machine's CPU (``-march=native``): AVX-512, AVX2 + FMA, ARM NEON,
or scalar where asked (:func:`layer` names the one built). ``JATTN_FUSED_ISA`` picks another than
the CPU's default (``avx2`` on an AVX-512 CPU: what an AVX2-only CPU runs; ``scalar``: plain C++, the
reference build). The library is cached under ``$JATTN_CACHE_DIR`` (default ``~/.cache/jattn``), keyed by the
source, jax's version, the compiler, its flags and the CPU's flags. Without a compiler, on a CPU
with none of these vector units, or with ``JATTN_FUSED_CPU=0``, :func:`available` is False and
blockwise attention keeps XLA's tiles.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = [
    "BLOCK_KV", "BLOCK_Q", "SPLIT_KV", "available", "backward", "forward", "forward_tangent", "layer", "paged_forward",
    "tangent",
]  # fmt: skip

_log = logging.getLogger(__name__)
TARGET = "jattn_fused_forward"
TANGENT = "jattn_fused_tangent"
FORWARD_TANGENT = "jattn_fused_forward_tangent"
BACKWARD = "jattn_fused_backward"
PAGED = "jattn_fused_paged"
SOURCE = pathlib.Path(__file__).with_suffix(".cc")
#: Query rows of one task and keys of one tile (a multiple of 64): full forward, B=4 N=8 D=64, 2 threads (docs: design notes).
BLOCK_Q, BLOCK_KV = 256, 512
#: Keys of one split: a row's keys are cut at its multiples, each part's online softmax merged into the total by
#: log-sum-exp in key order (the paged kernel runs a long request's splits on several threads: split-KV).
SPLIT_KV = 4096


def _cpu_flags() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.lower().startswith(("flags", "features"))), "")


#: The vector layers the source has, each with the CPU flags it needs (x86: /proc/cpuinfo's "flags";
#: aarch64: NEON is part of the architecture) and its compile definitions.
_LAYERS = {
    "avx512": ({"avx512f"}, []),
    "avx2": ({"avx2", "fma"}, ["-mno-avx512f"]),  # on an AVX-512 CPU too: what an AVX2-only CPU runs
    "neon": (set(), []),
    # plain C++ as written (GCC 12's vectorizer reads past a strided operand's last row in the micro-kernel)
    "scalar": (set(), ["-DJATTN_SCALAR", "-fno-tree-vectorize"]),
}


def _wanted_layer() -> str | None:
    """The vector layer to build: ``$JATTN_FUSED_ISA`` where set (``auto``: the CPU's best), None where the CPU has none."""
    wanted = os.environ.get("JATTN_FUSED_ISA", "auto")
    if wanted not in (*_LAYERS, "auto"):
        raise ValueError(f"JATTN_FUSED_ISA must be one of auto, {', '.join(_LAYERS)}; got {wanted!r}")
    flags = set(_cpu_flags().split())
    arm = platform.machine().lower() in ("aarch64", "arm64")
    x86 = [name for name, (needs, _) in _LAYERS.items() if name != "neon" and needs <= flags]
    usable = ["neon", "scalar"] if arm else x86
    if wanted == "auto":
        return next((name for name in usable if name != "scalar"), None)
    return wanted if wanted in usable else None


def _build() -> pathlib.Path | None:
    """The compiled library, built here if the cache lacks it; None (logged) without a layer, ``g++``, or when it fails."""
    layer = _wanted_layer()
    if layer is None:
        _log.info("jattn: no vector layer for this CPU (or JATTN_FUSED_ISA); blockwise attention keeps XLA's tiles")
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        _log.info("jattn: no C++ compiler found; blockwise attention keeps XLA's tiles on CPU")
        return None
    include = jax.ffi.include_dir()
    flags = [
        "-O3",
        "-march=native",
        "-ffp-contract=off",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-pthread",
        f"-I{include}",
        *_LAYERS[layer][1],
    ]
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jax.__version__, compiler, " ".join(flags), _cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    cache = pathlib.Path(os.environ.get("JATTN_CACHE_DIR", pathlib.Path.home() / ".cache" / "jattn"))
    target = cache / f"fused_cpu-{layer}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            partial = pathlib.Path(tmp.name)
        try:
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial)], capture_output=True, text=True)
            if done.returncode != 0:
                _log.warning("jattn: building %s failed; XLA's tiles stay:\n%s", SOURCE.name, done.stderr[-2000:])
                return None
            os.replace(partial, target)  # atomic: another process sees no library or the whole one
        finally:
            partial.unlink(missing_ok=True)
    except OSError as e:
        _log.warning("jattn: cannot build the fused CPU kernels in %s (%s); XLA's tiles stay", cache, e)
        return None
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = _build()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JattnFusedForward), platform="cpu")
    jax.ffi.register_ffi_target(TANGENT, jax.ffi.pycapsule(library.JattnFusedTangent), platform="cpu")
    jax.ffi.register_ffi_target(FORWARD_TANGENT, jax.ffi.pycapsule(library.JattnFusedForwardTangent), platform="cpu")
    jax.ffi.register_ffi_target(BACKWARD, jax.ffi.pycapsule(library.JattnFusedBackward), platform="cpu")
    jax.ffi.register_ffi_target(PAGED, jax.ffi.pycapsule(library.JattnFusedPaged), platform="cpu")
    library.JattnFusedLayer.restype = ctypes.c_char_p
    _log.info("jattn: fused CPU kernels, %s layer (%s)", library.JattnFusedLayer().decode(), path)
    return library


def available() -> bool:
    """Whether the fused kernels run here: built (or cached) for this CPU's vector layer and not switched off.

    ``JATTN_FUSED_CPU=0`` switches them off (read at trace time).
    """
    return os.environ.get("JATTN_FUSED_CPU", "1") != "0" and _library() is not None


def layer() -> str | None:
    """The vector layer the kernels were built with (``"avx512"``, ``"avx2"``, ``"neon"``, ``"scalar"``), or None."""
    library = _library()
    return None if library is None else library.JattnFusedLayer().decode()


def forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    length: int,
    q_offset: int,
    kv_offset: int,
    window: tuple[int, int],
    scale: float,
    threads: int,
    rows: tuple[Array, Array, Array | None, Array | None] | None = None,
    group: int = 1,
    block_q: int = BLOCK_Q,
    block_kv: int = BLOCK_KV,
    split: int = SPLIT_KV,
) -> tuple[Array, Array, Array]:
    """``out (B, T, E)``, ``lse (B, T)`` and the row max logit ``(B, T)``, float32.

    ``q (B, T, D)``, ``k (B, S, D)``, ``v (B, S, E)`` (any float dtype but float64: upcast to
    float32); keys at ``length`` and after are masked (block padding), and query row t sees key
    s where ``q_offset + t - left <= kv_offset + s <= q_offset + t + right``
    (``window = (left, right)``, :func:`jattn._masks.positions.key_interval`). ``rows``: a per-example
    mask's ``(lo, hi, q_ids, kv_ids)`` (:func:`jattn._blockwise.fused_rows.row_bounds`; the ids None without
    segment ids), or None. ``group``: grouped heads, k and v ``(B / group, ...)``, a row per
    ``group`` rows of q. ``split``: the keys of a split (a multiple of ``block_kv``; :data:`SPLIT_KV` gives
    :func:`paged_forward`'s bits). Requires :func:`available`.
    """
    call = dict(length=length, q_offset=q_offset, kv_offset=kv_offset, window=window, scale=scale, threads=threads,
                rows=rows, group=group, block_q=block_q, block_kv=block_kv, split=split)  # fmt: skip
    return _call(TARGET, ("tile", "row", "row"), (q, k, v), call)


def tangent(
    q: Array, k: Array, v: Array, dq: Array, dk: Array, dv: Array, out: Array, lse: Array, **call
) -> tuple[Array, Array]:
    """The tangent of :func:`forward` with its lse known: ``d out (B, T, E)`` and ``d lse (B, T)``, float32.

    ``dq``, ``dk``, ``dv`` are the tangents of q, k, v (shaped like them), ``out`` and ``lse`` the
    forward's; ``call`` the keyword arguments of :func:`forward` (``length``, offsets, ``window``,
    ``scale``, ``threads``, ``rows``, ``group``). Rows with lse ``-inf`` (no key) get 0. Requires :func:`available`.
    """
    return _call(TANGENT, ("tile", "row"), (q, k, v, dq, dk, dv, out, lse), call)


def forward_tangent(q: Array, k: Array, v: Array, dq: Array, dk: Array, dv: Array, **call) -> tuple[Array, ...]:
    """:func:`forward` and its tangent in one pass: ``out``, ``lse``, max logit, ``d out (B, T, E)``, ``d lse (B, T)``.

    The forward's online softmax carries the tangent's sums beside its own (forward mode without a
    second sweep); ``dq``, ``dk``, ``dv`` the tangents of q, k, v, ``call`` the keyword arguments of
    :func:`forward`. Rows with no key get 0 tangents. Requires :func:`available`.
    """
    return _call(
        FORWARD_TANGENT, ("tile", "row", "row", "tile", "row"), (q, k, v, dq, dk, dv), call | dict(split=SPLIT_KV)
    )


def backward(
    q: Array, k: Array, v: Array, d_out: Array, lse: Array, delta: Array, **call
) -> tuple[Array, Array, Array]:
    """The gradients ``dq (B, T, D)``, ``dk (B, S, D)``, ``dv (B, S, E)`` of :func:`forward`, float32.

    ``d_out (B, T, E)`` is the cotangent of ``out``, ``lse (B, T)`` the forward's and ``delta (B, T)``
    ``rowsum(d_out ∘ out) - d_lse`` (:func:`jattn._online.backward_rows`); ``call`` the keyword
    arguments of :func:`forward`. One task per row of B. Requires :func:`available`.
    """
    return _call(BACKWARD, ("q", "k", "v"), (q, k, v, d_out, lse, delta), call)


def _call(target: str, results: tuple[str, ...], operands: tuple[Array, ...], call: dict) -> tuple[Array, ...]:
    """Custom call ``target`` on float32 ``operands`` (q, k, v first), the row mask's and ``call``'s attributes.

    ``results`` are ``"tile"`` (B, T, E), ``"row"`` (B, T), or ``"q"``, ``"k"``, ``"v"`` (shaped as those), float32.
    Requires :func:`available`.
    """
    if _library() is None:
        raise RuntimeError("jattn's fused CPU kernels are not available here (jattn._blockwise.fused_cpu.available())")
    q, k, v = operands[:3]
    B, T, E = q.shape[0], q.shape[1], v.shape[2]
    shape = {"tile": (B, T, E), "row": (B, T), "q": q.shape, "k": k.shape, "v": v.shape}
    shapes = tuple(jax.ShapeDtypeStruct(shape[r], jnp.float32) for r in results)
    fn = jax.ffi.ffi_call(target, shapes, vmap_method="broadcast_all")
    rows = call.pop("rows", None) or (None,) * 4
    mode = 0 if rows[0] is None else 1 if rows[2] is None else 2  # none, bounds, bounds and document ids
    rows = tuple(jnp.zeros((1, 1), jnp.int32) if x is None else x.astype(jnp.int32) for x in rows)
    return fn(*(x.astype(jnp.float32) for x in operands), *rows, **_attributes(**call), row_mask=np.int64(mode))


def _attributes(
    *, length: int, q_offset: int, kv_offset: int, window: tuple[int, int], scale: float, threads: int,
    group: int = 1, block_q: int = BLOCK_Q, block_kv: int = BLOCK_KV, split: int | None = None,
) -> dict:  # fmt: skip
    """The custom calls' attributes, typed as the C++ handlers bind them (``split``: the forward's alone)."""
    return ({} if split is None else dict(split=np.int64(split))) | dict(
        length=np.int64(length),
        q_offset=np.int64(q_offset),
        kv_offset=np.int64(kv_offset),
        left=np.int64(window[0]),
        right=np.int64(window[1]),
        scale=np.float32(scale),
        block_q=np.int64(block_q),
        block_kv=np.int64(-(-block_kv // 64) * 64),
        threads=np.int64(threads),
        group=np.int64(group),
    )


_PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def paged_forward(
    q: Array,
    k_pages: Array,
    v_pages: Array,
    page_table: Array,
    kv_lens: Array,
    cu_q_lens: Array,
    *,
    window: tuple[int, int],
    scale: float,
    threads: int,
    block_q: int = BLOCK_Q,
    split: int = SPLIT_KV,
) -> tuple[Array, Array]:
    """Paged attention's ``out (Q, N, E)`` and ``lse (Q, N)``, float32 (:func:`jattn.paged_attention`'s operands).

    ``q (Q, N, D)`` (upcast to float32), ``k_pages (P, Z, K, D)``, ``v_pages (P, Z, K, E)`` (float32, bfloat16 or
    float16 read as they are, each element upcast as the tile is packed: no float32 copy of the pool), ``page_table (R, M)``, ``kv_lens (R,)``, ``cu_q_lens (R + 1,)``; query i of request r sits at
    position ``kv_lens[r] - q_len + i`` and sees key j where ``position - left <= j <= position + right`` and
    ``j < kv_lens[r]``. The rows of a request for one kv head (its G heads' tokens) are cut into tasks of
    ``block_q`` rows and ``split`` keys (a multiple of :data:`BLOCK_KV`), run on ``threads`` threads; a row's splits are merged in key order,
    with the tiles and splits of :func:`forward`, so a row's bits are the same there and here. Requests whose tables
    are broken are skipped (0 rows); rows of no request are 0 with lse ``-inf``. Requires :func:`available`.
    """
    if _library() is None:
        raise RuntimeError("jattn's fused CPU kernels are not available here (jattn._blockwise.fused_cpu.available())")
    Q, N, E = q.shape[0], q.shape[1], v_pages.shape[-1]
    shapes = (jax.ShapeDtypeStruct((Q, N, E), jnp.float32), jax.ShapeDtypeStruct((Q, N), jnp.float32))
    fn = jax.ffi.ffi_call(PAGED, shapes, vmap_method="sequential")
    pages = (
        (k_pages, v_pages)
        if k_pages.dtype in _PAGE_DTYPES
        else (k_pages.astype(jnp.float32), v_pages.astype(jnp.float32))
    )
    tables = (x.astype(jnp.int32) for x in (page_table, kv_lens, cu_q_lens))
    return fn(
        q.astype(jnp.float32), *pages, *tables, left=np.int64(window[0]), right=np.int64(window[1]), scale=np.float32(scale),
        block_q=np.int64(block_q), block_kv=np.int64(BLOCK_KV), split=np.int64(split), threads=np.int64(threads),
    )  # fmt: skip
