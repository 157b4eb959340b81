"""Pictures of a run (matplotlib, written as PNG into the run directory)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import LogFormatter

if TYPE_CHECKING:
    from train.loop import Experiment


def curves(runs: dict[str, list[dict]], path: Path, *, chance: float, title: str) -> None:
    """Training loss and held-out accuracy of one or more runs against step, on shared axes.

    ``runs`` maps a label (e.g. ``"attention"``, ``"control (no attention)"``) to the rows of its
    ``metrics.jsonl``. Training curves are lines; held-out evaluations are points (markers).
    """
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, log) in enumerate(runs.items()):
        color = f"C{i}"
        ev = [r for r in log if "eval" in r]
        ax_loss.plot([r["step"] for r in log], [r["loss"] for r in log], color=color, label=f"{label}: train")
        ax_loss.plot(
            [r["step"] for r in ev], [r["eval"]["loss"] for r in ev], "o", color=color, label=f"{label}: held-out"
        )
        ax_acc.plot(
            [r["step"] for r in log], [r["acc"] for r in log], color=color, alpha=0.5, label=f"{label}: train token"
        )
        ax_acc.plot(
            [r["step"] for r in ev],
            [r["eval"]["token_acc"] for r in ev],
            "o",
            color=color,
            ms=7,
            label=f"{label}: held-out token",
        )
        ax_acc.plot(
            [r["step"] for r in ev],
            [r["eval"]["seq_acc"] for r in ev],
            "s",
            color=color,
            mfc="none",
            ms=7,
            label=f"{label}: held-out sequence",
        )
    ax_loss.set(xlabel="step", ylabel="loss (answer tokens)", yscale="log", title=f"{title}: loss")
    ax_loss.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))  # 0.3, not 3 x 10^-1
    ax_loss.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    ax_acc.axhline(chance, color="grey", ls=":", label=f"chance {chance:.1%}")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title=f"{title}: accuracy")
    ax_loss.legend(fontsize=7)
    ax_acc.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lengths(runs: dict[str, list[dict]], path: Path, *, chance: float, title: str) -> None:
    """Held-out accuracy against evaluation length, one line per run; the first length is the training one.

    ``runs`` maps a label to its rows ``{"length", "token_acc", "seq_acc", ...}`` (a summary's
    ``lengths``), shortest first.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, rows) in enumerate(runs.items()):
        x = [r["length"] for r in rows]
        ax.plot(x, [r["token_acc"] for r in rows], "o-", color=f"C{i}", label=f"{label}: token")
        ax.plot(x, [r["seq_acc"] for r in rows], "s--", color=f"C{i}", mfc="none", label=f"{label}: sequence")
    trained = next(iter(runs.values()))[0]["length"]
    ax.axvline(trained, color="grey", ls="--", lw=0.8, label=f"training length {trained}")
    ax.axhline(chance, color="grey", ls=":", label=f"chance {chance:.1%}")
    ax.set(xlabel="evaluation length (tokens)", ylabel="held-out accuracy", ylim=(0, 1.02), xscale="log")
    ax.set_title(f"{title}: trained at length {trained}, evaluated longer", fontsize=10)
    ax.set_xticks(x, [str(v) for v in x])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attention_maps(exp: Experiment, params, path: Path) -> None:
    """Attention weights of every layer and head on one held-out example, tokens labelled.

    The title says what the task's solution looks like (``exp.task.pattern``); a colour bar
    gives the weights' scale (0 to 1).
    """
    batch = exp.task.batch(exp.eval_key, 1)
    _, weights = exp.model(params)(batch.inputs, return_weights=True)  # layers x (1, N, L, L)
    names = exp.task.token_names()
    labels = [names[t] for t in np.asarray(batch.inputs[0])]
    layers, heads = len(weights), weights[0].shape[1]
    size = 0.18 * len(labels) + 1.5
    fig, axes = plt.subplots(
        layers, heads, figsize=(size * heads + 1.2, size * layers + 0.9), squeeze=False, layout="constrained"
    )
    for i, w in enumerate(weights):
        for h in range(heads):
            ax = axes[i, h]
            image = ax.imshow(np.asarray(w[0, h]), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {i} head {h}", fontsize=9)
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(len(labels)), labels, fontsize=6)
            ax.set_xlabel("key position (read)", fontsize=7)
            ax.set_ylabel("query position", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(f"{exp.task.name}, held-out example. Expect {exp.task.pattern}", fontsize=9, wrap=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
