"""Meshes and shardings of the training program, on JAX's own SPMD machinery.

The mesh has three axes (``cfg.mesh``): ``data`` splits the batch, ``model`` splits attention
heads and the MLP's hidden features, and ``seq`` splits the sequence inside attention (ring
attention, :func:`jattn.sequence_parallel_attention`). Parameters and optimizer state are placed
with :class:`jax.sharding.NamedSharding` by the rules below; everything else follows from
``jit``'s sharding propagation. Multi-host runs start with :func:`init_distributed`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("data", "seq", "model")

# (module, parameter) -> how its axes split: attention projections and the MLP over "model".
# Optimizer moments have the same paths below their optimizer-state prefix.
RULES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("wq", "kernel"): (None, "model"),  # (d_model, N·D): query heads
    ("wk", "kernel"): (None, "model"),  # (d_model, K·D): kv heads
    ("wv", "kernel"): (None, "model"),
    ("wo", "kernel"): ("model", None),  # (N·D, d_model)
    ("up", "kernel"): (None, "model"),  # (d_model, hidden)
    ("up", "bias"): ("model",),
    ("down", "kernel"): ("model", None),  # (hidden, d_model)
}


def init_distributed(cfg: ml_collections.ConfigDict) -> None:
    """Joins a multi-process run when ``cfg.distributed`` or the environment names a coordinator.

    Config keys (each falls back to an environment variable): ``coordinator_address``
    (``JAX_COORDINATOR_ADDRESS``, e.g. ``10.0.0.1:1234``), ``num_processes``
    (``JAX_NUM_PROCESSES``) and ``process_id`` (``JAX_PROCESS_ID``). Must run before JAX
    computes anything; a no-op for a single process or when already initialised.
    """
    d = cfg.distributed
    address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    if not address or jax.distributed.is_initialized():
        return
    num = d.num_processes if d.num_processes > 0 else int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    pid = d.process_id if d.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "0"))
    jax.distributed.initialize(address, num_processes=num, process_id=pid)


def make_mesh(cfg: ml_collections.ConfigDict) -> Mesh:
    """The ``(data, seq, model)`` mesh of ``cfg.mesh`` on the first data·seq·model devices."""
    shape = tuple(int(cfg.mesh[a]) for a in AXES)
    need, have = int(np.prod(shape)), jax.device_count()
    if need > have:
        raise ValueError(f"config mesh {dict(zip(AXES, shape, strict=True))} needs {need} devices, {have} available")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices()[:need])


def spec_of(path: tuple, x: Any, mesh: Mesh) -> PartitionSpec:
    """The partition spec of the leaf at ``path`` by :data:`RULES` (replicated where none applies)."""
    names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
    names = [n for n in names if n not in ("value", "raw_value")]
    rule = RULES.get(tuple(names[-2:])) if len(names) >= 2 else None
    if rule is None or np.ndim(x) != len(rule):
        return PartitionSpec()
    for axis, size in zip(rule, np.shape(x), strict=True):
        if axis is not None and size % mesh.shape[axis]:
            return PartitionSpec()  # not divisible: keep it whole
    return PartitionSpec(*rule)


def shardings(tree: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` for every array leaf of ``tree`` (params or optimizer state)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, spec_of(p, x, mesh)), tree)


def place(tree: Any, mesh: Mesh) -> Any:
    """Copies host-identical ``tree`` onto ``mesh`` by :func:`shardings` (works across processes)."""

    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings(tree, mesh))


def batch_spec() -> PartitionSpec:
    """Batch-first arrays split over ``data``."""
    return PartitionSpec("data")
