"""``python -m train [--config configs/<task>.py] [--config.KEY=VALUE ...]``: train, then a verdict.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description=__doc__,
        epilog="--config PATH (a file with get_config(), default configs/default.py) and --config.KEY=VALUE "
        "are parsed by ml_collections.config_flags (absl flags).",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--debug", action="store_true", help="tracebacks and library logs for errors")
    args, config_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config.parse(config_args)
        config.validate(cfg)
    except config.ConfigError as e:
        parser.exit(2, f"python -m train: config error: {e}\n")
    if args.debug:
        return run(cfg, progress=not args.quiet)
    with quiet_libraries():
        try:
            return run(cfg, progress=not args.quiet)
        except config.ConfigError as e:
            parser.exit(2, f"python -m train: config error: {e}\n")
        except rundir.RunError as e:
            parser.exit(1, f"python -m train: error: {e}\n")


def run(cfg, *, progress: bool) -> int:
    """Trains the run of ``cfg`` (and its control), prints the verdict; returns the exit status."""
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
        loop.compare(summary, control)
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
