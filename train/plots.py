"""Pictures of a run (matplotlib, written as PNG into the run directory)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

if TYPE_CHECKING:
    from train.loop import Experiment


def curves(log: list[dict], path: Path, *, chance: float, title: str) -> None:
    """Training loss, training accuracy and held-out accuracy against step."""
    steps = [r["step"] for r in log]
    ev = [(r["step"], r["eval"]["token_acc"], r["eval"]["seq_acc"]) for r in log if "eval" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, [r["loss"] for r in log])
    ax1.set(xlabel="step", ylabel="train loss (answer tokens)", yscale="log", title=title)
    ax2.plot(steps, [r["acc"] for r in log], label="train token acc", alpha=0.6)
    if ev:
        s, tok, seq = zip(*ev, strict=True)
        ax2.plot(s, tok, "o-", label="held-out token acc")
        ax2.plot(s, seq, "s--", label="held-out sequence acc")
    ax2.axhline(chance, color="grey", ls=":", label=f"chance {chance:.1%}")
    ax2.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attention_maps(exp: Experiment, params, path: Path) -> None:
    """Attention weights of every layer and head on one held-out example, tokens labelled."""
    batch = exp.task.batch(exp.eval_key, 1)
    _, weights = exp.model(params)(batch.inputs, return_weights=True)  # layers x (1, N, L, L)
    names = exp.task.token_names()
    labels = [names[t] for t in np.asarray(batch.inputs[0])]
    layers, heads = len(weights), weights[0].shape[1]
    size = 0.18 * len(labels) + 1.5
    fig, axes = plt.subplots(layers, heads, figsize=(size * heads, size * layers), squeeze=False)
    for i, w in enumerate(weights):
        for h in range(heads):
            ax = axes[i, h]
            ax.imshow(np.asarray(w[0, h]), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {i} head {h}", fontsize=9)
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(len(labels)), labels, fontsize=6)
            ax.set_xlabel("key", fontsize=7)
            ax.set_ylabel("query", fontsize=7)
    fig.suptitle(f"{exp.task.name}: attention on a held-out example")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
