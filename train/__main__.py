"""``python -m train [--config configs/<task>.py] [--config.KEY=VALUE ...]``: train, then a verdict."""

from __future__ import annotations

import argparse
import sys

from train import config, loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    parser.add_argument("--config", default=str(config.DEFAULT_CONFIG), help="config file with get_config()")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = config.override(config.load(args.config), overrides)
        config.validate(cfg)
    except config.ConfigError as e:
        parser.exit(2, f"python -m train: config error: {e}\n")
    summary = loop.train(cfg, progress=not args.quiet)
    if summary["interrupted"]:
        print(f"interrupted at step {summary['step']}: checkpoint saved; run the same command to resume")
        return 130
    control = None
    if cfg.control and cfg.model.mixer != "none":
        ctl = cfg.copy_and_resolve_references()
        with ctl.unlocked():
            ctl.model.mixer, ctl.workdir = "none", str(loop.workdir_of(cfg) / "control")
        control = loop.train(ctl, progress=not args.quiet)
        if control["interrupted"]:
            return 130
    print(loop.verdict(summary, control))
    print(f"run directory: {summary['workdir']} (metrics.jsonl, curves.png, attention.png, checkpoints/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
