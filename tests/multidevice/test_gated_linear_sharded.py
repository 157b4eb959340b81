"""``jattn.gated_linear_attention(axis_name=...)``: the sequence over 4 devices equals the call on one.

The state passes from shard to shard; documents start inside a shard, exactly at a shard's first step and
run across shard boundaries; values, the final state and the gradients of every input must agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import jattn
from tests import reference as ref

B, N, D, E, SHARDS, LOCAL = 2, 3, 5, 7, 4, 13  # T = 52: 13 steps a shard, chunks of 8 cross them
T = SHARDS * LOCAL


def _inputs(variant: str):
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((B, N, T, x)), jnp.float32) for x in (D, D, E))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    gates = {
        "gated deltanet": {
            "g": jnp.asarray(-r.uniform(0, 0.3, (B, N, T)), jnp.float32),
            "beta": jnp.asarray(r.uniform(0.1, 0.9, (B, N, T)), jnp.float32),
        },
        "gla": {"gk": jnp.asarray(-r.uniform(0, 0.3, (B, N, T, D)), jnp.float32)},
        "kda": {
            "gk": jnp.asarray(-r.uniform(0, 0.3, (B, N, T, D)), jnp.float32),
            "beta": jnp.asarray(r.uniform(0.1, 0.9, (B, N, T)), jnp.float32),
        },
    }[variant]
    starts = np.zeros((B, 1, T), np.int32)
    starts[0, 0, [5, 26, 40]] = 1  # inside a shard, at the third shard's first step, and one crossing into the fourth
    starts[1, 0, [20]] = 1
    state = jnp.asarray(r.standard_normal((N, D, E)), jnp.float32)
    return (q, k, v), gates, jnp.asarray(np.cumsum(starts, axis=-1)), state


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("variant", ["gated deltanet", "gla", "kda"])
def test_the_sequence_over_4_devices_equals_one_device(variant, mode):
    (q, k, v), gates, ids, state = _inputs(variant)
    mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
    seq = PartitionSpec(None, None, "seq")

    def call(q, k, v, gates, ids, state, axis_name=None):
        return jattn.gated_linear_attention(
            q, k, v, **gates, segment_ids=ids, initial_state=state, return_state=True, chunk_size=8, mode=mode,
            axis_name=axis_name,
        )  # fmt: skip

    gate_specs = {n: (seq if x.ndim == 3 else PartitionSpec(None, None, "seq", None)) for n, x in gates.items()}
    sharded = jax.shard_map(
        lambda *a: call(*a, axis_name="seq"),
        mesh=mesh,
        in_specs=(PartitionSpec(None, None, "seq", None),) * 3 + (gate_specs, seq, PartitionSpec()),
        out_specs=(PartitionSpec(None, None, "seq", None), PartitionSpec()),
    )
    args = (q, k, v, gates, ids, state)
    out, final = jax.jit(sharded)(*args)
    want, want_final = call(*args)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float32))
    np.testing.assert_allclose(
        want, ref.gated_linear(q, k, v, **gates, segment_ids=ids, state=state)[0], **ref.tol(jnp.float32)
    )

    w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)

    def loss(f):
        return lambda q, k, v, gates, state: (
            jnp.sum(w * f(q, k, v, gates, ids, state)[0]) + jnp.sum(f(q, k, v, gates, ids, state)[1])
        )

    grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3, 4)))(q, k, v, gates, state)
    want_grads = jax.grad(loss(call), argnums=(0, 1, 2, 3, 4))(q, k, v, gates, state)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_deltaproduct_over_4_devices_equals_one_device(mode):
    """DeltaProduct (3 sub-steps a token): each shard holds its tokens' sub-steps; documents cross shards."""
    nh = 3
    (q, _, _), gates, ids, state = _inputs("gated deltanet")
    r = np.random.default_rng(2)
    k = jnp.asarray(r.standard_normal((B, N, T * nh, D)), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(r.standard_normal((B, N, T * nh, E)), jnp.float32)
    gates = {"g": gates["g"], "beta": jnp.asarray(r.uniform(0.1, 0.9, (B, N, T * nh)), jnp.float32)}
    mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
    seq, rows = PartitionSpec(None, None, "seq"), PartitionSpec(None, None, "seq", None)

    def call(q, k, v, gates, ids, state, axis_name=None):
        return jattn.gated_linear_attention(
            q, k, v, **gates, num_householder=nh, segment_ids=ids, initial_state=state, return_state=True,
            chunk_size=8, mode=mode, axis_name=axis_name,
        )  # fmt: skip

    sharded = jax.shard_map(
        lambda *a: call(*a, axis_name="seq"),
        mesh=mesh,
        in_specs=(rows,) * 3 + ({"g": seq, "beta": seq}, seq, PartitionSpec()),
        out_specs=(rows, PartitionSpec()),
    )
    args = (q, k, v, gates, ids, state)
    out, final = jax.jit(sharded)(*args)
    want, want_final = call(*args)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float32))
    np.testing.assert_allclose(
        want, ref.delta_product(q, k, v, gates["beta"], nh, g=gates["g"], segment_ids=ids, state=state)[0],
        **ref.tol(jnp.float32),
    )  # fmt: skip

    w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)

    def loss(f):
        return lambda q, k, v, gates, state: (
            jnp.sum(w * f(q, k, v, gates, ids, state)[0]) + jnp.sum(f(q, k, v, gates, ids, state)[1])
        )

    grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3, 4)))(q, k, v, gates, state)
    want_grads = jax.grad(loss(call), argnums=(0, 1, 2, 3, 4))(q, k, v, gates, state)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_the_low_rank_transition_over_4_devices_equals_one_device(mode):
    """RWKV-7's diagonal-plus-low-rank transition (a, b): each shard's map is ``[M | H]`` with ``M (D, D)``.

    float64: the sharded call equals the one-device call and the NumPy loop to 1e-12, values, state and gradients.
    """
    with jax.enable_x64(True):
        (q, k, v), _, ids, state = _inputs("gla")
        q, k, v, state = (x.astype(jnp.float64) for x in (q, k, v, state))
        r = np.random.default_rng(2)
        kappa = r.standard_normal((B, N, T, D))
        kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
        gates = {
            "gk": jnp.asarray(-r.uniform(0, 0.5, (B, N, T, D))),
            "a": jnp.asarray(-kappa),
            "b": jnp.asarray(kappa * r.uniform(0, 1, (B, N, T, D))),
        }
        mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
        seq, rows = PartitionSpec(None, None, "seq"), PartitionSpec(None, None, "seq", None)

        def call(q, k, v, gates, ids, state, axis_name=None):
            return jattn.gated_linear_attention(
                q, k, v, **gates, segment_ids=ids, initial_state=state, return_state=True, chunk_size=8, mode=mode,
                axis_name=axis_name,
            )  # fmt: skip

        sharded = jax.shard_map(
            lambda *a: call(*a, axis_name="seq"),
            mesh=mesh,
            in_specs=(rows,) * 3 + ({n: rows for n in gates}, seq, PartitionSpec()),
            out_specs=(rows, PartitionSpec()),
        )
        args = (q, k, v, gates, ids, state)
        out, final = jax.jit(sharded)(*args)
        want, want_final = ref.dplr(q, k, v, **gates, segment_ids=ids, state=state)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))

        w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape))

        def loss(f):
            def total(q, k, v, gates, state):
                out, final = f(q, k, v, gates, ids, state)
                return jnp.sum(w * out) + jnp.sum(final)

            return total

        grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3, 4)))(q, k, v, gates, state)
        want_grads = jax.grad(loss(call), argnums=(0, 1, 2, 3, 4))(q, k, v, gates, state)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            ref.assert_grad_close(got, want, jnp.float64)
