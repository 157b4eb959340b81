"""Sharded training on simulated devices: same losses as one device, sharded state, meshes, hosts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from tests import reference as ref
from train import config, loop, sharding

TOL = ref.tol(jnp.float32)  # float32: a sharded run sums the same numbers in another order

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
SHORT = dict(
    steps=STEPS,
    warmup_steps=5,
    log_every=1,
    eval_every=STEPS,
    checkpoint_every=10,
    batch_size=32,
    eval_batches=1,
    control=False,
)


def _cfg(workdir, path=config.DEFAULT_CONFIG, **mesh):
    overrides = {**SHORT, "workdir": str(workdir), **{f"mesh.{k}": v for k, v in mesh.items()}}
    return config.override(config.load(path), [f"--config.{k}={v}" for k, v in overrides.items()])


def _losses(workdir) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 20-step loss curve and summary on one device (the reference)."""
    workdir = tmp_path_factory.mktemp("single")
    summary = loop.train(_cfg(workdir), progress=False, pictures=False)
    assert summary["mesh"] == {"data": 1, "seq": 1, "model": 1}
    return _losses(workdir), summary


@pytest.mark.heavy
@pytest.mark.long
@pytest.mark.parametrize(
    "path, mesh",
    [
        (config.DEFAULT_CONFIG, dict(data=8)),
        (config.DEFAULT_CONFIG, dict(data=4, model=2)),
        (ROOT / "configs" / "ring.py", {}),  # data=2 x seq=4: ring attention inside the model
    ],
    ids=["data8", "data4-model2", "ring-data2-seq4"],
)
def test_sharded_training_repeats_the_single_device_losses(tmp_path, single, path, mesh):
    losses, summary = single
    got = loop.train(_cfg(tmp_path, path, **mesh), progress=False, pictures=False)
    assert np.prod(list(got["mesh"].values())) == 8
    np.testing.assert_allclose(_losses(tmp_path), losses, **TOL)
    for key in ("loss", "token_acc"):
        np.testing.assert_allclose(got["eval"][key], summary["eval"][key], **TOL)


def test_parameters_and_optimizer_state_are_sharded_over_the_model_axis(tmp_path):
    cfg = _cfg(tmp_path, data=4, model=2)
    exp, mesh = loop.build(cfg), sharding.make_mesh(cfg)
    state = sharding.place(loop._initial_state(exp), mesh)
    blocks = state["params"]["blocks"][0]
    adam = state["opt_state"][1][0]
    d = cfg.model.d_model
    for name, arr, spec in [
        ("wq kernel", blocks["mixer"]["wq"]["kernel"][...], PartitionSpec(None, "model")),
        ("wo kernel", blocks["mixer"]["wo"]["kernel"][...], PartitionSpec("model", None)),
        ("up bias", blocks["up"]["bias"][...], PartitionSpec("model")),
        ("adam mu of down", adam.mu["blocks"][0]["down"]["kernel"][...], PartitionSpec("model", None)),
        ("adam nu of wk", adam.nu["blocks"][0]["mixer"]["wk"]["kernel"][...], PartitionSpec(None, "model")),
        ("layer norm", blocks["ln1"]["scale"][...], PartitionSpec()),
    ]:
        assert arr.sharding.spec == spec, name
        if spec != PartitionSpec():  # each device holds half of the sharded axis
            axis = list(spec).index("model")
            assert arr.addressable_shards[0].data.shape[axis] == arr.shape[axis] // 2, name
    assert blocks["mixer"]["wq"]["kernel"][...].shape == (d, d)
    with jax.set_mesh(mesh):
        hlo = loop.make_train_chunk(exp).lower(state["params"], state["opt_state"], 0, 1).compile().as_text()
    assert "all-reduce" in hlo  # gradients of the data-parallel batch are summed across devices


@pytest.mark.heavy
@pytest.mark.long
def test_checkpoint_saved_on_one_mesh_resumes_on_another(tmp_path, single):
    """Stop at step 10 on data=4 x model=2; resume on data=2 x seq=2 x model=2; same curve as one device."""
    losses, _ = single
    first = loop.train(_cfg(tmp_path, data=4, model=2), progress=False, pictures=False, should_stop=lambda s: s >= 10)
    assert first["interrupted"] and first["step"] == 10
    second = loop.train(_cfg(tmp_path, data=2, seq=2, model=2), progress=False, pictures=False)
    assert not second["interrupted"] and second["mesh"] == {"data": 2, "seq": 2, "model": 2}
    np.testing.assert_allclose(_losses(tmp_path), losses, **TOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.long
def test_two_processes_over_loopback_repeat_the_single_device_losses(tmp_path, single):
    """jax.distributed over loopback: 2 processes x 2 CPU devices, mesh data=2 x model=2."""
    losses, _ = single
    args = [
        f"--config.{k}={v}" for k, v in {**SHORT, "workdir": str(tmp_path), "mesh.data": 2, "mesh.model": 2}.items()
    ]
    args += [
        f"--config.distributed.coordinator_address=127.0.0.1:{_free_port()}",
        "--config.distributed.num_processes=2",
    ]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "train", "--quiet", *args, f"--config.distributed.process_id={pid}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh"] == {"data": 2, "seq": 1, "model": 2}
    np.testing.assert_allclose(_losses(tmp_path), losses, **TOL)
