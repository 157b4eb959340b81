"""``jattn.log_linear_attention(axis_name=...)``: the sequence over 4 devices equals the call on one (float64).

The level states pass from shard to shard; a document runs across a shard boundary, one starts at a shard's
first step, padding covers one example's last shard whole; values, the final level states and the gradients of
every input, the initial state included, must agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import jattn
from tests import reference as ref

B, N, D, E, SHARDS, LOCAL, L = 2, 3, 5, 7, 4, 12, 7  # T = 48: 12 steps a shard (3 chunks of 4), 7 levels
T = SHARDS * LOCAL


def _inputs():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((B, N, T, x))) for x in (D, D, E))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    gates = {"g": jnp.asarray(-r.uniform(0, 0.1, (B, N, T))), "beta": jnp.asarray(r.uniform(0.1, 0.9, (B, N, T)))}
    lam = jnp.asarray(r.uniform(0.2, 2.0, (B, N, T, L)))
    starts = np.zeros((B, 1, T), np.int32)
    starts[0, 0, [5, 24]] = 1  # a document from step 5 across shards 0 and 1, and one from shard 2's first step
    starts[1, 0, [17]] = 1
    keep = np.ones((B, 1, T), bool)
    keep[0, 0, 11] = False  # shard 0's last step dropped
    keep[1, 0, 30:] = False  # padding from inside shard 2 through all of shard 3
    state = jnp.asarray(r.standard_normal((N, L, D, E)))
    return (q, k, v), gates, lam, jnp.asarray(np.cumsum(starts, axis=-1)), jnp.asarray(keep), state


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("kind", ["ssd", "gated deltanet"])
def test_the_sequence_over_4_devices_equals_one_device(kind, mode):
    with jax.enable_x64(True):
        (q, k, v), gates, lam, ids, keep, state = _inputs()
        gates = {n: x for n, x in gates.items() if n == "g" or kind == "gated deltanet"}
        mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
        seq, rows = PartitionSpec(None, None, "seq"), PartitionSpec(None, None, "seq", None)

        def call(q, k, v, gates, lam, state, ids, keep, axis_name=None):
            return jattn.log_linear_attention(
                q, k, v, **gates, level_weights=lam, segment_ids=ids, kv_mask=keep, initial_state=state, start=16,
                return_state=True, chunk_size=4, mode=mode, axis_name=axis_name,
            )  # fmt: skip

        sharded = jax.shard_map(
            lambda *a: call(*a, axis_name="seq"),
            mesh=mesh,
            in_specs=(rows,) * 3 + ({n: seq for n in gates}, rows, PartitionSpec(), seq, seq),
            out_specs=(rows, PartitionSpec()),
        )
        args = (q, k, v, gates, lam, state, ids, keep)
        out, final = jax.jit(sharded)(*args)
        want, want_final = call(*args)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(final, want_final, **ref.tol(jnp.float64))
        assert np.max(np.abs(want_final)) > 0.1  # example 1's states come from shard 2, after its last kept step
        # example 1 keeps no step and has one document: its initial states come out as they went in
        nothing = (ids * jnp.asarray([1, 0])[:, None, None], keep & jnp.asarray([True, False])[:, None, None])
        got, want = jax.jit(sharded)(*args[:6], *nothing), call(*args[:6], *nothing)
        np.testing.assert_allclose(got[1], want[1], **ref.tol(jnp.float64))
        np.testing.assert_allclose(got[1][1], jnp.broadcast_to(state, got[1][1].shape), **ref.tol(jnp.float64))

        w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape))

        def loss(f):
            def total(*args):
                out, final = f(*args, ids, keep)
                return jnp.sum(w * out) + jnp.sum(jnp.sin(final))

            return total

        grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3, 4, 5)))(*args[:6])
        want_grads = jax.grad(loss(call), argnums=(0, 1, 2, 3, 4, 5))(*args[:6])
        assert np.max(np.abs(want_grads[5])) > 1e-2  # the initial state reaches the end
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            ref.assert_grad_close(got, want, jnp.float64)


def test_a_shard_length_off_the_chunks_is_refused():
    (q, k, v), _, lam, _, _, _ = _inputs()
    mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
    rows = PartitionSpec(None, None, "seq", None)
    sharded = jax.shard_map(
        lambda q, k, v, lam: jattn.log_linear_attention(q, k, v, level_weights=lam, chunk_size=8, axis_name="seq"),
        mesh=mesh,
        in_specs=(rows,) * 4,
        out_specs=rows,
    )
    with pytest.raises(ValueError, match=r"shard length T=12 to be a multiple of the chunk.*mode='recurrent'"):
        sharded(q, k, v, lam)


def test_too_few_levels_name_the_shard_and_the_whole_sequence():
    """Under shard_map the error names both lengths: the shard's T (level_weights' rows) and the sequence's end."""
    (q, k, v), _, lam, _, _, _ = _inputs()
    mesh = jax.make_mesh((SHARDS,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS])
    rows = PartitionSpec(None, None, "seq", None)
    sharded = jax.shard_map(
        lambda q, k, v, lam: jattn.log_linear_attention(
            q, k, v, level_weights=lam[..., :3], mode="recurrent", axis_name="seq"
        ),
        mesh=mesh,
        in_specs=(rows,) * 4,
        out_specs=rows,
    )
    # 48 steps reach position 47: bit_length 6, plus 1 = 7 levels; 3 given
    match = (
        rf"\(\.\.\., T={LOCAL}: this shard's steps of the sequence's {T}, L\) with L >= {L} levels.*position {T - 1} "
    )
    with pytest.raises(ValueError, match=match):
        sharded(q, k, v, lam)
