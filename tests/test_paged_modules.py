"""The modules' paged cache: a serving step of ragged requests equals each request's contiguous-cache decode.

Requests of different lengths arrive in ragged steps (prefill chunks beside decode tokens) with their pages
scattered through the pool; each request's outputs are compared with the same module decoding it alone from the
contiguous cache (``init_cache``, chunked the same way, then token by token) and with the module's full pass, and
NNX with Linen on the same weights. Pool placements must not matter: the same schedule on another page permutation
gives the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn.linen
import jattn.nnx
from jattn import masks
from tests import reference as ref

D_MODEL, PAGE, POOL = 24, 4, 24
OPTIONS = dict(num_heads=4, num_kv_heads=2, out_proj=True, rope=True, normalize_qk=True, causal=True, sinks=True)
LENGTHS = (11, 5, 17)
# Steps of (request, tokens): prefill chunks beside decode tokens, requests joining and leaving.
SCHEDULE = (((0, 6), (1, 5)), ((0, 3), (1, 0), (2, 8)), ((0, 1), (2, 9)), ((0, 1),))


def _module(seed: int = 0) -> jattn.nnx.SelfAttention:
    m = jattn.nnx.SelfAttention(D_MODEL, rngs=nnx.Rngs(seed), **OPTIONS)
    m.sinks[...] = jax.random.normal(jax.random.key(7), (4,))
    return m


def _inputs() -> list[jax.Array]:
    return [jax.random.normal(jax.random.key(10 + r), (n, D_MODEL)) for r, n in enumerate(LENGTHS)]


def _tables(perm: np.ndarray) -> np.ndarray:
    """Each request's pages: consecutive chunks of the permuted pool (R, M)."""
    width = -(-max(LENGTHS) // PAGE)
    return perm[: len(LENGTHS) * width].reshape(len(LENGTHS), width).astype(np.int32)


def _batches(tables: np.ndarray) -> list[tuple[np.ndarray, jattn.nnx.PagedBatch, list[tuple[int, int, int]]]]:
    """Per step: the token rows ``(Q,)`` into each request, the batch, and ``(request, start, stop)``."""
    done, steps = [0] * len(LENGTHS), []
    for step in SCHEDULE:
        cu, kv, parts, positions = [0], [], [], []
        for r, n in step:
            parts.append((r, done[r], done[r] + n))
            positions += list(range(done[r], done[r] + n))
            done[r] += n
            cu.append(cu[-1] + n)
            kv.append(done[r])
        pos = np.asarray(positions, np.int32)
        req = np.repeat([r for r, _ in step], [n for _, n in step])
        table = tables[[r for r, _ in step]]
        batch = jattn.nnx.PagedBatch(table, np.asarray(kv, np.int32), np.asarray(cu, np.int32),
                                     tables[req, pos // PAGE], pos % PAGE, pos)  # fmt: skip
        steps.append((pos, batch, parts))
    assert done == list(LENGTHS)
    return steps


def _serve(call, xs: list[jax.Array], tables: np.ndarray) -> list[np.ndarray]:
    """Each request's outputs ``(L_r, d_model)`` from the steps ``call(x (Q, d), batch)``."""
    outs = [np.zeros((n, D_MODEL), np.float32) for n in LENGTHS]
    for _, batch, parts in _batches(tables):
        x = jnp.concatenate([xs[r][a:b] for r, a, b in parts])
        y, start = np.asarray(call(x, batch)), 0
        for r, a, b in parts:
            outs[r][a:b] = y[start : start + b - a]
            start += b - a
    return outs


def _contiguous(m: jattn.nnx.SelfAttention, x: jax.Array, r: int) -> np.ndarray:
    """Request ``r`` decoded alone from the contiguous cache, in the chunks the schedule gives it."""
    m.init_cache(1, 32)
    chunks = [n for step in SCHEDULE for q, n in step if q == r and n]
    outs, at = [], 0
    for n in chunks:
        outs.append(m(x[None, at : at + n], masks.causal(), decode=True)[0])
        at += n
    return np.asarray(jnp.concatenate(outs))


def _nnx_paged(perm: np.ndarray) -> list[np.ndarray]:
    m = _module()
    m.init_paged_cache(POOL, PAGE)
    return _serve(lambda x, b: m(x, paged=b), _inputs(), _tables(perm))


def test_paged_steps_equal_the_contiguous_cache_and_the_full_pass():
    perm = np.random.default_rng(0).permutation(POOL)
    paged = _nnx_paged(perm)
    for r, x in enumerate(_inputs()):
        contiguous = _contiguous(_module(), x, r)
        full = np.asarray(_module()(x[None], masks.causal(), implementation="blockwise")[0])
        assert np.isfinite(paged[r]).all()
        np.testing.assert_allclose(paged[r], contiguous, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(paged[r], full, rtol=1e-5, atol=1e-5)


def test_where_the_pages_are_does_not_change_a_bit():
    a = _nnx_paged(np.random.default_rng(0).permutation(POOL))
    b = _nnx_paged(np.random.default_rng(1).permutation(POOL)[::-1].copy())
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)


def test_linen_serves_as_nnx_on_the_same_weights():
    m = _module()
    norms = {name: {"scale": getattr(m, name).scale[...]} for name in ("query_ln", "key_ln")}
    params = ref.linen_params(m) | norms | {"sinks": m.sinks[...]}
    lin = jattn.linen.SelfAttention(D_MODEL, **OPTIONS)
    cache = {"cache": lin.init(jax.random.key(0), POOL, PAGE, method="init_paged_cache")["cache"]}

    def call(x, batch):
        y, variables = lin.apply({"params": params, **cache}, x, paged=batch, mutable=["cache"])
        cache["cache"] = variables["cache"]
        return y

    perm = np.random.default_rng(0).permutation(POOL)
    for x, y in zip(_serve(call, _inputs(), _tables(perm)), _nnx_paged(perm), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_the_wrong_cache_or_kind_is_named():
    m = _module()
    batch = _batches(_tables(np.arange(POOL)))[0][1]
    x = jnp.zeros((11, D_MODEL))
    with pytest.raises(ValueError, match="init_paged_cache"):
        m(x, paged=batch)
    m.init_cache(1, 8)
    with pytest.raises(ValueError, match="init_paged_cache"):
        m(x, paged=batch)
    m.init_paged_cache(POOL, PAGE)
    with pytest.raises(ValueError, match="paged cache"):
        m(x[None], masks.causal(), decode=True)
    with pytest.raises(ValueError, match=r"\(Q, d_model\)"):
        m(x[None], paged=batch)
    linear = jattn.nnx.SelfAttention(D_MODEL, num_heads=2, kind="linear", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kind='softmax'"):
        linear.init_paged_cache(POOL, PAGE)
