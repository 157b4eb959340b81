"""A paged-attention case: a ragged batch's queries, a page pool and its tables (tests/test_paged*.py build them)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tests import reference as ref


@dataclasses.dataclass
class Case:
    """Operands of ``jattn.paged_attention`` as NumPy arrays; :meth:`args` gives them in ``dtype`` (tables int32)."""

    q: np.ndarray  # (Q, N, D)
    k_pages: np.ndarray  # (P, Z, K, D)
    v_pages: np.ndarray  # (P, Z, K, E)
    table: np.ndarray  # (R, M)
    kv_lens: np.ndarray  # (R,)
    cu: np.ndarray  # (R + 1,)

    def args(self, dtype=jnp.float32) -> tuple:
        floats = (jnp.asarray(x, dtype) for x in (self.q, self.k_pages, self.v_pages))
        return (*floats, *(jnp.asarray(x, jnp.int32) for x in (self.table, self.kv_lens, self.cu)))


def case(seed: int, q_lens, kv_lens, Z: int, heads: tuple[int, int], depths: tuple[int, int], pad: int = 2) -> Case:
    """Requests of ``q_lens`` queries and ``kv_lens`` keys, their pages in random order in a pool of pages of ``Z``."""
    rng = np.random.default_rng(seed)
    (N, K), (D, E) = heads, depths
    need = [-(-kv // Z) for kv in kv_lens]
    M, P = max(need) + 1, sum(need) + 2
    order = iter(rng.permutation(P))
    table = rng.choice([-1, P, P + 5], size=(len(q_lens), M))  # junk past each request's pages
    for r, n in enumerate(need):
        table[r, :n] = [next(order) for _ in range(n)]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    normal = rng.standard_normal
    return Case(
        normal((cu[-1] + pad, N, D)), normal((P, Z, K, D)), normal((P, Z, K, E)), table, np.asarray(kv_lens), cu
    )


def reference_rows(c: Case, dtype, mask) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference ``out (Q, N, E)``, ``lse (Q, N)``, request by request from its gathered keys."""
    q, kp, vp = (ref.f64(jnp.asarray(x, dtype)) for x in (c.q, c.k_pages, c.v_pages))
    (Q, N, _), (Z, K, E) = q.shape, vp.shape[1:]
    out, lse = np.zeros((Q, N, E)), np.full((Q, N), -np.inf)
    for r, S in enumerate(c.kv_lens):
        lo, hi = c.cu[r], c.cu[r + 1]
        if hi == lo:
            continue
        pages = c.table[r, : -(-S // Z)]
        k, v = (
            np.repeat(x[pages].reshape(-1, K, x.shape[3])[:S].transpose(1, 0, 2), N // K, 0)[None] for x in (kp, vp)
        )
        dense = None if mask is None else np.asarray(mask.dense(hi - lo, S, q_offset=S - (hi - lo)))
        q_r = q[None, lo:hi].transpose(0, 2, 1, 3)
        o, _, row_lse = ref.attention(q_r, k, v, dense, q_offset=S - (hi - lo))
        out[lo:hi], lse[lo:hi] = o[0].transpose(1, 0, 2), row_lse[0].T
    return out, lse
