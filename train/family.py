r"""``python -m train.family``: the MQAR comparison of softmax attention and the linear-attention family.

Every model of :data:`MIXERS` trains on MQAR with 8, 16, 32 and 64 key-value pairs (``--pairs``; the sequence is
4 x pairs - 1 long, 255 at 64) under the same budget (``configs/mqar_family.py``), each run the run of one command::

    python -m train --config configs/mqar_family.py --config.model.mixer=M --config.task.num_pairs=P \\
        --config.workdir=runs/mqar_family/M-P

and, past 32 pairs, ``--config.task.num_keys=P --config.task.num_values=P`` (every pair's key distinct). A
finished run is read back, not trained again; SIGINT (Ctrl-C) or SIGTERM stops the run in progress at a
checkpoint and the comparison with status 130, and the same command resumes it.

``--learning-rates R1 R2 ...`` is Zoology's protocol: every model and number of pairs trains once a rate
(``--config.learning_rate=R``, run directory ``M-P-lrR``), and the table reports the best rate's accuracy with
the rate beside it; without it every run takes the config's rate (run directory ``M-P``). ``--no-train``
reads back the finished runs only (a cell whose runs have not finished shows "-"), so the table of a sweep
still running can be looked at. Writes ``runs/mqar_family/family.json`` (every rate's accuracy), ``family.md``
(the table: held-out per-token accuracy on the queries) and ``family.png`` (best accuracy against pairs, a
line a model).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

from configs import mqar_family
from train import loop, model, rundir

MIXERS = tuple(m for m in model.MIXERS if m != "none")  # softmax, linear and every recurrent kind of jattn


#: One model's results: pairs -> learning rate (None: the config's) -> held-out accuracy (None: not finished).
Row = dict[int, dict[float | None, float | None]]


def config(mixer: str, pairs: int, root: Path, steps: int | None = None, lr: float | None = None):
    """The config of one run: ``configs/mqar_family.py`` with ``mixer`` and ``pairs`` (and ``steps``, ``lr``) set."""
    c = mqar_family.get_config()
    c.model.mixer, c.task.num_pairs, c.task.num_queries = mixer, pairs, pairs
    c.task.num_keys = c.task.num_values = max(c.task.num_keys, pairs)  # every pair's key distinct
    c.workdir = str(root / f"{mixer}-{pairs}" if lr is None else root / f"{mixer}-{pairs}-lr{lr:g}")
    if lr is not None:
        c.learning_rate = lr
    if steps is not None:
        c.steps, c.warmup_steps = steps, min(c.warmup_steps, steps // 10)
        c.eval_every = c.checkpoint_every = steps
        c.log_every = math.gcd(c.log_every, steps)  # eval_every must be a multiple of it
    return c


def accuracy(
    mixer: str, pairs: int, root: Path, steps: int | None = None, lr: float | None = None, train: bool = True
) -> float | None:
    """Held-out per-token accuracy on the queries of one run, trained here unless already complete.

    With ``train`` False the run is only read back: None where it has not finished. A run stopped by
    SIGINT/SIGTERM (its checkpoint saved) raises :class:`RunInterruptedError`: the comparison stops there.
    """
    cfg = config(mixer, pairs, root, steps, lr)
    if not train:
        done = rundir.completed(rundir.workdir_of(cfg).resolve(), cfg)
        return None if done is None else float(done["eval"]["token_acc"])
    summary = loop.train(cfg, progress=False, pictures=False)
    if summary["interrupted"]:
        raise RunInterruptedError(f"interrupted {cfg.workdir} at step {summary['step']}: checkpoint saved")
    return float(summary["eval"]["token_acc"])


class RunInterruptedError(Exception):
    """A run of the comparison was stopped by a signal; the same command resumes it."""


def best(rates: dict[float | None, float | None]) -> tuple[float | None, float] | None:
    """``(rate, accuracy)`` of the best finished run among ``rates`` (None if none finished; ties: the first)."""
    done = [(lr, acc) for lr, acc in rates.items() if acc is not None]
    return max(done, key=lambda item: item[1]) if done else None


def _cell(rates: dict[float | None, float | None]) -> str:
    """A table cell: the best accuracy in %, with its rate where several were tried; "-" before any finished."""
    top = best(rates)
    if top is None:
        return "-"
    return f"{100 * top[1]:.1f}" + (f" ({top[0]:g})" if len(rates) > 1 else "")


def table(results: dict[str, Row]) -> str:
    """The results as a Markdown table: a row a model, a column a number of pairs (best accuracy in %)."""
    pairs = sorted({p for row in results.values() for p in row})
    lines = ["| model | " + " | ".join(f"{p} pairs" for p in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(_cell(row[p]) for p in pairs) + " |" for m, row in results.items()]
    return "\n".join(lines) + "\n"


def picture(results: dict[str, Row], path: Path) -> None:
    """Best accuracy against the number of pairs, a line a model (its finished runs; none: no line)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for mixer, row in results.items():
        points = [(p, top[1]) for p in sorted(row) if (top := best(row[p])) is not None]
        ax.plot([p for p, _ in points], [100 * a for _, a in points], marker="o", label=mixer)
    ticks = sorted({p for row in results.values() for p in row})
    ax.set(
        xlabel="key-value pairs (sequence length 4 x pairs - 1)", ylabel="held-out query accuracy (%)", ylim=(0, 102)
    )
    ax.set_xscale("log", base=2)
    ax.set_xlim(ticks[0] / 1.25, ticks[-1] * 1.25)
    ax.set_xticks(ticks, labels=[str(p) for p in ticks])
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    ax.set_title("MQAR: softmax attention and the linear-attention family")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.family", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=MIXERS)
    p.add_argument("--pairs", nargs="+", type=int, default=[8, 16, 32, 64])
    p.add_argument("--out", type=Path, default=Path("runs/mqar_family"))
    p.add_argument("--steps", type=int, default=None, help="a smaller budget than the config's 2000 steps (tests)")
    p.add_argument("--learning-rates", nargs="+", type=float, default=[None], help="a sweep; the best is reported")
    p.add_argument("--no-train", action="store_true", help="read back the finished runs only")
    args = p.parse_args(argv)
    try:
        results = {
            m: {n: {lr: accuracy(m, n, args.out, args.steps, lr, not args.no_train) for lr in args.learning_rates}
                for n in args.pairs}
            for m in args.mixers
        }  # fmt: skip
    except RunInterruptedError as e:
        print(f"{e}; run the same command to resume (finished runs are read back, not trained again)")
        return 130
    args.out.mkdir(parents=True, exist_ok=True)
    as_json = {m: {n: {str(lr or "config"): a for lr, a in rates.items()} for n, rates in row.items()}
               for m, row in results.items()}  # fmt: skip
    (args.out / "family.json").write_text(json.dumps(as_json, indent=2) + "\n")
    (args.out / "family.md").write_text(table(results))
    picture(results, args.out / "family.png")
    print(table(results), end="")
    print(f"wrote {args.out / 'family.md'}, family.json and family.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
