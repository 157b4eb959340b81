"""Config files (ml_collections, ``get_config()``), command-line overrides, and validation.

Overrides use the ``ml_collections.config_flags`` syntax (``--config.model.d_model=64``); a bad
key or value stops the program before anything is compiled, with the key and value named.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any

import ml_collections

from train.model import IMPLEMENTATIONS, MIXERS
from train.sharding import AXES
from train.tasks import MQAR, TASKS, Task

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.py"


class ConfigError(ValueError):
    """A config key with a value the program cannot run with."""


def load(path: str | Path = DEFAULT_CONFIG) -> ml_collections.ConfigDict:
    """Runs ``get_config()`` of a config file; the result is locked (no new keys)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    root = str(path.resolve().parent.parent)  # so that a config can `from configs import default`
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_jattn_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.lock()
    return cfg


def _parse(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def override(cfg: ml_collections.ConfigDict, args: list[str]) -> ml_collections.ConfigDict:
    """Applies ``--config.a.b=value`` arguments (type-checked against the existing value)."""
    for arg in args:
        if not arg.startswith("--config.") or "=" not in arg:
            raise ConfigError(f"expected --config.KEY=VALUE, got {arg!r}")
        key, text = arg[len("--config.") :].split("=", 1)
        *parents, leaf = key.split(".")
        node = cfg
        for i, part in enumerate(parents):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise ConfigError(f"unknown config key {'.'.join(parents[: i + 1])!r} (in --config.{key}={text})")
            node = node[part]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise ConfigError(f"unknown config key {key!r} (value {text!r})")
        try:
            node[leaf] = _parse(text)
        except TypeError as e:
            raise ConfigError(f"config key {key!r}: bad value {text!r} ({e})") from None
    return cfg


def _get(cfg: ml_collections.ConfigDict, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = value[part]
    return value


def _positive(cfg: ml_collections.ConfigDict, *keys: str) -> None:
    for key in keys:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config key {key!r} must be positive, got {value!r}")


def _integer(cfg: ml_collections.ConfigDict, *keys: str) -> None:
    for key in keys:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")


def _non_negative(cfg: ml_collections.ConfigDict, *keys: str) -> None:
    for key in keys:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"config key {key!r} must be >= 0, got {value!r}")


def _typed(cfg: ml_collections.ConfigDict, kind: type, *keys: str) -> None:
    for key in keys:
        value = _get(cfg, key)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"config key {key!r} must be a {kind.__name__}, got {value!r}")


NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _check_name(name: Any) -> None:
    """A run name is one path component inside runs/: letters, digits, ``_``, ``.``, ``-``."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"config key 'name' must be one directory name inside runs/ (letters, digits, '_', '.', '-'; "
            f"no separators, no '..', not starting with '.' or '-'), got {name!r}"
        )


def _check_keys(cfg: ml_collections.ConfigDict) -> None:
    """Every key (outside ``task``, whose keys depend on the task) is one the default config has."""
    defaults = load(DEFAULT_CONFIG)
    for key in cfg:
        if key not in defaults:
            raise ConfigError(f"unknown config key {key!r} (value {cfg[key]!r})")
        if key != "task" and isinstance(defaults[key], ml_collections.ConfigDict):
            if not isinstance(cfg[key], ml_collections.ConfigDict):
                raise ConfigError(f"config key {key!r} must be a group of keys, got {cfg[key]!r}")
            for sub in cfg[key]:
                if sub not in defaults[key]:
                    raise ConfigError(f"unknown config key '{key}.{sub}' (value {cfg[key][sub]!r})")
    for key in defaults:
        if key not in cfg:
            raise ConfigError(f"config key {key!r} is missing")


def _check_run(cfg: ml_collections.ConfigDict) -> None:
    """The keys of where and how long a run runs, and the distributed setup."""
    _check_name(cfg.name)
    _typed(cfg, str, "workdir", "distributed.coordinator_address")
    _typed(cfg, bool, "resume", "control")
    _integer(cfg, "seed", "steps", "batch_size", "log_every", "eval_every", "eval_batches", "checkpoint_every")
    _integer(cfg, "warmup_steps", "distributed.num_processes", "distributed.process_id")
    _positive(cfg, "steps", "batch_size", "log_every", "eval_every", "eval_batches", "checkpoint_every")
    if cfg.distributed.num_processes < 0 or cfg.distributed.process_id < -1:
        raise ConfigError(
            f"config keys 'distributed.num_processes'={cfg.distributed.num_processes} must be >= 0 and "
            f"'distributed.process_id'={cfg.distributed.process_id} >= -1"
        )


def make_task(cfg: ml_collections.ConfigDict) -> Task:
    """The task named by ``cfg.task.name`` with the other ``cfg.task`` fields."""
    spec = dict(cfg.task)
    name = spec.pop("name")
    if name not in TASKS:
        raise ConfigError(f"config key 'task.name': unknown task {name!r}; choose from {sorted(TASKS)}")
    fields = {f.name for f in dataclasses.fields(TASKS[name])}
    for key, value in spec.items():
        if key not in fields:
            raise ConfigError(f"unknown config key 'task.{key}' for task {name!r} (value {value!r})")
        _integer(cfg, f"task.{key}")
        _positive(cfg, f"task.{key}")
    task = TASKS[name](**spec)
    if isinstance(task, MQAR) and not task.num_queries <= task.num_pairs <= task.num_keys:
        raise ConfigError(
            f"config keys 'task.num_queries'={task.num_queries}, 'task.num_pairs'={task.num_pairs}, "
            f"'task.num_keys'={task.num_keys} must satisfy num_queries <= num_pairs <= num_keys"
        )
    return task


def _check_mesh(cfg: ml_collections.ConfigDict) -> None:
    for axis in AXES:
        value = cfg.mesh[axis]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config key 'mesh.{axis}' must be a positive int, got {value!r}")
    if cfg.batch_size % cfg.mesh.data:
        raise ConfigError(f"config key 'batch_size'={cfg.batch_size} must be a multiple of 'mesh.data'={cfg.mesh.data}")


def validate(cfg: ml_collections.ConfigDict) -> Task:
    """Checks every value the program depends on; returns the task. Raises :class:`ConfigError`."""
    _check_keys(cfg)
    _check_run(cfg)
    task = make_task(cfg)
    _check_mesh(cfg)
    _positive(cfg, "learning_rate", "grad_clip", "model.d_model", "model.num_heads", "model.num_layers")
    _positive(cfg, "model.mlp_ratio")
    _integer(cfg, "model.d_model", "model.num_heads", "model.num_layers", "model.mlp_ratio")
    _integer(cfg, "model.num_kv_heads", "model.window", "model.block_size")
    _non_negative(cfg, "model.block_size")
    if cfg.model.implementation not in ("", *IMPLEMENTATIONS):
        raise ConfigError(
            f"config key 'model.implementation'={cfg.model.implementation!r}: choose from {IMPLEMENTATIONS} or ''"
        )
    _non_negative(cfg, "weight_decay", "warmup_steps")
    tokens = cfg.model.global_tokens
    if not isinstance(tokens, (tuple, list)) or not all(isinstance(g, int) and not isinstance(g, bool) for g in tokens):
        raise ConfigError(f"config key 'model.global_tokens' must be a tuple of integers, got {tokens!r}")
    if cfg.warmup_steps >= cfg.steps:
        raise ConfigError(f"config key 'warmup_steps'={cfg.warmup_steps} must be below 'steps'={cfg.steps}")
    for key in ("eval_every", "checkpoint_every"):
        if cfg[key] % cfg.log_every:
            raise ConfigError(f"config key {key!r}={cfg[key]} must be a multiple of 'log_every'={cfg.log_every}")
    if cfg.model.mixer not in MIXERS:
        raise ConfigError(f"config key 'model.mixer': unknown mixer {cfg.model.mixer!r}; choose from {MIXERS}")
    kv = cfg.model.num_kv_heads
    if kv < 0 or (kv and cfg.model.num_heads % kv):
        raise ConfigError(f"config key 'model.num_kv_heads'={kv} must be 0 or a divisor of 'model.num_heads'")
    if cfg.model.window < 0:
        raise ConfigError(f"config key 'model.window' must be >= 0, got {cfg.model.window}")
    if cfg.model.global_tokens and not cfg.model.window:
        raise ConfigError("config key 'model.global_tokens' needs 'model.window' > 0")
    if any(not 0 <= g < task.length for g in cfg.model.global_tokens):
        raise ConfigError(
            f"config key 'model.global_tokens'={tuple(cfg.model.global_tokens)} must lie in [0, {task.length})"
        )
    if cfg.model.d_model % cfg.model.num_heads:
        raise ConfigError(
            f"config key 'model.num_heads'={cfg.model.num_heads} does not divide 'model.d_model'={cfg.model.d_model}"
        )
    return task
