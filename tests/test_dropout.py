"""Dropout on the dense and blockwise paths: one keep bit per (leading row, query, key), so every
block size drops exactly what the dense path drops; outputs and gradients against a float64
reference that applies the same materialised mask; unbiased; vmap; empty rows stay 0."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks
from tests import reference as ref
from tests.dropout_probe import dropout_factor

RATE = 0.3
BLOCKS = [(4, 3), (5, 13), (11, 2)]


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _factor(lead_q, lead_kv, T, S, key, **kw):
    return dropout_factor(RATE, lead_q, lead_kv, T, S, key, **kw)


def test_every_block_size_drops_what_dense_drops():
    """The keep bits of the blockwise path equal the dense path's for any tiling, in every leading row."""
    key = jax.random.key(11)
    lead_q, lead_kv, T, S = (2, 3), (2, 1), 11, 13  # k, v shared over the heads: rows still differ by head
    dense = _factor(lead_q, lead_kv, T, S, key, implementation="dense")
    keep = dense != 0
    np.testing.assert_allclose(dense[keep], 1 / (1 - RATE), rtol=1e-6)
    for bs in BLOCKS:
        block = _factor(lead_q, lead_kv, T, S, key, implementation="blockwise", block_size=bs)
        np.testing.assert_array_equal(block != 0, keep, err_msg=f"block_size={bs}")
    # a real draw: about keep_prob kept (8 sigma), different in every leading row, and per key
    n = keep.size
    assert abs(keep.mean() - (1 - RATE)) < 8 * np.sqrt(RATE * (1 - RATE) / n)
    rows = keep.reshape(-1, T, S)
    assert all(not np.array_equal(rows[a], rows[b]) for a in range(len(rows)) for b in range(a))
    assert not np.array_equal(keep, _factor(lead_q, lead_kv, T, S, jax.random.key(12), implementation="dense") != 0)


@functools.cache
def _same_mask_reference():
    """The inputs, Z of the dense path and the float64 out = (P ∘ Z) v and its gradients, computed once."""
    key = jax.random.key(5)
    q, k, v = _rand((2, 3, 11, 5), 0), _rand((2, 1, 13, 5), 1), _rand((2, 1, 13, 4), 2)
    d_out = _rand((2, 3, 11, 4), 3)
    drop = _factor((2, 3), (2, 1), 11, 13, key, implementation="dense")
    dense_mask = np.asarray(masks.causal().dense(11, 13, q_offset=-2))
    _, w, _ = ref.attention(q, k, v, dense_mask)
    want = np.matmul(w * drop, ref.f64(v))
    want_grads = ref.attention_grads(q, k, v, d_out, dense_mask, drop=drop)[:3]
    return key, (q, k, v), d_out, want, want_grads


@pytest.mark.parametrize(("impl", "bs"), [("dense", None), *(("blockwise", bs) for bs in BLOCKS)])
def test_outputs_and_gradients_match_the_reference_with_the_same_mask(impl, bs):
    """out = (P ∘ Z) v and its gradients, dense and blockwise, against float64 with Z materialised; empty rows 0."""
    key, (q, k, v), d_out, want, want_grads = _same_mask_reference()
    extra = dict(block_size=bs) if impl == "blockwise" else {}
    kw = dict(mask=masks.causal(), q_offset=-2, dropout_rate=RATE, dropout_rng=key, **extra)  # rows 0, 1 see no key

    def loss(q, k, v):
        return jnp.sum(jattn.attention(q, k, v, implementation=impl, **kw) * d_out)

    @jax.jit
    def run(q, k, v):
        return jattn.attention(q, k, v, implementation=impl, **kw), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out, grads = run(q, k, v)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    assert np.all(np.asarray(out[..., :2, :]) == 0)
    for got, exp in zip(grads, want_grads, strict=True):
        ref.assert_grad_close(got, exp, jnp.float32)
    assert np.all(np.asarray(grads[0][..., :2, :]) == 0)  # the empty rows' dq is exactly 0


def test_blockwise_dropout_is_unbiased_and_vmaps():
    """Over many keys the mean is the undropped output; vmap over keys gives each key's own call."""
    q, k, v = _rand((7, 5), 0), _rand((9, 5), 1), _rand((9, 4), 2)
    kw = dict(implementation="blockwise", block_size=(4, 3), dropout_rate=RATE)
    keys = jax.random.split(jax.random.key(9), 1000)
    outs = jax.jit(jax.vmap(lambda r: jattn.attention(q, k, v, dropout_rng=r, **kw)))(keys)
    exact = jax.jit(lambda q, k, v: jattn.attention(q, k, v, implementation="dense"))(q, k, v)
    assert np.max(np.abs(outs.std(0))) > 0.05  # it does drop
    np.testing.assert_allclose(outs.mean(0), exact, atol=4 * float(outs.std(0).max()) / np.sqrt(len(keys)))
    dense = jax.jit(lambda r: jattn.attention(q, k, v, dropout_rng=r, implementation="dense", dropout_rate=RATE))
    for i in (0, 999):
        np.testing.assert_allclose(outs[i], dense(keys[i]), **ref.tol(jnp.float32))
    # vmap over a leading axis of q: the mapped element's rows are the rows of an unmapped call
    qs = _rand((3, 7, 5), 4)
    call = jax.jit(lambda x: jattn.attention(x, k, v, dropout_rng=keys[0], **kw))
    mapped = jax.vmap(call)(qs)
    for i in range(3):
        one = call(qs[i])
        np.testing.assert_allclose(mapped[i], one, **ref.tol(jnp.float32))


def test_rate_zero_is_no_dropout():
    q, k, v = _rand((2, 7, 5), 0), _rand((2, 9, 5), 1), _rand((2, 9, 4), 2)
    for impl in ("dense", "blockwise"):
        got, want = jax.jit(
            lambda q, k, v, impl=impl: (
                jattn.attention(q, k, v, implementation=impl, dropout_rate=0.0, dropout_rng=jax.random.key(0)),
                jattn.attention(q, k, v, implementation=impl),
            )
        )(q, k, v)
        np.testing.assert_array_equal(got, want)


def test_blockwise_dropout_gradients_equal_dense_with_bias_sinks_and_score_mod():
    """Dropout composes with a bias, sinks and a score modification: loss and every gradient as on dense."""
    q, k, v = _rand((2, 3, 11, 5), 0), _rand((2, 3, 13, 5), 1), _rand((2, 3, 13, 4), 2)
    bias, sinks, slopes = _rand((11, 13), 3), _rand((3,), 4), jnp.asarray([0.5, 0.25, 0.125], jnp.float32)

    def loss(impl, *args):
        q, k, v, bias, sinks, slopes = args
        extra = dict(block_size=(4, 3)) if impl == "blockwise" else {}
        out = jattn.attention(
            q, k, v, bias=bias, sinks=sinks, score_mod=jattn.score_mods.alibi(slopes), mask=masks.causal(),
            dropout_rate=0.4, dropout_rng=jax.random.key(3), implementation=impl, **extra,
        )  # fmt: skip
        return jnp.sum(out * jnp.cos(out))

    args = (q, k, v, bias, sinks, slopes)
    want = jax.jit(jax.value_and_grad(lambda *a: loss("dense", *a), argnums=tuple(range(6))))(*args)
    got = jax.jit(jax.value_and_grad(lambda *a: loss("blockwise", *a), argnums=tuple(range(6))))(*args)
    np.testing.assert_allclose(got[0], want[0], **ref.tol(jnp.float32))
    for g, w in zip(got[1], want[1], strict=True):
        ref.assert_grad_close(g, ref.f64(w), jnp.float32)


def test_no_scores_buffer_with_dropout():
    """Forward + backward with dropout compile to no (T, S) buffer and scratch linear in T (the keep bits are recomputed)."""

    def temp(T):
        spec = jax.ShapeDtypeStruct((1, 2, T, 64), jnp.float32)

        def loss(q, k, v):  # block_size fixed: the automatic tiles depend on T and the threads
            out = jattn.attention(
                q, k, v, mask=masks.causal(), implementation="blockwise", dropout_rate=0.1,
                dropout_rng=jax.random.key(0), block_size=512,
            )  # fmt: skip
            return jnp.sum(out)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
        return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()

    (small, _), (big, text) = temp(2048), temp(4096)
    assert "4096,4096]" not in text and big < 2 * 4096 * 4096 * 4 / 4
    assert big / small < 2.5
