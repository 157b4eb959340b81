"""A paged-attention case: a ragged batch's queries, a page pool and its tables (tests/test_paged*.py build them)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


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
