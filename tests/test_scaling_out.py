"""The single-device side of scaling out: layouts, config checks, the fallbacks without a mesh.

The multi-device tests (ring attention, sharded training, two processes) run in their own
session on 8 simulated devices: ``pytest tests/multidevice``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.nnx
from jattn import masks
from tests import reference as ref
from train import config, sharding


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zigzag_gives_device_r_chunks_r_and_its_mirror(p):
    n = 2 * p * 3
    x = jnp.arange(2 * n * 5).reshape(2, n, 5)
    z = np.asarray(jattn.zigzag(x, p, axis=1))
    chunks = np.split(np.asarray(x), 2 * p, axis=1)
    for r, local in enumerate(np.split(z, p, axis=1)):
        np.testing.assert_array_equal(local, np.concatenate([chunks[r], chunks[2 * p - 1 - r]], axis=1))
    np.testing.assert_array_equal(jattn.unzigzag(z, p, axis=1), x)
    with pytest.raises(ValueError, match="divisible by 2 \\* num_devices"):
        jattn.zigzag(x[:, :-1], p, axis=1)


def test_sequence_axis_without_a_mesh_is_the_plain_core():
    """A model built for sequence parallelism runs unchanged on one device (eval, sampling)."""
    plain = jattn.nnx.SelfAttention(12, num_heads=3, rngs=nnx.Rngs(0))
    ring = jattn.nnx.SelfAttention(12, num_heads=3, sequence_axis="seq", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 12)), jnp.float32)
    np.testing.assert_array_equal(ring(x, masks.causal()), plain(x, masks.causal()))


def test_ring_attention_outside_shard_map_is_an_error():
    x = jnp.ones((1, 4, 3), jnp.float32)
    with pytest.raises(NameError, match="unbound axis name"):
        jattn.ring_attention(x, x, x, axis_name="seq")


def test_sequence_parallel_attention_on_a_one_device_mesh_equals_the_reference():
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 9, d)), jnp.float32) for d in (5, 5, 7))
    out = jax.jit(
        lambda q, k, v: jattn.sequence_parallel_attention(q, k, v, axis_name="seq", mesh=mesh, mask=masks.causal())
    )
    want, _, _ = ref.attention(q, k, v, mask=np.tril(np.ones((9, 9), bool)))
    np.testing.assert_allclose(out(q, k, v), want, **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mesh.data", 0, "'mesh.data' must be a positive int"),
        ("mesh.seq", -2, "'mesh.seq' must be a positive int"),
        ("mesh.data", 5, "'batch_size'=64 must be a multiple of 'mesh.data'=5"),
    ],
)
def test_bad_mesh_config_is_a_config_error(key, value, message):
    cfg = config.override(
        config.load(), [f"--config.{key}={value!r}" if isinstance(value, str) else f"--config.{key}={value}"]
    )
    with pytest.raises(config.ConfigError, match=message):
        config.validate(cfg)


def test_a_mesh_larger_than_the_machine_names_the_devices():
    cfg = config.override(config.load(), [f"--config.mesh.model={jax.device_count() + 1}"])
    with pytest.raises(ValueError, match=f"needs {jax.device_count() + 1} devices, {jax.device_count()} available"):
        sharding.make_mesh(cfg)
