"""Config files (ml_collections, ``get_config()``), command-line overrides, and validation.

``--config PATH`` and the overrides ``--config.model.d_model=64`` are parsed by
``ml_collections.config_flags`` (absl flags, on a fresh ``FlagValues`` per call: nothing global);
a bad key or value stops the program before anything is compiled, with the key and value named
in one line (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from train.model import IMPLEMENTATIONS, MIXERS, POSITIONS
from train.sharding import AXES
from train.tasks import MQAR, TASKS, Task

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.py"


class ConfigError(ValueError):
    """A config key with a value the program cannot run with."""


PROG = "python -m train"


def _flag_values(argv: list[str], define, explain) -> flags.FlagValues:
    """Fresh absl flags (nothing global) with ``define(flag_values, argv)`` run and ``argv`` parsed.

    Raises :class:`ConfigError` with ``explain(error)`` for anything absl or ml_collections
    reject, and for arguments that are not flags.
    """
    fv = flags.FlagValues()
    full = [PROG, *argv]
    try:
        with warnings.catch_warnings():  # ml_collections loads config files with importlib's load_module()
            warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
            define(fv, full)
            rest = fv(full, known_only=False)
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError) as e:
        raise ConfigError(explain(e)) from None
    if len(rest) > 1:
        raise ConfigError(f"expected --config PATH and --config.KEY=VALUE arguments, got {rest[1]!r}")
    return fv


def _config_path(argv: list[str]) -> str:
    """The value of ``--config`` in ``argv`` (for error messages only; absl parses it for real)."""
    path = str(DEFAULT_CONFIG)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.removeprefix("--config=")
    return path


def _overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``(key, value)`` of each ``--config.KEY=VALUE`` / ``--config.KEY VALUE`` in ``argv``."""
    pairs = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config."):
            key, eq, value = arg.removeprefix("--config.").partition("=")
            pairs.append((key, value if eq else (argv[i + 1] if i + 1 < len(argv) else "")))
    return pairs


def _explain(argv: list[str], error: Exception, cfg: ml_collections.ConfigDict | None = None) -> str:
    """One line naming the key and value that absl/ml_collections refused."""
    if cfg is None:
        cfg = load(_config_path(argv))  # raises its own ConfigError for a missing or broken file
    for key, value in _overrides(argv):
        node = cfg
        for depth, part in enumerate(key.split(".")):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                where = ".".join(key.split(".")[: depth + 1])
                if depth == 1 and key.startswith("control_model."):
                    return (
                        f"config key {key!r} (value {value!r}): on the command line control_model takes the keys "
                        f"its config file sets ({', '.join(node) or 'none'}); set other model keys of the control "
                        "in a config file's get_config()"
                    )
                return (
                    f"unknown config key {where!r} (in --config.{key}={value})"
                    if where != key
                    else (f"unknown config key {key!r} (value {value!r})")
                )
            node = node[part]
    bad = re.search(r"--config\.([\w.]+)=(.*?): (.*)", str(error).splitlines()[0] if str(error) else "")
    if bad:
        return f"config key {bad[1]!r}: bad value {bad[2]!r} ({bad[3].strip('()')})"
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return f"bad arguments {' '.join(argv)!r}: {first}"


def load(path: str | Path = DEFAULT_CONFIG) -> ml_collections.ConfigDict:
    """Runs ``get_config()`` of a config file (``ml_collections.config_flags``); locked (no new keys).

    Config files import each other as ``from configs import default``, which resolves from the
    repository root, where ``python -m train`` (and the tests) run.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")

    def define(fv, argv):
        config_flags.DEFINE_config_file("config", str(path), "config file", flag_values=fv, sys_argv=argv)

    def explain(e: Exception) -> str:
        return f"config file {str(path)!r} could not be loaded: {(str(e).splitlines() or [type(e).__name__])[0]}"

    return _flag_values([], define, explain).config


def parse(argv: list[str]) -> ml_collections.ConfigDict:
    """The config of ``--config PATH`` (default ``configs/default.py``) with ``--config.KEY=VALUE`` applied.

    Parsed by ``ml_collections.config_flags`` on a fresh ``absl.flags.FlagValues``: values are
    parsed as the type of the existing field (bool, int, float, str, tuple). Not validated (see
    :func:`validate`). Raises :class:`ConfigError` naming key and value.
    """
    path = _config_path(argv)
    if not Path(path).is_file():
        raise ConfigError(f"config file {path!r} does not exist")

    def define(fv, full):
        config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "config file", flag_values=fv, sys_argv=full)

    return _flag_values(argv, define, lambda e: _explain(argv, e)).config


def override(cfg: ml_collections.ConfigDict, args: list[str]) -> ml_collections.ConfigDict:
    """Applies ``--config.a.b=value`` arguments to ``cfg`` (in place) with ``config_flags``' parsers.

    Each value is parsed as the type of the existing field; unknown keys and bad values raise
    :class:`ConfigError` naming key and value.
    """
    for arg in args:
        if not arg.startswith("--config."):
            raise ConfigError(f"expected --config.KEY=VALUE, got {arg!r}")

    def define(fv, full):
        config_flags.DEFINE_config_dict("config", cfg, "config", flag_values=fv, sys_argv=full)

    return _flag_values(args, define, lambda e: _explain(args, e, cfg)).config


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
    """Every key is one the default config has (``task``'s depend on the task; ``control_model`` holds model keys)."""
    defaults = load(DEFAULT_CONFIG)
    for key in cfg:
        if key not in defaults:
            raise ConfigError(f"unknown config key {key!r} (value {cfg[key]!r})")
        if key == "control_model":  # any model keys
            if not isinstance(cfg[key], ml_collections.ConfigDict):
                raise ConfigError(f"config key {key!r} must be a group of model keys, got {cfg[key]!r}")
            for sub in cfg[key]:
                if sub not in defaults.model:
                    raise ConfigError(f"unknown config key '{key}.{sub}': not a model key (value {cfg[key][sub]!r})")
        elif key != "task" and isinstance(defaults[key], ml_collections.ConfigDict):
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


def check_backend(cfg: ml_collections.ConfigDict, backend: str) -> None:
    """Checks what depends on JAX's ``backend`` (known only once it starts, after a multi-process run joins)."""
    if cfg.model.implementation == "cudnn" and backend != "gpu":
        raise ConfigError(f"config key 'model.implementation'='cudnn' needs an NVIDIA GPU; this backend is {backend!r}")


def control_of(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The control run of ``cfg``: a copy with the model keys of ``cfg.control_model`` changed.

    The caller places it (its own ``workdir``); raises :class:`ConfigError` for a value of the
    wrong type.
    """
    ctl = cfg.copy_and_resolve_references()
    try:
        for key, value in cfg.control_model.items():
            ctl.model[key] = value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key 'control_model': {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    with ctl.unlocked():
        ctl.control = False
    return ctl


def validate(cfg: ml_collections.ConfigDict) -> Task:
    """Checks every value the program depends on (the control's too); returns the task. Raises :class:`ConfigError`."""
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
    if cfg.model.positions not in POSITIONS:
        raise ConfigError(
            f"config key 'model.positions': unknown positions {cfg.model.positions!r}; choose from {POSITIONS}"
        )
    if cfg.model.positions == "alibi" and cfg.model.mixer == "linear":
        raise ConfigError(
            "config key 'model.positions'='alibi' needs softmax attention: 'model.mixer'='linear' forms no scores "
            "to bias ('none' is allowed: that model sees no positions at all)"
        )
    kv = cfg.model.num_kv_heads
    if kv < 0 or (kv and cfg.model.num_heads % kv):
        raise ConfigError(f"config key 'model.num_kv_heads'={kv} must be 0 or a divisor of 'model.num_heads'")
    if cfg.model.window < 0:
        raise ConfigError(f"config key 'model.window' must be >= 0, got {cfg.model.window}")
    if cfg.model.window and cfg.model.mixer == "linear":
        raise ConfigError(
            f"config key 'model.window'={cfg.model.window} needs softmax attention: 'model.mixer'='linear' takes "
            "the causal mask only"
        )
    if cfg.model.global_tokens and not cfg.model.window:
        raise ConfigError("config key 'model.global_tokens' needs 'model.window' > 0")
    if any(not 0 <= g < task.length for g in cfg.model.global_tokens):
        raise ConfigError(
            f"config key 'model.global_tokens'={tuple(cfg.model.global_tokens)} must lie in [0, {task.length})"
        )
    extrapolate = cfg.extrapolate
    if not isinstance(extrapolate, (tuple, list)) or not all(
        isinstance(f, int) and not isinstance(f, bool) and f >= 1 for f in extrapolate
    ):
        raise ConfigError(f"config key 'extrapolate' must be a tuple of integers >= 1, got {extrapolate!r}")
    if extrapolate:
        try:
            task.scaled(2)
        except NotImplementedError as e:
            raise ConfigError(f"config key 'extrapolate'={tuple(extrapolate)}: {e}") from None
    if cfg.model.d_model % cfg.model.num_heads:
        raise ConfigError(
            f"config key 'model.num_heads'={cfg.model.num_heads} does not divide 'model.d_model'={cfg.model.d_model}"
        )
    if cfg.control:
        try:
            validate(control_of(cfg))
        except ConfigError as e:
            raise ConfigError(f"the control (control_model={cfg.control_model.to_dict()}): {e}") from None
    return task
