"""jattn.TRANSFORMS on simulated devices: the ring column, and the shard_map row of every path.

The ring column runs ``ring_attention`` (causal, a 4-device ring) under each transformation of the
table and compares it with the same transformation of the float64 dense reference on the gathered
arrays; the shard_map row runs each path inside a batch- and head-sharded ``shard_map`` (2 x 2
devices) under jvp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import jattn
from jattn import masks
from tests.reference import TRANSFORM_RUNS, assert_grad_close, dense_jax, f64, transform_loss

B, N, T, D = 2, 2, 16, 4
CAUSAL = np.tril(np.ones((T, T), bool))
SEQ = PartitionSpec(None, None, "s", None)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _args(n: int = 6):
    keys = jax.random.split(jax.random.key(7), n)
    return tuple(jax.random.normal(key, (B, N, T, D), jnp.float32) for key in keys)


def _ring(q, k, v):
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    local = lambda q, k, v: jattn.ring_attention(q, k, v, axis_name="s", mask=masks.causal())  # noqa: E731
    return jax.shard_map(local, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q, k, v)


def _reference(q, k, v):
    return dense_jax(*(x.astype(jnp.float64) for x in (q, k, v)), keep=CAUSAL)[0]


def _close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        assert_grad_close(g, f64(w), jnp.float32)


@pytest.mark.parametrize("row", [r for r in jattn.TRANSFORMS if r in TRANSFORM_RUNS])
def test_ring_cell(row):
    assert jattn.TRANSFORMS[row]["ring"] == "yes"
    q, k, v, *t = _args()
    run = TRANSFORM_RUNS[row] if row == "eval_shape" else jax.jit(TRANSFORM_RUNS[row], static_argnums=0)  # 12x faster
    got, want = run(_ring, (q, k, v), tuple(t)), run(_reference, (q, k, v), tuple(t))
    if row == "eval_shape":
        assert got == jax.eval_shape(jax.jit(_ring), q, k, v) and got.shape == want.shape
    else:
        _close(got, want)


def test_ring_cell_checkpoint(capsys):
    policy = jax.checkpoint_policies.save_only_these_names(*jattn.CHECKPOINT_NAMES)
    loss = jax.checkpoint(transform_loss(_ring), policy=policy)
    q, k, v = _args(3)
    _close(jax.grad(loss, (0, 1, 2))(q, k, v), jax.grad(transform_loss(_reference), (0, 1, 2))(q, k, v))
    jax.ad_checkpoint.print_saved_residuals(loss, q, k, v)  # inside shard_map the names are the body's
    saved = [line for line in capsys.readouterr().out.splitlines() if "output of shard_map" in line]
    assert len(saved) == 2, saved  # out and lse (per device, the ring's flattened rows): no forward is recomputed


def test_ring_cell_export():
    """Exported for the 4-device ring, serialized, deserialized and called on 4 devices."""
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    q, k, v = (jax.device_put(x, jax.sharding.NamedSharding(mesh, SEQ)) for x in _args(3))
    exported = jax.export.deserialize(jax.export.export(jax.jit(_ring))(q, k, v).serialize())
    np.testing.assert_allclose(np.asarray(exported.call(q, k, v)), np.asarray(jax.jit(_ring)(q, k, v)), atol=1e-6)


def test_ring_cell_modules():
    """The module on a sequence-sharded mesh (``sequence_axis``: ring attention) under jvp and a checkpointed grad."""
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    x, dx = (jax.random.normal(key, (2, T, 8), jnp.float32) for key in jax.random.split(jax.random.key(1)))
    ours = jattn.nnx.SelfAttention(8, num_heads=2, sequence_axis="s", rngs=nnx.Rngs(0))
    ref = jattn.nnx.SelfAttention(8, num_heads=2, rngs=nnx.Rngs(0), param_dtype=jnp.float64, implementation="dense")
    nnx.update(ref, jax.tree.map(lambda p: p.astype(jnp.float64), nnx.state(ours, nnx.Param)))

    def runs(module, x, dx):
        graph, state = nnx.split(module)
        f = lambda state, x: nnx.merge(graph, state)(x, masks.causal())  # noqa: E731
        remat = jax.grad(jax.checkpoint(lambda state, x: jnp.sum(jnp.sin(f(state, x)))), argnums=(0, 1))
        return jax.jvp(lambda x: f(state, x), (x,), (dx,)), remat(state, x)

    want = runs(ref, x.astype(jnp.float64), dx.astype(jnp.float64))
    with jax.set_mesh(mesh):
        got = jax.jit(runs)(ours, x, dx)
    _close(got, want)


@pytest.mark.parametrize("path", ["dense", "blockwise", "fused", "xla", "modules"])
def test_shard_map_cell(path):
    """Batch and heads over a 2 x 2 mesh: jvp and a grad through jvp inside shard_map equal the reference's
    (grad: test_shard_map.py)."""
    assert jattn.TRANSFORMS["shard_map"][path] == "yes"
    mesh = jax.make_mesh((2, 2), ("b", "h"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    spec = PartitionSpec("b", "h", None, None)
    kw = {"dense": {}, "blockwise": dict(block_size=8), "fused": {}, "xla": {}, "modules": dict(block_size=8)}[path]
    impl = "blockwise" if path in ("fused", "modules") else path

    def local(q, k, v):
        return jattn.attention(q, k, v, mask=masks.causal(), implementation=impl, **kw)

    f = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    q, k, v, *t = _args()
    _close(jax.jvp(f, (q, k, v), tuple(t[:3])), jax.jvp(_reference, (q, k, v), tuple(t[:3])))
    through = "grad of jvp (a loss through jvp), with and without jax.checkpoint"  # the fused path's one-pass split
    run = jax.jit(TRANSFORM_RUNS[through], static_argnums=0)
    _close(run(f, (q, k, v), tuple(t[:3])), run(_reference, (q, k, v), tuple(t[:3])))


def test_ring_jvp_and_hvp_with_sinks_softcap_and_segment_ids():
    """Forward mode of the ring with sinks (their tangent too), a soft-cap and packed documents."""
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    ids = np.repeat([[0, 1, 2], [0, 0, 1]], [5, 6, 5], axis=1)  # (B, T): documents across device boundaries
    keep = (ids[:, :, None] == ids[:, None, :])[:, None] & CAUSAL
    q, k, v, dq, dk, dv = _args()
    sinks, d_sinks = jnp.asarray([0.3, -0.5], jnp.float32), jnp.asarray([1.0, 2.0], jnp.float32)

    def ours(q, k, v, sinks):
        def local(q, k, v, ids, sinks):
            return jattn.ring_attention(
                q, k, v, axis_name="s", mask=masks.causal(), segment_ids=ids, sinks=sinks,
                score_mod=jattn.score_mods.softcap(2.0),
            )  # fmt: skip

        specs = (SEQ, SEQ, SEQ, PartitionSpec(None, "s"), PartitionSpec())
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=SEQ)(q, k, v, jnp.asarray(ids), sinks)

    def ref(q, k, v, sinks):
        return dense_jax(q, k, v, keep=keep, sinks=sinks, softcap=2.0)[0]  # sinks per head, as jattn broadcasts them

    up = lambda xs: tuple(x.astype(jnp.float64) for x in xs)  # noqa: E731
    args, tangents = (q, k, v, sinks), (dq, dk, dv, d_sinks)
    _close(jax.jvp(ours, args, tangents), jax.jvp(ref, up(args), up(tangents)))
