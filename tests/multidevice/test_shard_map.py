"""``jattn.attention`` inside a user's ``shard_map`` (heads and batch over a 2 x 2 mesh, ``check_vma`` on).

Each device runs the core on its own heads and examples; values and gradients must equal the call
on the whole arrays and the float64 reference, on the dense and the blockwise paths.
"""

from __future__ import annotations

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import jattn
from jattn import masks
from tests import reference as ref

B, N, D, E = 2, 4, 5, 3


def _case(name: str, T: int):
    """``(mask(local kv lengths), block_size, explicit mask (B, 1, T, T) of the lengths)`` for a case."""
    lengths = np.array([T - 3, 2])
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    pad = s < lengths[:, None, None, None]
    return {
        "none": (lambda n: None, (4, 3), np.ones((T, T), bool)),
        "causal": (lambda n: masks.causal(), (4, 3), s <= t),
        "causal-split": (lambda n: masks.causal(), 128, s <= t),  # diagonal tiles in two parts
        "padding&causal": (lambda n: masks.padding(kv_lengths=n) & masks.causal(), (4, 3), pad & (s <= t)),
    }[name], lengths


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
@pytest.mark.parametrize(
    "name, T, kv_heads",
    [("none", 13, N), ("causal", 13, N), ("causal", 13, 1), ("causal-split", 300, N), ("padding&causal", 13, N)],
)
def test_attention_inside_shard_map_equals_the_whole_call_and_the_reference(impl, name, T, kv_heads):
    """One kv head (``kv_heads=1``) is shared by the head shards, the sinks by the batch shards: their
    gradients are summed over them."""
    (make_mask, block, dense), lengths = _case(name, T)
    mesh = jax.make_mesh((2, 2), ("b", "h"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    q, k = (
        jnp.asarray(rng.normal(size=(B, N, T, D)), jnp.float32),
        jnp.asarray(rng.normal(size=(B, kv_heads, T, D)), jnp.float32),
    )
    v, g = (
        jnp.asarray(rng.normal(size=(B, kv_heads, T, E)), jnp.float32),
        jnp.asarray(rng.normal(size=(B, N, T, E)), jnp.float32),
    )
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    n = jnp.asarray(lengths, jnp.int32)
    kw = {"block_size": block} if impl == "blockwise" else {}

    def local(q, k, v, sinks, n):
        return jattn.attention(q, k, v, mask=make_mask(n), sinks=sinks, implementation=impl, **kw)

    heads, rows = PartitionSpec("b", "h"), PartitionSpec("b")
    kv = heads if kv_heads == N else rows
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(heads, kv, kv, PartitionSpec("h"), rows), out_specs=heads)

    def loss(q, k, v, sinks):
        return jnp.sum(sharded(q, k, v, sinks, n) * g)

    out = jax.jit(sharded)(q, k, v, sinks, n)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    whole = local(q, k, v, sinks, n)
    explicit = np.broadcast_to(dense, (B, 1, T, T))
    np.testing.assert_allclose(out, whole, **ref.tol(jnp.float32))
    want = ref.attention(q, k, v, explicit, sinks=sinks)[0]
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    dq, dk, dv, _, dsinks = ref.attention_grads(q, k, v, g, explicit, sinks=sinks)
    for got, w in zip(grads, (dq, dk, dv, dsinks), strict=True):
        ref.assert_grad_close(got, w, jnp.float32)


@pytest.mark.parametrize("name, kv_heads", [("none", N), ("causal", 1)])
def test_the_fused_cpu_forward_inside_shard_map_keeps_values_and_gradients(name, kv_heads):
    """Blockwise on automatic tiles without sinks: on a CPU the fused kernels serve, its forward is the fused kernel
    (a custom call, in the jaxpr), whose results must vary over the mesh axes as q does, or the
    backward sums the gradients of the wrong shards."""
    T = 300
    (make_mask, _, dense), _ = _case(name, T)
    mesh = jax.make_mesh((2, 2), ("b", "h"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, N, T, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, kv_heads, T, d)), jnp.float32) for d in (D, E))
    g = jnp.asarray(rng.normal(size=(B, N, T, E)), jnp.float32)

    def local(q, k, v):
        return jattn.attention(q, k, v, mask=make_mask(None), implementation="blockwise")

    heads = PartitionSpec("b", "h")
    kv = heads if kv_heads == N else PartitionSpec("b")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(heads, kv, kv), out_specs=heads)
    if " avx512f" in pathlib.Path("/proc/cpuinfo").read_text() and shutil.which("g++"):
        assert "jattn_fused_forward" in str(jax.make_jaxpr(sharded)(q, k, v))
    out = jax.jit(sharded)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v) * g), argnums=(0, 1, 2)))(q, k, v)
    explicit = np.broadcast_to(dense, (B, 1, T, T))
    np.testing.assert_allclose(ref.f64(out), ref.attention(q, k, v, explicit)[0], **ref.tol(jnp.float32))
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, explicit)[:3], strict=True):
        ref.assert_grad_close(got, w, jnp.float32)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_the_benchmarks_sharded_candidate_equals_the_single_device_call(mode):
    """``python -m bench --cpu-devices n`` times ``jattn-sharded``: heads over the devices, same numbers."""
    from bench import suite

    case = suite.Case(B=2, N=8, T=24, D=8, mask="causal", mode=mode)
    one, sharded = (jax.tree.map(np.asarray, suite.candidate(n, case)()) for n in ("jattn", "jattn-sharded"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **ref.tol(jnp.float32)), one, sharded)


def test_inside_shard_map_a_program_counts_its_share_of_the_cores(monkeypatch):
    """Per-device programs run at once on one thread pool: each is tiled for cores / shards threads."""
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "cores", lambda: 4)
    seen = []

    def local(x):
        seen.append(platform_facts.cpu_threads())
        return x

    x = jnp.ones((4, 4))
    for shape in ((2, 1), (2, 2), (4, 2)):
        mesh = jax.make_mesh(
            shape, ("b", "h"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[: shape[0] * shape[1]]
        )
        jax.jit(jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("b", "h"), out_specs=PartitionSpec("b", "h")))(x)
    assert seen == [2, 1, 1] and platform_facts.cpu_threads() == 4


def test_the_fused_kernels_results_vary_as_the_mask_arrays_do():
    """q, k, v replicated and the padding lengths sharded (each device masks with its own): the fused kernels'
    results differ by device, so they must be typed varying over that axis, and the gradient of the replicated
    q, k, v sums both devices' parts (the reference: the two masks' gradients added)."""
    T = 300
    mesh = jax.make_mesh((2,), ("b",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    rng = np.random.default_rng(2)
    q, k, v, g = (jnp.asarray(rng.normal(size=(1, N, T, d)), jnp.float32) for d in (D, D, E, E))
    n = jnp.asarray([T - 40, 77], jnp.int32)

    def local(q, k, v, n):
        mask = masks.padding(kv_lengths=n) & masks.causal()
        return jattn.attention(q, k, v, mask=mask, implementation="blockwise")

    replicated, rows = PartitionSpec(), PartitionSpec("b")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(replicated,) * 3 + (rows,), out_specs=rows)
    assert "jattn_fused_forward" in str(jax.make_jaxpr(sharded)(q, k, v, n))
    out = jax.jit(sharded)(q, k, v, n)  # (2, N, T, E): each device's row
    loss = lambda q, k, v: jnp.sum(sharded(q, k, v, n) * jnp.concatenate([g, g]))  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    explicit = [((s < length) & (s <= t))[None, None] for length in np.asarray(n)]
    for i, keep in enumerate(explicit):
        np.testing.assert_allclose(ref.f64(out[i : i + 1]), ref.attention(q, k, v, keep)[0], **ref.tol(jnp.float32))
    parts = [ref.attention_grads(q, k, v, g, keep)[:3] for keep in explicit]
    for got, a, b in zip(grads, *parts, strict=True):
        ref.assert_grad_close(got, a + b, jnp.float32)
