"""The training loop as a library: build, train (resumable), evaluate, and report.

The data stream depends only on the seed and the step (``fold_in(train_key, step)``), evaluation
uses its own key stream, and checkpoints hold parameters and optimizer state, so a resumed run
repeats bit for bit what an uninterrupted run computes.
"""

from __future__ import annotations

import dataclasses
import json
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
from flax import nnx
from jax import Array
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from train import plots, rundir, sharding
from train.checkpoints import CheckpointError, Checkpoints
from train.config import ConfigError, check_backend, validate
from train.model import Decoder
from train.rundir import workdir_of
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


def build(cfg: ml_collections.ConfigDict) -> Experiment:
    """Validates ``cfg`` (before any compilation) and builds the experiment."""
    task = validate(cfg)
    m = cfg.model
    model = Decoder(
        task.vocab_size,
        max([task.length, *(t.length for t in longer_tasks(cfg, task))]),
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads or None,
        mixer=m.mixer,
        positions=m.positions,
        mlp_ratio=m.mlp_ratio,
        window=m.window,
        global_tokens=tuple(m.global_tokens),
        implementation=m.implementation or None,
        block_size=m.block_size or None,
        short_conv=m.short_conv,
        rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(cfg.seed), 2)),
    )
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.learning_rate * 0.01
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))
    return Experiment(cfg, task, graphdef, params, tx)


def longer_tasks(cfg: ml_collections.ConfigDict, task: Task) -> list[Task]:
    """The task scaled by each factor of ``cfg.extrapolate`` (evaluated after training)."""
    return [task.scaled(f) for f in cfg.extrapolate]


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


def make_evaluate(exp: Experiment, task: Task | None = None) -> Callable:
    """``params -> {loss, token_acc, seq_acc}`` on ``eval_batches`` held-out batches, jitted.

    ``task`` (default ``exp.task``) may be a longer version of the task (:meth:`Task.scaled`).
    """
    task = exp.task if task is None else task

    def evaluate(params):
        def one(i):
            batch = _split_batch(task.batch(jax.random.fold_in(exp.eval_key, i), exp.cfg.batch_size))
            loss, (acc, correct) = _loss(exp, params, batch)
            return loss, acc, jnp.mean(jnp.all(correct, axis=-1).astype(jnp.float32))

        loss, acc, seq = jax.lax.map(one, jnp.arange(exp.cfg.eval_batches))
        return {"loss": jnp.mean(loss), "token_acc": jnp.mean(acc), "seq_acc": jnp.mean(seq)}

    return jax.jit(evaluate)


class StopOnSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks between jitted calls."""

    def __init__(self, should_stop: Callable[[int], bool] | None) -> None:
        self.flag, self.should_stop, self.old = False, should_stop, {}

    def __enter__(self) -> StopOnSignal:
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


def _barrier(name: str) -> None:
    """All processes meet here (a no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class _StatsColumn(ProgressColumn):
    """The loss/accuracy text: the column that gives way (with an ellipsis) on a narrow terminal."""

    def render(self, task) -> Text:
        return Text(task.fields.get("stats", ""), no_wrap=True, overflow="ellipsis")


def progress_bar(enabled: bool = True, *, console: Console | None = None) -> Progress:
    """The training progress bar: name, bar, steps, elapsed time, eta, then the latest stats.

    Every column but the stats keeps its width, so a narrow terminal (80 columns) shortens the
    stats, never the times.
    """
    fixed = {"table_column": Column(no_wrap=True)}
    return Progress(
        TextColumn("[bold]{task.description}", **fixed),
        BarColumn(bar_width=10, **fixed),
        TextColumn("{task.completed:>5.0f}/{task.total:.0f}", **fixed),
        TimeElapsedColumn(**fixed),
        TextColumn("eta", **fixed),
        TimeRemainingColumn(compact=True, **fixed),
        _StatsColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def _make_mesh(cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    try:
        return sharding.make_mesh(cfg)
    except ValueError as e:  # more devices than there are
        raise ConfigError(str(e)) from None


def _open_run(cfg: ml_collections.ConfigDict, workdir: Path, main: bool) -> Path | None:
    """Checks the run directory (and moves an old run aside when asked); returns where it went."""
    action = rundir.plan(workdir, cfg)
    _barrier("jattn-run-planned")
    moved = rundir.move_aside(workdir) if action == "move_aside" and main else None
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
    _barrier("jattn-run-opened")
    return moved


def train(
    cfg: ml_collections.ConfigDict,
    *,
    progress: bool = True,
    should_stop: Callable[[int], bool] | None = None,
    pictures: bool = True,
) -> dict:
    """Trains (or resumes) the run of ``cfg`` in its run directory; returns the summary.

    The run directory holds ``config.json``, ``metrics.jsonl``, ``checkpoints/``, pictures and
    ``summary.json``; :mod:`train.rundir` says when an existing one is resumed, refused or moved
    aside (``summary['moved_aside']``), and ``config.json`` is written only once all checks have
    passed. SIGINT/SIGTERM (or ``should_stop(step)`` returning True) saves a checkpoint and
    returns early with ``summary['interrupted'] = True``. A run that is already complete
    (:func:`train.rundir.completed`) is neither built nor trained: its saved summary comes back
    with ``summary['already_complete'] = True`` and nothing in the directory changes.

    Raises :class:`~train.config.ConfigError` for a config that cannot run and
    :class:`~train.rundir.RunError` (a :class:`~train.checkpoints.CheckpointError` for
    checkpoints) for a run directory that cannot be used; both carry a one-line message.
    """
    sharding.init_distributed(cfg)
    check_backend(cfg, jax.default_backend())  # the backend starts here, after joining
    validate(cfg)  # before the run directory is read (build() validates again: a few ms)
    workdir = workdir_of(cfg).resolve()
    done = rundir.completed(workdir, cfg)
    if not _agree(done is None) and done is not None:  # complete on every process: nothing to build or train
        return {**done, "workdir": str(workdir), "moved_aside": None, "already_complete": True}
    exp = build(cfg)
    mesh = _make_mesh(cfg)
    main = jax.process_index() == 0  # the process that writes logs, summaries and pictures
    moved = _open_run(cfg, workdir, main)
    metrics = rundir.MetricsLog(workdir / "metrics.jsonl")
    rows = metrics.read()
    with jax.set_mesh(mesh), Checkpoints(workdir / "checkpoints", write=True) as ckpt:
        initial = sharding.place(_initial_state(exp), mesh)
        start, state = ckpt.restore_latest(initial, quarantine=workdir / "checkpoints.damaged" if main else None)
        state = initial if state is None else state
        log = metrics.keep_until(start, rows) if main else []
        if main:
            rundir.write_config(workdir, cfg)  # every check passed: the run starts
        chunk, evaluate = make_train_chunk(exp), make_evaluate(exp)
        params, opt_state = state["params"], state["opt_state"]
        tokens_per_step = cfg.batch_size * exp.task.length
        step, interrupted = start, False
        with progress_bar(progress and main) as bar, StopOnSignal(should_stop) as stop:
            job = bar.add_task(f"{cfg.name}/{cfg.model.mixer}", total=cfg.steps, completed=start, stats="")
            while step < cfg.steps:
                n = min(cfg.log_every - step % cfg.log_every, cfg.steps - step)  # chunks end on multiples
                t0 = time.perf_counter()
                params, opt_state, losses, accs = chunk(params, opt_state, step, n)
                losses, accs = np.asarray(losses), np.asarray(accs)  # the one host sync per call
                step += n
                row = {"step": step, "loss": float(losses.mean()), "acc": float(accs.mean())}
                row["tokens_per_s"] = tokens_per_step * n / (time.perf_counter() - t0)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    row["eval"] = {k: float(v) for k, v in evaluate(params).items()}
                if main:  # one process writes the log
                    metrics.append(row)
                    log.append(row)
                stats = f"loss {row['loss']:.3f} acc {row['acc']:.3f} {row['tokens_per_s'] / 1e3:.0f}k tok/s"
                bar.update(job, completed=step, stats=stats)
                interrupted = _agree(stop(step)) and step < cfg.steps
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or interrupted:
                    ckpt.save(step, {"params": params, "opt_state": opt_state})
                if interrupted:
                    break
        ckpt.wait()
        final = {k: float(v) for k, v in evaluate(params).items()}
        lengths = [{"length": exp.task.length, **final}] if cfg.extrapolate else []
        for task in longer_tasks(cfg, exp.task):
            lengths.append(
                {"length": task.length, **{k: float(v) for k, v in make_evaluate(exp, task)(params).items()}}
            )
        if jax.process_count() > 1:  # the pictures below run on one process: gather the parameters
            params = multihost_utils.process_allgather(params, tiled=True)
    summary = {
        "name": cfg.name,
        "workdir": str(workdir),
        "task": exp.task.name,
        "mixer": cfg.model.mixer,
        "positions": cfg.model.positions,
        "step": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "chance": exp.task.chance,
        "eval": final,
        "lengths": lengths,  # held-out evaluation at the training length and longer (cfg.extrapolate)
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "moved_aside": str(moved) if moved else None,
    }
    if not main:
        return summary
    rundir.write_atomic(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if pictures and not interrupted:
        label = describe(summary)
        plots.curves({label: log}, workdir / "curves.png", chance=exp.task.chance, title=cfg.name)
        if lengths:
            plots.lengths({label: lengths}, workdir / "lengths.png", chance=exp.task.chance, title=cfg.name)
        if cfg.model.mixer == "attention":  # linear attention forms no weights to draw
            plots.attention_maps(exp, params, workdir / "attention.png")
    return summary


def describe(summary: dict) -> str:
    """The model of a run as its config keys, e.g. ``"mixer=attention, positions=learned"``."""
    return f"mixer={summary['mixer']}, positions={summary['positions']}"


def compare(summary: dict, control: dict) -> Path:
    """Draws a run and its control on the same axes into the run's ``curves.png`` (and ``lengths.png``)."""
    runs = {describe(s): s for s in (summary, control)}
    logs = {k: rundir.MetricsLog(Path(s["workdir"]) / "metrics.jsonl").read() for k, s in runs.items()}
    workdir, title = Path(summary["workdir"]), summary["name"]
    plots.curves(logs, workdir / "curves.png", chance=summary["chance"], title=title)
    if summary["lengths"]:
        lengths = {k: s["lengths"] for k, s in runs.items()}
        plots.lengths(lengths, workdir / "lengths.png", chance=summary["chance"], title=title)
    return workdir / "curves.png"


def restore(workdir: str | Path) -> tuple[Experiment, nnx.State, int]:
    """Loads a run directory's config and newest readable checkpoint: ``(experiment, params, step)``.

    Raises :class:`~train.rundir.RunError` with a one-line message when the directory is not a
    run or has no readable checkpoint (damaged ones are skipped with a warning).
    """
    workdir = Path(workdir)
    exp = build(rundir.read_config(workdir))
    with Checkpoints(workdir.resolve() / "checkpoints", write=False) as ckpt:
        step, state = ckpt.restore_latest(_initial_state(exp))
    if state is None:
        raise CheckpointError(f"no checkpoint in {workdir / 'checkpoints'}")
    return exp, state["params"], step


def _initial_state(exp: Experiment) -> dict:
    return {"params": exp.init_params, "opt_state": exp.tx.init(exp.init_params)}


def verdict(summary: dict, control: dict | None = None) -> str:
    """One line: held-out accuracy against chance (and the control's, when it ran)."""
    e = summary["eval"]
    line = (
        f"{summary['task']}: {describe(summary)} reaches {e['token_acc']:.1%} held-out token accuracy "
        f"({e['seq_acc']:.1%} of sequences) after {summary['step']} steps; chance is {summary['chance']:.1%}"
    )
    if control is not None:
        c = control["eval"]
        line += f"; the control ({describe(control)}) reaches {c['token_acc']:.1%} ({c['seq_acc']:.1%} of sequences)"
    for s in (summary, control) if control is not None else (summary,):
        if s["lengths"]:
            accs = ", ".join(f"{r['token_acc']:.1%} at {r['length']}" for r in s["lengths"])
            line += f"\n  {describe(s)}: held-out token accuracy by length: {accs}"
    return line
