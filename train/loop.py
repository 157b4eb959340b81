"""The training loop as a library: build, train (resumable), evaluate, and report.

The data stream depends only on the seed and the step (``fold_in(train_key, step)``), evaluation
uses its own key stream, and checkpoints hold parameters and optimizer state, so a resumed run
repeats bit for bit what an uninterrupted run computes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax import Array
from jax.experimental import multihost_utils
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from train import plots, sharding
from train.config import load as load_config
from train.config import validate
from train.model import Decoder
from train.tasks import Task

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Experiment:
    """What a config builds: the task, the model's structure and initial state, the optimizer."""

    cfg: ml_collections.ConfigDict
    task: Task
    graphdef: nnx.GraphDef
    init_params: nnx.State
    tx: optax.GradientTransformation

    @property
    def train_key(self) -> Array:
        return jax.random.fold_in(jax.random.key(self.cfg.seed), 0)

    @property
    def eval_key(self) -> Array:  # held out: the training stream never draws from it
        return jax.random.fold_in(jax.random.key(self.cfg.seed), 1)

    def model(self, params: nnx.State) -> Decoder:
        return nnx.merge(self.graphdef, params)


def workdir_of(cfg: ml_collections.ConfigDict) -> Path:
    return Path(cfg.workdir or Path("runs") / cfg.name)


def build(cfg: ml_collections.ConfigDict) -> Experiment:
    """Validates ``cfg`` (before any compilation) and builds the experiment."""
    task = validate(cfg)
    m = cfg.model
    model = Decoder(
        task.vocab_size,
        task.length,
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads or None,
        mixer=m.mixer,
        mlp_ratio=m.mlp_ratio,
        window=m.window,
        global_tokens=tuple(m.global_tokens),
        rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(cfg.seed), 2)),
    )
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.learning_rate * 0.01
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))
    return Experiment(cfg, task, graphdef, params, tx)


def _loss(exp: Experiment, params: nnx.State, batch) -> tuple[Array, tuple[Array, Array]]:
    logits = exp.model(params)(batch.inputs)  # (B, L, vocab)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    mask = batch.mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch.targets) | ~batch.mask
    return jnp.sum(ce * mask) / jnp.sum(mask), (
        jnp.sum((correct & batch.mask).astype(jnp.float32)) / jnp.sum(mask),
        correct,
    )


def _split_batch(batch):
    """Splits a batch over the mesh's ``data`` axis (a no-op outside a mesh)."""
    if "data" not in jax.sharding.get_abstract_mesh().axis_names:
        return batch
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding.batch_spec()), batch)


def make_train_chunk(exp: Experiment) -> Callable:
    """``(params, opt_state, start, n) -> (params, opt_state, losses (n,), accs (n,))``, jitted.

    Runs ``n`` steps in one ``lax.scan``; the data of step ``s`` is drawn from
    ``fold_in(train_key, s)``.
    """

    def chunk(params, opt_state, start, n):
        def step(carry, i):
            params, opt_state = carry
            batch = _split_batch(exp.task.batch(jax.random.fold_in(exp.train_key, start + i), exp.cfg.batch_size))
            (loss, (acc, _)), grads = jax.value_and_grad(lambda p: _loss(exp, p, batch), has_aux=True)(params)
            with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix float and int32
                updates, opt_state = exp.tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (loss, acc)

        (params, opt_state), (losses, accs) = jax.lax.scan(step, (params, opt_state), jnp.arange(n))
        return params, opt_state, losses, accs

    return jax.jit(chunk, static_argnums=3, donate_argnums=(0, 1))


def make_evaluate(exp: Experiment) -> Callable:
    """``params -> {loss, token_acc, seq_acc}`` on ``eval_batches`` held-out batches, jitted."""

    def evaluate(params):
        def one(i):
            batch = _split_batch(exp.task.batch(jax.random.fold_in(exp.eval_key, i), exp.cfg.batch_size))
            loss, (acc, correct) = _loss(exp, params, batch)
            return loss, acc, jnp.mean(jnp.all(correct, axis=-1).astype(jnp.float32))

        loss, acc, seq = jax.lax.map(one, jnp.arange(exp.cfg.eval_batches))
        return {"loss": jnp.mean(loss), "token_acc": jnp.mean(acc), "seq_acc": jnp.mean(seq)}

    return jax.jit(evaluate)


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the loop checks between jitted calls."""

    def __init__(self, should_stop: Callable[[int], bool] | None) -> None:
        self.flag, self.should_stop, self.old = False, should_stop, {}

    def __enter__(self) -> _Stop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def __call__(self, step: int) -> bool:
        return self.flag or (self.should_stop is not None and self.should_stop(step))

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def _agree(flag: bool) -> bool:
    """True when any process says so (a signal may reach only one host of a multi-host run)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _metrics_log(path: Path, start: int, *, write: bool = True) -> list[dict]:
    """Reads metrics.jsonl, dropping lines past the checkpoint we resume from."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    lines = [x for x in lines if x["step"] <= start]
    if write:
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=10),
        TextColumn("{task.completed:>5.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(compact=True),
        disable=not enabled,
        transient=False,
    )


def train(
    cfg: ml_collections.ConfigDict,
    *,
    progress: bool = True,
    should_stop: Callable[[int], bool] | None = None,
    pictures: bool = True,
) -> dict:
    """Trains (or resumes) the run of ``cfg`` in its run directory; returns the summary.

    The run directory holds ``config.json``, ``metrics.jsonl``, ``checkpoints/``, pictures and
    ``summary.json``. SIGINT/SIGTERM (or ``should_stop(step)`` returning True) saves a checkpoint
    and returns early with ``summary['interrupted'] = True``.
    """
    sharding.init_distributed(cfg)
    exp = build(cfg)
    mesh = sharding.make_mesh(cfg)
    main = jax.process_index() == 0  # the process that writes logs, summaries and pictures
    workdir = workdir_of(cfg).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if main:
        (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    with jax.set_mesh(mesh), ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
        state = sharding.place(_initial_state(exp), mesh)
        start = manager.latest_step() or 0
        if start:
            state = _load(manager, start, state)
        log = _metrics_log(workdir / "metrics.jsonl", start, write=main)
        chunk, evaluate = make_train_chunk(exp), make_evaluate(exp)
        params, opt_state = state["params"], state["opt_state"]
        tokens_per_step = cfg.batch_size * exp.task.length
        step, interrupted = start, False
        log_path = workdir / "metrics.jsonl" if main else os.devnull  # one process writes the log
        with _progress(progress and main) as bar, _Stop(should_stop) as stop, open(log_path, "a") as metrics:
            job = bar.add_task(f"{cfg.name}/{cfg.model.mixer}", total=cfg.steps, completed=start, stats="")
            while step < cfg.steps:
                n = min(cfg.log_every, cfg.steps - step)
                t0 = time.perf_counter()
                params, opt_state, losses, accs = chunk(params, opt_state, step, n)
                losses, accs = np.asarray(losses), np.asarray(accs)  # the one host sync per call
                step += n
                row = {"step": step, "loss": float(losses.mean()), "acc": float(accs.mean())}
                row["tokens_per_s"] = tokens_per_step * n / (time.perf_counter() - t0)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    row["eval"] = {k: float(v) for k, v in evaluate(params).items()}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                log.append(row)
                stats = f"loss {row['loss']:.3f} acc {row['acc']:.3f} {row['tokens_per_s'] / 1e3:.0f}k tok/s"
                bar.update(job, completed=step, stats=stats)
                interrupted = _agree(stop(step)) and step < cfg.steps
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or interrupted:
                    manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
                if interrupted:
                    break
        manager.wait_until_finished()
        final = {k: float(v) for k, v in evaluate(params).items()}
        if jax.process_count() > 1:  # the pictures below run on one process: gather the parameters
            params = multihost_utils.process_allgather(params, tiled=True)
    summary = {
        "name": cfg.name,
        "workdir": str(workdir),
        "task": exp.task.name,
        "mixer": cfg.model.mixer,
        "step": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "chance": exp.task.chance,
        "eval": final,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
    }
    if not main:
        return summary
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if pictures and not interrupted:
        plots.curves(
            log,
            workdir / "curves.png",
            chance=exp.task.chance,
            title=f"{cfg.name}: {exp.task.name}, mixer={cfg.model.mixer}",
        )
        if cfg.model.mixer == "attention":  # linear attention forms no weights to draw
            plots.attention_maps(exp, params, workdir / "attention.png")
    return summary


def restore(workdir: str | Path) -> tuple[Experiment, nnx.State, int]:
    """Loads a run directory's config and latest checkpoint: ``(experiment, params, step)``."""
    workdir = Path(workdir)
    saved = json.loads((workdir / "config.json").read_text())
    defaults = load_config()  # keys added since the run was made (e.g. mesh) take their defaults
    cfg = ml_collections.ConfigDict({**{k: defaults[k] for k in defaults if k not in saved}, **saved})
    exp = build(cfg)
    with ocp.CheckpointManager(workdir.resolve() / "checkpoints") as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir / 'checkpoints'}")
        state = _load(manager, step, _initial_state(exp))
    return exp, state["params"], step


def _initial_state(exp: Experiment) -> dict:
    return {"params": exp.init_params, "opt_state": exp.tx.init(exp.init_params)}


def _load(manager: ocp.CheckpointManager, step: int, like: dict) -> dict:
    """Restores checkpoint ``step`` into the structure of ``like`` (params + optimizer state)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def verdict(summary: dict, control: dict | None = None) -> str:
    """One line: held-out accuracy against chance (and the control's, when it ran)."""
    e = summary["eval"]
    line = (
        f"{summary['task']}: {summary['mixer']} reaches {e['token_acc']:.1%} held-out token accuracy "
        f"({e['seq_acc']:.1%} of sequences) after {summary['step']} steps; chance is {summary['chance']:.1%}"
    )
    if control is not None:
        c = control["eval"]
        line += f"; the no-attention control reaches {c['token_acc']:.1%} ({c['seq_acc']:.1%} of sequences)"
    return line
