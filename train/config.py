"""Config files (ml_collections, ``get_config()``), command-line overrides, and validation.

``--config PATH`` and the overrides ``--config.model.d_model=64`` are parsed by
``ml_collections.config_flags`` (absl flags, on a fresh ``FlagValues`` per call: nothing global);
a bad key or value stops the program before anything is compiled, with the key and value named
in one line (:class:`ConfigError`); an unknown key comes with the nearest known ones
(:func:`did_you_mean`).

:data:`KEYS` is the one description of the keys (``python -m train --help`` prints it with the
``--config`` file's defaults, :func:`help_text`). :func:`scale_warmup` fits the config file's
warm-up below a shorter ``--config.steps`` when the command line does not set ``warmup_steps``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import shutil
import textwrap
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

import jattn
from train.model import IMPLEMENTATIONS, MIXERS, POSITIONS, SCORE_FREE
from train.sharding import AXES
from train.tasks import MQAR, TASKS, Task

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.py"


class ConfigError(ValueError):
    """A config key with a value the program cannot run with."""


PROG = "python -m train"

# What each config key means: the one description of the keys, shown by ``python -m train --help``
# (with the defaults of the --config file). ``task.*`` keys depend on ``task.name``;
# ``control_model.K`` is the control's ``model.K`` (:func:`describe`).
KEYS: dict[str, str] = {
    "name": "run name: the run directory is runs/<name> unless workdir is set",
    "workdir": "the run directory; '' means runs/<name>",
    "resume": "an existing run directory of this name: True resumes it (the config must match on every key "
    "that shapes the run) or, when it is complete, says so and exits; False moves it aside to <dir>.old-<n> "
    "and starts afresh",
    "seed": "seed of the parameters, the training batches and the held-out evaluation batches",
    "task.name": "the task: " + ", ".join(map(repr, TASKS)) + "; its other task keys depend on it",
    "task.num_pairs": "mqar: key-value pairs in the context",
    "task.num_queries": "mqar: keys asked after the context (at most num_pairs); the loss is on their values",
    "task.num_keys": "mqar: key tokens the keys are drawn from (at least num_pairs)",
    "task.num_values": "mqar: value tokens the values are drawn from (chance is 1/num_values)",
    "task.size": "sort, reverse, induction: tokens in the first half; the second half is them sorted, "
    "reversed or repeated",
    "task.vocab": "sort, reverse, induction: symbols the tokens are drawn from (chance is 1/vocab)",
    "model.mixer": "'attention' (softmax), 'linear', a recurrent kind of jattn.gated_linear_attention ('retention', "
    "'ssd', 'gla', 'deltanet', 'gated_deltanet', 'kda'), or 'none' (the token-local control)",
    "model.positions": "'learned' (an absolute table) or 'alibi' (no table; softmax attention only)",
    "model.d_model": "width of the residual stream",
    "model.num_heads": "attention heads (a divisor of d_model)",
    "model.short_conv": "size of a causal depthwise convolution (then SiLU) before every mixer, as the linear-attention "
    "papers use; 0: none",
    "model.num_kv_heads": "key/value heads: 0 means as many as num_heads; fewer is grouped-query attention",
    "model.num_layers": "decoder blocks",
    "model.mlp_ratio": "the MLP's hidden width, in multiples of d_model",
    "model.window": "> 0: causal sliding window of this many past keys (+ the query itself); 0: all past keys",
    "model.global_tokens": "with a window: positions that see and are seen by all (causally)",
    "model.implementation": "jattn.attention's path: '' (chosen per call), " + ", ".join(map(repr, IMPLEMENTATIONS)),
    "model.block_size": "blockwise tiles (one int for both sides); 0: chosen from the mask",
    "steps": "training steps; a larger value continues a finished run",
    "batch_size": "sequences per step (a multiple of mesh.data)",
    "learning_rate": "AdamW's peak learning rate: linear warm-up, then cosine decay to 1% of it",
    "warmup_steps": "steps of the linear warm-up, below steps; not set on the command line and not below "
    "--config.steps, it is scaled to the config file's fraction (warmup_steps * steps // the file's steps)",
    "weight_decay": "AdamW's weight decay",
    "grad_clip": "gradients are clipped to this global norm",
    "log_every": "steps per jitted call (one lax.scan) and per metrics line",
    "eval_every": "held-out evaluation every this many steps (a multiple of log_every)",
    "eval_batches": "held-out batches per evaluation",
    "checkpoint_every": "a checkpoint every this many steps (a multiple of log_every); the last two are kept",
    "control": "also train the control (the model with control_model's keys) on the same budget, in "
    "<run directory>/control; the verdict shows both",
    "control_model": "the model keys the control changes",
    "extrapolate": "after training, also evaluate on the task scaled to these multiples of its length (tasks "
    "with a longer version); the learned position table then has rows for the longest, untrained past L",
    "mesh.data": "devices splitting the batch (data * seq * model devices are used)",
    "mesh.seq": "devices splitting the sequence inside attention (ring attention)",
    "mesh.model": "devices splitting attention heads and the MLP's hidden features",
    "distributed.coordinator_address": "multi-host: host:port of process 0; '' means JAX_COORDINATOR_ADDRESS "
    "or, unset, one process",
    "distributed.num_processes": "multi-host: the number of processes; 0 means JAX_NUM_PROCESSES",
    "distributed.process_id": "multi-host: this process's index; -1 means JAX_PROCESS_ID",
}


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model.d_model": 64, ...}``: the leaves of a (nested) ConfigDict or dict under dotted keys."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe(key: str) -> str:
    """The meaning of a dotted config key (from :data:`KEYS`); ``control_model.K`` is the control's ``model.K``."""
    if key.startswith("control_model."):
        model_key = key.removeprefix("control_")
        return f"the control's {model_key}: {KEYS.get(model_key, 'not a model key')}"
    return KEYS.get(key, "(no description)")


def help_text(cfg: ml_collections.ConfigDict, source: str, width: int | None = None) -> str:
    """The config keys of ``cfg`` with their values (the defaults of ``source``) and meanings, for ``--help``."""
    width = width or max(shutil.get_terminal_size().columns - 2, 60)
    lines = [f"config keys, set with --config.KEY=VALUE (defaults of {source}):"]
    order = {key: i for i, key in enumerate(KEYS)}  # KEYS's order: the run, the task, the model, training...
    flat = flatten(cfg)
    for key in sorted(flat, key=lambda k: (order.get(k, order.get(k.split(".")[0], len(order))), k)):
        value = flat[key]
        left = f"  {key} = {value!r}"
        indent = " " * 32
        wrapped = textwrap.wrap(
            describe(key), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )
        if len(left) < len(indent) - 1:
            wrapped[0] = left.ljust(len(indent)) + wrapped[0][len(indent) :]
        else:
            wrapped.insert(0, left)
        lines += wrapped
    return "\n".join(lines)


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'steps'?"`` for the candidates close to ``key``, else ``""``.

    :func:`difflib.get_close_matches` on the whole dotted key (``step`` -> ``steps``,
    ``model.d_mdoel`` -> ``model.d_model``), else on its last part (``d_model`` -> ``model.d_model``),
    else the keys whose last part it begins (``warmup`` -> ``warmup_steps``).
    """
    names = sorted(set(candidates))
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.8)
    if not close:
        by_last: dict[str, list[str]] = {}
        for name in names:
            by_last.setdefault(name.rpartition(".")[2], []).append(name)
        last = key.rpartition(".")[2]
        parts = difflib.get_close_matches(last, list(by_last), n=3, cutoff=0.85)
        parts = parts or [part for part in by_last if last and part.startswith(last)]
        close = [name for part in parts for name in by_last[part]][:3]
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


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


def config_path(argv: list[str]) -> str:
    """The config file ``argv`` names with ``--config`` (default ``configs/default.py``), as the user would write it."""
    path = Path(_config_path(argv))
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:  # outside the working directory
        return str(path)


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
                hint = did_you_mean(key, flatten(cfg))
                return (
                    f"unknown config key {where!r} (in --config.{key}={value}){hint}"
                    if where != key
                    else (f"unknown config key {key!r} (value {value!r}){hint}")
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


def scale_warmup(cfg: ml_collections.ConfigDict, argv: list[str]) -> str | None:
    """Fits the config file's ``warmup_steps`` below a shorter ``--config.steps``; returns a one-line note, or None.

    Only when ``argv`` (the arguments :func:`parse` took) does not set ``warmup_steps`` and the
    file's value is not below ``steps``: it becomes ``warmup_steps * steps // file_steps``, the
    config file's fraction (``configs/sort.py``'s 200 of 2000, with ``--config.steps=200``: 20).
    That depends only on the config file and ``steps``, so the same command resumes the same run
    (and a finished one is found complete); continuing it with more steps needs its warm-up
    spelled out, ``--config.warmup_steps=20``. An explicit ``--config.warmup_steps`` is left as it
    is: :func:`validate` names the flag when it is too long. Changes ``cfg`` in place.
    """
    if "warmup_steps" in dict(_overrides(argv)):
        return None
    path = config_path(argv)
    warmup, steps, file_steps = cfg.warmup_steps, cfg.steps, load(path).steps
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (warmup, steps, file_steps)):
        return None  # validate() names the key
    if not (0 <= warmup < file_steps and 0 < steps <= warmup):
        return None
    cfg.warmup_steps = warmup * steps // file_steps
    return (
        f"note: warmup_steps={warmup} of {path} is not below --config.steps={steps}: scaled to "
        f"{cfg.warmup_steps}, the file's {warmup} of {file_steps} steps; --config.warmup_steps=N sets it"
    )


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
            raise ConfigError(f"unknown config key {key!r} (value {cfg[key]!r}){did_you_mean(key, flatten(defaults))}")
        if key == "control_model":  # any model keys
            if not isinstance(cfg[key], ml_collections.ConfigDict):
                raise ConfigError(f"config key {key!r} must be a group of model keys, got {cfg[key]!r}")
            for sub in cfg[key]:
                if sub not in defaults.model:
                    hint = did_you_mean(f"{key}.{sub}", [f"{key}.{m}" for m in defaults.model])
                    raise ConfigError(
                        f"unknown config key '{key}.{sub}': not a model key (value {cfg[key][sub]!r}){hint}"
                    )
        elif key != "task" and isinstance(defaults[key], ml_collections.ConfigDict):
            if not isinstance(cfg[key], ml_collections.ConfigDict):
                raise ConfigError(f"config key {key!r} must be a group of keys, got {cfg[key]!r}")
            for sub in cfg[key]:
                if sub not in defaults[key]:
                    hint = did_you_mean(f"{key}.{sub}", flatten(defaults))
                    raise ConfigError(f"unknown config key '{key}.{sub}' (value {cfg[key][sub]!r}){hint}")
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
            hint = did_you_mean(f"task.{key}", [f"task.{f}" for f in fields])
            raise ConfigError(f"unknown config key 'task.{key}' for task {name!r} (value {value!r}){hint}")
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


def _check_schedule(cfg: ml_collections.ConfigDict) -> None:
    """The optimiser's keys and the cadence of logs, evaluations and checkpoints."""
    _positive(cfg, "learning_rate", "grad_clip")
    _non_negative(cfg, "weight_decay", "warmup_steps")
    if cfg.warmup_steps >= cfg.steps:
        raise ConfigError(
            f"config key 'warmup_steps'={cfg.warmup_steps} must be below 'steps'={cfg.steps}: pass "
            f"--config.warmup_steps=N with N < {cfg.steps}, e.g. --config.warmup_steps={cfg.steps // 10}"
        )
    for key in ("eval_every", "checkpoint_every"):
        if cfg[key] % cfg.log_every:
            raise ConfigError(f"config key {key!r}={cfg[key]} must be a multiple of 'log_every'={cfg.log_every}")


def _check_model(cfg: ml_collections.ConfigDict, task: Task) -> None:
    """The ``model`` keys, together and against the task's length."""
    _positive(cfg, "model.d_model", "model.num_heads", "model.num_layers", "model.mlp_ratio")
    _integer(cfg, "model.d_model", "model.num_heads", "model.num_layers", "model.mlp_ratio")
    _integer(cfg, "model.num_kv_heads", "model.window", "model.block_size", "model.short_conv")
    _non_negative(cfg, "model.block_size", "model.short_conv")
    if cfg.model.implementation not in ("", *IMPLEMENTATIONS):
        raise ConfigError(
            f"config key 'model.implementation'={cfg.model.implementation!r}: choose from {IMPLEMENTATIONS} or ''"
        )
    tokens = cfg.model.global_tokens
    if not isinstance(tokens, (tuple, list)) or not all(isinstance(g, int) and not isinstance(g, bool) for g in tokens):
        raise ConfigError(f"config key 'model.global_tokens' must be a tuple of integers, got {tokens!r}")
    if cfg.model.mixer not in MIXERS:
        raise ConfigError(f"config key 'model.mixer': unknown mixer {cfg.model.mixer!r}; choose from {MIXERS}")
    if cfg.model.positions not in POSITIONS:
        raise ConfigError(
            f"config key 'model.positions': unknown positions {cfg.model.positions!r}; choose from {POSITIONS}"
        )
    if cfg.model.positions == "alibi" and cfg.model.mixer in SCORE_FREE:
        raise ConfigError(
            f"config key 'model.positions'='alibi' needs softmax attention: 'model.mixer'={cfg.model.mixer!r} forms "
            "no scores to bias ('none' is allowed: that model sees no positions at all)"
        )
    kv = cfg.model.num_kv_heads
    if kv < 0 or (kv and cfg.model.num_heads % kv):
        raise ConfigError(f"config key 'model.num_kv_heads'={kv} must be 0 or a divisor of 'model.num_heads'")
    if kv and kv != cfg.model.num_heads and cfg.model.mixer in jattn.RECURRENT_KINDS:
        raise ConfigError(
            f"config key 'model.num_kv_heads'={kv}: 'model.mixer'={cfg.model.mixer!r} keeps a state per head "
            "(0 or num_heads)"
        )
    if cfg.model.window < 0:
        raise ConfigError(f"config key 'model.window' must be >= 0, got {cfg.model.window}")
    if cfg.model.window and cfg.model.mixer in SCORE_FREE:
        raise ConfigError(
            f"config key 'model.window'={cfg.model.window} needs softmax attention: 'model.mixer'="
            f"{cfg.model.mixer!r} takes the causal mask only"
        )
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


def _check_extrapolate(cfg: ml_collections.ConfigDict, task: Task) -> None:
    """``extrapolate``: factors >= 1, for a task with a longer version."""
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


def validate(cfg: ml_collections.ConfigDict) -> Task:
    """Checks every value the program depends on (the control's too); returns the task. Raises :class:`ConfigError`."""
    _check_keys(cfg)
    _check_run(cfg)
    task = make_task(cfg)
    _check_mesh(cfg)
    _check_schedule(cfg)
    _check_model(cfg, task)
    _check_extrapolate(cfg, task)
    if cfg.control:
        try:
            validate(control_of(cfg))
        except ConfigError as e:
            raise ConfigError(f"the control (control_model={cfg.control_model.to_dict()}): {e}") from None
    return task
