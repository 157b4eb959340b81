"""The paged call's operands checked: shapes and dtypes always, the tables' values where they are concrete.

Shapes and dtypes raise at trace time. The tables' values (page indices, ``kv_lens``, ``cu_q_lens``) raise a
``ValueError`` eagerly, where they are concrete; under ``jit`` :func:`bad_requests` marks the requests they
break, whose rows the paths return as NaN (never a wrong answer, never another request's keys).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jattn._masks import Mask, as_mask

__all__ = ["Paged", "bad_requests", "check_paged", "check_values"]


@dataclasses.dataclass(frozen=True)
class Paged:
    """The checked operands (dimension key in :mod:`jattn._core`, paged names in :func:`jattn.paged_attention`).

    ``q (Q, N, D)``, ``k_pages (P, Z, K, D)``, ``v_pages (P, Z, K, E)``, ``page_table (R, M)``, ``kv_lens (R,)``
    and ``cu_q_lens (R + 1,)`` int32, the mask (positions only, or None), and the scale.
    """

    q: Array
    k_pages: Array
    v_pages: Array
    page_table: Array
    kv_lens: Array
    cu_q_lens: Array
    mask: Mask | None
    scale: float

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.q.shape[1] // self.k_pages.shape[2]


def _shape_error(name: str, want: str, got: tuple[int, ...], why: str) -> ValueError:
    return ValueError(f"paged_attention: {name} must be {want}, got shape {got}: {why}")


def _check_dtypes(q: Array, k: Array, v: Array, tables: dict[str, Array]) -> None:
    for name, x in (("q", q), ("k_pages", k), ("v_pages", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"paged_attention: {name} must be floating point, got {x.dtype} with shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"paged_attention: q, k_pages, v_pages must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype} "
            f"(shapes {q.shape}, {k.shape}, {v.shape})"
        )
    for name, x in tables.items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"paged_attention: {name} must be an integer array, got {x.dtype} with shape {x.shape}")


def _check_shapes(q: Array, k: Array, v: Array, table: Array, kv_lens: Array, cu: Array) -> None:
    if q.ndim != 3:
        raise _shape_error("q", "(Q, N, D): a flat ragged batch of query tokens", q.shape, f"rank {q.ndim}")
    if k.ndim != 4:
        raise _shape_error("k_pages", "(P, Z, K, D): pages of Z tokens", k.shape, f"rank {k.ndim}")
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise _shape_error("v_pages", f"(P, Z, K, E) with (P, Z, K) = {k.shape[:3]} of k_pages", v.shape, "mismatch")
    if k.shape[3] != q.shape[2]:
        raise _shape_error("k_pages", f"(P, Z, K, D) with D = {q.shape[2]} of q {q.shape}", k.shape, "D differs")
    if q.shape[1] % k.shape[2]:
        raise _shape_error("q", f"(Q, N, D) with N a multiple of K = {k.shape[2]} (k_pages {k.shape})", q.shape, "GQA")
    if table.ndim != 2:
        raise _shape_error("page_table", "(R, M): each request's pages", table.shape, f"rank {table.ndim}")
    R = table.shape[0]
    if kv_lens.shape != (R,):
        raise _shape_error("kv_lens", f"(R,) = ({R},) as page_table {table.shape}", kv_lens.shape, "mismatch")
    if cu.shape != (R + 1,):
        raise _shape_error("cu_q_lens", f"(R + 1,) = ({R + 1},) for page_table {table.shape}", cu.shape, "mismatch")


def check_paged(
    q: ArrayLike,
    k_pages: ArrayLike,
    v_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lens: ArrayLike,
    cu_q_lens: ArrayLike,
    mask: Mask | None,
    scale: float | None,
) -> Paged:
    """The operands as arrays, checked (shapes, dtypes, mask kind; values where concrete: :func:`check_values`)."""
    q, k, v = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    tables = dict(page_table=jnp.asarray(page_table), kv_lens=jnp.asarray(kv_lens), cu_q_lens=jnp.asarray(cu_q_lens))
    _check_dtypes(q, k, v, tables)
    table, kv_lens, cu = (x.astype(jnp.int32) for x in tables.values())
    _check_shapes(q, k, v, table, kv_lens, cu)
    if mask is not None:
        mask = as_mask(mask)
        if mask.per_example or mask.has_arrays or mask.per_row:
            raise ValueError(
                f"paged_attention: mask must be a predicate of positions alone (causal, sliding_window, "
                f"global_tokens, chunked, prefix_lm and their combinations), got {mask!r}: a request's lengths "
                "are kv_lens and cu_q_lens"
            )
    if scale is not None and not isinstance(scale, int | float):
        raise TypeError(f"paged_attention: scale must be a Python float or None, got {scale!r}")
    scale = 1.0 / float(np.sqrt(q.shape[2])) if scale is None else float(scale)
    paged = Paged(q, k, v, table, kv_lens, cu, mask, scale)
    check_values(paged)
    return paged


def _concrete(*xs: Array) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_values(p: Paged) -> None:
    """Raises a ``ValueError`` naming the first broken table entry, where the tables are concrete (eager calls)."""
    if not _concrete(p.page_table, p.kv_lens, p.cu_q_lens):
        return
    table, kv, cu = (np.asarray(x) for x in (p.page_table, p.kv_lens, p.cu_q_lens))
    P, Z = p.k_pages.shape[:2]
    M, Q = table.shape[1], p.q.shape[0]
    if cu[0] < 0 or np.any(np.diff(cu) < 0) or cu[-1] > Q:
        raise ValueError(f"paged_attention: cu_q_lens must increase from >= 0 to at most Q = {Q}, got {cu.tolist()}")
    q_lens = np.diff(cu)
    for r in range(len(kv)):
        if not 0 <= kv[r] <= M * Z:
            raise ValueError(
                f"paged_attention: kv_lens[{r}] = {kv[r]} is beyond the request's pages: page_table {table.shape} "
                f"holds at most M * Z = {M} * {Z} = {M * Z} keys"
            )
        if q_lens[r] > kv[r]:
            raise ValueError(
                f"paged_attention: request {r} has q length {q_lens[r]} (cu_q_lens[{r}:{r + 2}] = "
                f"{cu[r : r + 2].tolist()}) longer than its kv length kv_lens[{r}] = {kv[r]}: its queries are its last "
                "q length keys, written into the pages before the call"
            )
        used = table[r, : -(-int(kv[r]) // Z)]
        if np.any((used < 0) | (used >= P)):
            bad = int(used[(used < 0) | (used >= P)][0])
            raise ValueError(
                f"paged_attention: page_table[{r}] holds page {bad}, out of range for k_pages {p.k_pages.shape} "
                f"({P} pages)"
            )


def bad_requests(p: Paged) -> Array:
    """``(R,)`` bool: the requests whose table entries are broken (the rows the paths return as NaN under ``jit``).

    A request is broken where its kv length is negative or beyond its pages, its q length is negative or longer
    than its kv length, or a page it uses is out of range; where ``cu_q_lens`` does not increase from 0 to at
    most Q anywhere, every request is (its rows cannot be told apart).
    """
    P, Z = p.k_pages.shape[:2]
    M, Q = p.page_table.shape[1], p.q.shape[0]
    kv, cu = p.kv_lens, p.cu_q_lens
    q_lens = cu[1:] - cu[:-1]
    used = jnp.arange(M, dtype=jnp.int32)[None, :] < (kv[:, None] + Z - 1) // Z
    out_of_range = jnp.any(used & ((p.page_table < 0) | (p.page_table >= P)), axis=1)
    broken = (kv < 0) | (kv > M * Z) | (q_lens < 0) | (q_lens > kv) | out_of_range
    torn = (cu[0] < 0) | jnp.any(q_lens < 0) | (cu[-1] > Q)
    return broken | torn
