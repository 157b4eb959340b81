r"""``python -m train.family``: the MQAR comparison of softmax attention and the linear-attention family.

Every model of :data:`MIXERS` trains on MQAR with 8, 16, 32 and 64 key-value pairs (``--pairs``; the sequence is
4 x pairs - 1 long, 255 at 64) under the same budget (``configs/mqar_family.py``), each run the run of one command::

    python -m train --config configs/mqar_family.py --config.model.mixer=M --config.task.num_pairs=P \\
        --config.workdir=runs/mqar_family/M-P

and, past 32 pairs, ``--config.task.num_keys=P --config.task.num_values=P`` (every pair's key distinct). A
finished run is read back, not trained again. Writes ``runs/mqar_family/family.json``, ``family.md`` (the
table: held-out per-token accuracy on the queries) and ``family.png`` (accuracy against pairs, a line a model).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

from configs import mqar_family
from train import loop

MIXERS = ("attention", "linear", "retention", "ssd", "gla", "deltanet", "gated_deltanet")


def config(mixer: str, pairs: int, root: Path, steps: int | None = None):
    """The config of one run: ``configs/mqar_family.py`` with ``mixer`` and ``pairs`` (and ``steps``) set."""
    c = mqar_family.get_config()
    c.model.mixer, c.task.num_pairs, c.task.num_queries = mixer, pairs, pairs
    c.task.num_keys = c.task.num_values = max(c.task.num_keys, pairs)  # every pair's key distinct
    c.workdir = str(root / f"{mixer}-{pairs}")
    if steps is not None:
        c.steps, c.warmup_steps = steps, min(c.warmup_steps, steps // 10)
        c.eval_every = c.checkpoint_every = steps
        c.log_every = math.gcd(c.log_every, steps)  # eval_every must be a multiple of it
    return c


def accuracy(mixer: str, pairs: int, root: Path, steps: int | None = None) -> float:
    """Held-out per-token accuracy on the queries of one run (trained here unless already complete)."""
    summary = loop.train(config(mixer, pairs, root, steps), progress=False, pictures=False)
    return float(summary["eval"]["token_acc"])


def table(results: dict[str, dict[int, float]]) -> str:
    """The results as a Markdown table: a row a model, a column a number of pairs (accuracy in %)."""
    pairs = sorted({p for row in results.values() for p in row})
    lines = ["| model | " + " | ".join(f"{p} pairs" for p in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(f"{100 * row[p]:.1f}" for p in pairs) + " |" for m, row in results.items()]
    return "\n".join(lines) + "\n"


def picture(results: dict[str, dict[int, float]], path: Path) -> None:
    """Accuracy against the number of pairs, a line a model."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for mixer, row in results.items():
        pairs = sorted(row)
        ax.plot(pairs, [100 * row[p] for p in pairs], marker="o", label=mixer)
    ax.set(
        xlabel="key-value pairs (sequence length 4 x pairs - 1)", ylabel="held-out query accuracy (%)", ylim=(0, 102)
    )
    ax.set_xscale("log", base=2)
    ticks = sorted({p for row in results.values() for p in row})
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
    args = p.parse_args(argv)
    results = {m: {n: accuracy(m, n, args.out, args.steps) for n in args.pairs} for m in args.mixers}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "family.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "family.md").write_text(table(results))
    picture(results, args.out / "family.png")
    print(table(results), end="")
    print(f"wrote {args.out / 'family.md'}, family.json and family.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
