"""Run directories that no fault corrupts or silently changes.

A run directory (``runs/<name>``, or ``cfg.workdir`` when set) holds ``config.json``,
``metrics.jsonl``, ``checkpoints/``, pictures and ``summary.json``. Before a run writes anything,
:func:`plan` decides what to do with the directory it names:

* absent, or holding no files: a fresh run;
* a run directory (it has ``config.json``): resumed when the saved config matches the new one on
  every key that shapes the run, refused otherwise with a one-line :class:`RunError` naming each
  differing key with its old and new value; with ``resume=False`` it is moved aside to
  ``<dir>.old-<n>`` (:func:`move_aside`) and the run starts afresh;
* anything else (files, but no ``config.json``): refused.

A resumed run that has already trained its ``steps`` is complete (:func:`completed`): the
program trains nothing and says so.

Only the keys in :data:`RESUMABLE_KEYS` may differ on resume: where the run lives, how long it
runs, how often it logs, evaluates and checkpoints, whether the control runs after it, and the
devices it runs on. Everything else (the seed, the task, the model, the optimiser, the batch size)
decides the numbers training computes, so it must match.

``metrics.jsonl`` is appended one whole line per write, flushed and synced (:class:`MetricsLog`);
rewrites (dropping steps past the checkpoint a run resumes from) go through a temporary file and
``os.replace``, as do ``config.json`` and ``summary.json``. Every file of a run gets the same
mode, ``0o666`` less the umask.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from pathlib import Path
from typing import Any

import ml_collections

from train import config

RESUMABLE_KEYS = frozenset(
    {
        "name",
        "workdir",
        "resume",
        "steps",  # a longer run stretches the cosine schedule to the new total from the resumed step on
        "log_every",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "control",
        "control_model",  # the control is its own run directory, checked on its own
        "mesh",  # checkpoints restore onto any mesh
        "distributed",
    }
)


# The keys of summary.json that a complete run's verdict reads (train.loop.verdict, train.__main__)
SUMMARY_KEYS = frozenset({"name", "task", "mixer", "positions", "step", "interrupted", "chance", "eval", "lengths"})


class RunError(Exception):
    """A fault of a run directory that the user can fix; the message is one line."""


class MetricsError(RunError):
    """A line of ``metrics.jsonl`` that is not a metrics row."""


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts such as ``--examples``: a positive int, or argparse's error naming the flag."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {n}")
    return n


def workdir_of(cfg: ml_collections.ConfigDict) -> Path:
    """The run directory of ``cfg``: ``cfg.workdir`` when set, else ``runs/<name>``."""
    return Path(cfg.workdir or Path("runs") / cfg.name)


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a synced temporary file and ``os.replace``.

    The file gets the mode every other file of the run gets (``0o666`` less the umask), not
    ``tempfile.mkstemp``'s ``0o600``.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_config(workdir: str | Path) -> ml_collections.ConfigDict:
    """The config saved in a run directory; keys added since it was made take their defaults."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise RunError(f"{workdir} is not a run directory (no config.json)")
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(saved, dict):
        raise RunError(f"{path}: not a config (a JSON object)")
    defaults = config.load()  # e.g. mesh and resume, for runs made before those keys existed
    merged = {**{k: defaults[k] for k in defaults if k not in saved}, **saved}
    for key in ("model", "mesh", "distributed"):  # groups with fixed keys: e.g. model.positions
        if isinstance(merged[key], dict):
            merged[key] = {**defaults[key].to_dict(), **merged[key]}
    return ml_collections.ConfigDict(merged)


def _flat(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """``{"model.d_model": 64, ...}`` with JSON values (tuples become lists)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}{key}.", value)
        else:
            out[prefix[:-1]] = node

    walk("", json.loads(cfg.to_json_best_effort()))
    return out


def differences(saved: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> list[str]:
    """``"key old -> new"`` for every key outside :data:`RESUMABLE_KEYS` whose values differ."""
    old, cur = _flat(saved), _flat(new)
    lines = []
    for key in sorted(old.keys() | cur.keys()):
        if key.split(".")[0] in RESUMABLE_KEYS or old.get(key, "(absent)") == cur.get(key, "(absent)"):
            continue
        lines.append(f"{key} {old.get(key, '(absent)')!r} -> {cur.get(key, '(absent)')!r}")
    return lines


def _has_files(path: Path) -> bool:
    return any(p.is_file() or p.is_symlink() for p in path.rglob("*"))


def plan(workdir: Path, cfg: ml_collections.ConfigDict) -> str:
    """What a run of ``cfg`` does with ``workdir``: ``"fresh"``, ``"resume"`` or ``"move_aside"``.

    Reads only; raises :class:`RunError` when the directory holds another run (and
    ``cfg.resume`` is True) or is not a run directory.
    """
    if workdir.exists() and not workdir.is_dir():
        raise RunError(f"run directory {workdir} is a file")
    if not workdir.exists():
        return "fresh"
    if not (workdir / "config.json").exists():
        if _has_files(workdir):
            raise RunError(f"{workdir} holds files but no config.json: not a run directory; choose another name")
        return "fresh"
    if not cfg.resume:
        return "move_aside"
    saved = read_config(workdir)
    diff = differences(saved, cfg)
    if diff:
        keep = ""  # a warm-up scaled to a shorter run (config.scale_warmup) is the one usually differing alone
        if len(diff) == 1 and diff[0].startswith("warmup_steps "):
            keep = f", pass --config.warmup_steps={saved.warmup_steps} to continue it"
        raise RunError(
            f"{workdir} holds another run ({'; '.join(diff)}): choose another --config.name{keep}, "
            "or pass --config.resume=False to move the old run aside and start afresh"
        )
    return "resume"


def completed(workdir: Path, cfg: ml_collections.ConfigDict) -> dict | None:
    """The saved summary of the run in ``workdir`` when ``cfg`` would train nothing more there, else None.

    Complete means: the directory holds this run (:func:`plan` says ``"resume"``; it raises
    :class:`RunError` for another run, as training would), its ``summary.json`` says it finished
    (not interrupted) at a step at or past ``cfg.steps`` after evaluating ``cfg.eval_batches``
    batches, that step is the last line of ``metrics.jsonl`` (nothing ran since), and its
    checkpoint directory is there (its contents are not read: a damaged one shows when the run is
    continued or evaluated). Reads only.
    """
    if not (workdir / "summary.json").is_file() or plan(workdir, cfg) != "resume":
        return None
    try:
        summary = json.loads((workdir / "summary.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # training again rewrites it
    rows = MetricsLog(workdir / "metrics.jsonl").read()
    if not isinstance(summary, dict) or not summary.keys() >= SUMMARY_KEYS or summary["interrupted"] is not False:
        return None  # also a summary of an older version, without keys the verdict reads
    step = summary["step"]
    finished = isinstance(step, int) and step >= cfg.steps and bool(rows) and rows[-1]["step"] == step
    saved = finished and (workdir / "checkpoints" / str(step)).is_dir()  # orbax's directory of that step
    return summary if saved and read_config(workdir).eval_batches == cfg.eval_batches else None


def move_aside(workdir: Path) -> Path:
    """Renames ``workdir`` to the first free ``<workdir>.old-<n>``; returns the new path."""
    n = 1
    while (aside := workdir.with_name(f"{workdir.name}.old-{n}")).exists():
        n += 1
    workdir.rename(aside)
    return aside


def write_config(workdir: Path, cfg: ml_collections.ConfigDict) -> None:
    """Writes ``config.json`` (atomically)."""
    write_atomic(workdir / "config.json", cfg.to_json_best_effort(indent=2) + "\n")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, each with an integer ``step``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[dict]:
        """All rows; a damaged line raises :class:`MetricsError` naming the file and line."""
        if not self.path.exists():
            return []
        rows = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MetricsError(f"{self.path} line {number} is damaged: {e.msg} (column {e.colno})") from None
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise MetricsError(f"{self.path} line {number} is damaged: not a metrics row with an integer step")
            rows.append(row)
        return rows

    def keep_until(self, step: int, rows: list[dict]) -> list[dict]:
        """Keeps the rows up to ``step`` (rewriting the file atomically when some go)."""
        kept = [r for r in rows if r["step"] <= step]
        if len(kept) < len(rows):
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def append(self, row: dict) -> None:
        """Appends ``row`` as one line in one write, flushed and synced."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
