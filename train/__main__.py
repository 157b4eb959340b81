"""``python -m train [--config configs/<task>.py] [--config.KEY=VALUE ...]``: train, then a verdict.

``--help`` lists every config key with its meaning and its default in the ``--config`` file
(``python -m train --config configs/sort.py --help`` shows sort's). An unknown key is answered
with the nearest ones (``--config.step=5``: did you mean 'steps'?).

A ``--config.steps`` at or below the config file's ``warmup_steps``, with no
``--config.warmup_steps`` given, scales the warm-up to the file's fraction
(``warmup_steps * steps // file's steps``: configs/sort.py with ``--config.steps=200`` warms up
for 20 steps) and prints a note; the same command gives the same warm-up, and continuing that
run with more steps takes its warm-up as a flag (``--config.warmup_steps=20``), as the messages
say. A ``--config.warmup_steps`` not below ``steps`` is an error that names the flag to change.

Running the command of a complete run (its ``summary.json`` says it reached ``steps``) trains
and compiles nothing: it says the run is complete, shows its verdict again and exits with 0; a
larger ``--config.steps`` continues it. Its control is checked the same way, and an unfinished
control is trained.

User faults (a bad config key or value, a run directory holding another run, an unusable
checkpoint directory, a damaged metrics line) end the program with one line on stderr and a
non-zero exit status: 2 for the config, 1 for the run directory. ``--debug`` shows tracebacks
and the libraries' logs instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

import ml_collections

from train import config, loop, rundir


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """One-line warnings, and no library logs (orbax logs its errors, with tracebacks, to absl)."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]  # asyncio: orbax's failed reads
    levels = [logger.level for logger in loggers]

    def one_line(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {message}", file=file or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = one_line
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


EPILOG = """\
--config PATH (a file with get_config(), default configs/default.py) and --config.KEY=VALUE are
parsed by ml_collections.config_flags (absl flags).

"""


def print_help(parser: argparse.ArgumentParser, config_args: list[str]) -> None:
    """``--help``: the options, then every config key with its default in the ``--config`` file and its meaning."""
    path = config.config_path(config_args)
    try:
        cfg = config.load(path)
    except config.ConfigError as e:
        cfg, path = config.load(), f"configs/default.py, since {e}"
    parser.epilog = EPILOG + config.help_text(cfg, path)
    parser.print_help()


def main(argv: list[str] | None = None) -> int:
    """The command: parses ``argv`` (default ``sys.argv[1:]``), trains; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help lists the config keys of the --config file, known only after parsing
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help (and the config keys) and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--debug", action="store_true", help="tracebacks and library logs for errors")
    args, config_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.help:
        print_help(parser, config_args)
        return 0
    try:
        cfg = config.parse(config_args)
        note = config.scale_warmup(cfg, config_args)
        config.validate(cfg)
    except config.ConfigError as e:
        parser.exit(2, f"python -m train: config error: {e}\n")
    if note:
        print(note)
    if args.debug:
        return run(cfg, progress=not args.quiet, warmup_scaled=bool(note))
    with quiet_libraries():
        try:
            return run(cfg, progress=not args.quiet, warmup_scaled=bool(note))
        except config.ConfigError as e:
            parser.exit(2, f"python -m train: config error: {e}\n")
        except rundir.RunError as e:
            parser.exit(1, f"python -m train: error: {e}\n")


def complete_note(summary: dict, cfg: ml_collections.ConfigDict, *, control: bool, warmup_scaled: bool) -> str:
    """What a rerun of a complete run (and ``control``) says: nothing to train, and how to train it further."""
    keep = f" and --config.warmup_steps={cfg.warmup_steps} (its warm-up)" if warmup_scaled else ""
    who = f"{summary['workdir']} and its control are" if control else f"{summary['workdir']} is"
    return (
        f"{who} already complete at step {summary['step']} "
        f"(--config.steps={cfg.steps}): nothing to train. To train further, rerun with --config.steps=N for an "
        f"N > {summary['step']}{keep}"
    )


def run(cfg: ml_collections.ConfigDict, *, progress: bool, warmup_scaled: bool = False) -> int:
    """Trains the run of ``cfg`` (and its control), prints the verdict; returns the exit status.

    A run that is already complete (:func:`train.loop.train` returns its saved summary) trains
    nothing; when its control is complete too, the command says so (with how to train further:
    ``warmup_scaled`` says the warm-up was scaled, so that continuing needs it as a flag).
    """
    summary = loop.train(cfg, progress=progress)
    if summary["moved_aside"]:
        print(f"moved the previous run to {summary['moved_aside']}")
    if summary["interrupted"]:
        print(f"interrupted at step {summary['step']}: checkpoint saved; run the same command to resume")
        return 130
    control = None
    ctl = config.control_of(cfg)
    if cfg.control and ctl.model != cfg.model:
        ctl.workdir = str(loop.workdir_of(cfg) / "control")
        control = loop.train(ctl, progress=progress, pictures=False)
        if control["interrupted"]:
            print(
                f"interrupted the control at step {control['step']}: checkpoint saved; run the same command to resume"
            )
            return 130
    complete = all(s.get("already_complete") for s in (summary, control) if s is not None)
    if control is not None and not complete:
        loop.compare(summary, control)
    if complete:
        print(complete_note(summary, cfg, control=control is not None, warmup_scaled=warmup_scaled))
    print(loop.verdict(summary, control))
    pictures = (
        ["curves.png"]
        + ["attention.png"] * (cfg.model.mixer == "attention")
        + ["lengths.png"] * bool(summary["lengths"])
    )
    print(f"run directory: {summary['workdir']} (metrics.jsonl, {', '.join(pictures)}, checkpoints/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
