"""Pictures of a run (matplotlib, written as PNG into the run directory)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from matplotlib.ticker import LogFormatter

if TYPE_CHECKING:
    from train.loop import Experiment
    from train.tasks import LayerRole, Task


DPI = 110  # every picture is saved at this resolution: 1 point is 110/72 pixels


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
    fig.savefig(path, dpi=DPI)
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
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


TEXT = dict(ticks=9, axes=10, panel=10.5, layer=11.5, title=13)  # font sizes (points) of attention.png
TOKEN_LABELS = 32  # sequences up to this length label every position with its token; longer ones, every k-th


def tick_positions(length: int, most: int = TOKEN_LABELS) -> range:
    """The positions to label on an axis of ``length``: all of them up to ``most``, else every k-th.

    ``k`` is the smallest of 1, 2, 5, 10, 20, 50, ... that labels at most ``most // 2`` positions
    (a long axis shows numbers only, which need the room of a rotated label each).
    """
    if length <= most:
        return range(length)
    steps = (m * 10**e for e in range(16) for m in (1, 2, 5))
    return range(0, length, next(k for k in steps if len(range(0, length, k)) <= most // 2))


def _label_axes(ax: Axes, names: list[str], scored: np.ndarray) -> None:
    """Ticks of one panel: ``"position: token"`` where all positions fit, else thinned position numbers.

    The rows of scored positions (their next token is an answer) are labelled in red; a dotted line
    marks the first of them.
    """
    ticks = tick_positions(len(names))
    labels = [f"{i}: {names[i]}" if len(ticks) == len(names) else str(i) for i in ticks]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=TEXT["ticks"])
    ax.set_yticks(ticks, labels, fontsize=TEXT["ticks"])
    for i, label in zip(ticks, ax.get_yticklabels(), strict=True):
        if scored[i]:
            label.set_color("C3")
    if scored.any():
        first = int(np.argmax(scored)) - 0.5
        ax.axhline(first, color="white", ls=":", lw=1)
    ax.set_xlabel("position read (key)", fontsize=TEXT["axes"])
    ax.set_ylabel("position reading (query)", fontsize=TEXT["axes"])


def _wrap(text: str, width_in: float, fontsize: float, *, bold: bool = False) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize`` points (DejaVu Sans)."""
    em = 0.61 if bold else 0.55  # a character's mean width, in points per point of size
    return textwrap.fill(text, width=max(20, int(width_in * 72 / (em * fontsize))))


def _text_height(text: str, fontsize: float) -> float:
    """The height in inches of ``text``'s lines at ``fontsize`` points, with a little room."""
    return (text.count("\n") + 1) * fontsize * 1.3 / 72 + 0.12


def _layer_row(
    row: SubFigure, layer: int, weights: np.ndarray, role: LayerRole, labels: list[str], scored: np.ndarray
) -> None:
    """One layer's heads side by side in subfigure ``row``, each titled with its layer, head and role."""
    axes = row.subplots(1, weights.shape[0], squeeze=False)[0]
    panel_in = row.get_figure(root=True).get_size_inches()[0] / len(axes) - 1.0
    for h, ax in enumerate(axes):
        image = ax.imshow(weights[h], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(_wrap(f"layer {layer}, head {h}: {role.title}", panel_in, TEXT["panel"]), fontsize=TEXT["panel"])
        _label_axes(ax, labels, scored)
    row.colorbar(image, ax=axes, shrink=0.8).set_label("attention weight", fontsize=TEXT["axes"])


NOTE = (  # under the title of attention.png
    "A model that solves it shows: {pattern}. How to read a panel: row t is the position reading, the columns are the positions it reads (t and "
    "before); brighter is more weight, and each row sums to 1. {labels} Red row labels, from the dotted line "
    "down: the positions whose next token is scored (the answers)."
)


def attention_figure(task: Task, tokens: np.ndarray, scored: np.ndarray, weights: list[np.ndarray]) -> Figure:
    """Attention weights of every layer and head on one example, each layer's expected role spelled out.

    ``tokens`` ``(L,)`` is the example's input, ``scored`` ``(L,)`` which positions' next tokens the
    loss counts, ``weights`` per layer ``(H, L, L)`` (query rows, key columns). The title says what
    the task asks (``task.rule``) and what a solution shows (``task.pattern``); above each layer's
    row a line says what that layer is expected to do, and each panel is titled with its layer,
    head and that role (``task.roles``, written next to each task in ``train/tasks.py``).
    """
    names = task.token_names()
    labels = [names[t] for t in tokens]
    length, heads = len(labels), weights[0].shape[0]
    panel = max(0.19 * length, 3.0) if length <= TOKEN_LABELS else 5.0
    width = heads * (panel + 1.3) + 1.0
    roles = task.roles(len(weights))
    labels_note = "Labels are 'position: token'." if length <= TOKEN_LABELS else "Labels are positions."
    title = _wrap(f"{task.name}, a held-out example: {task.rule}.", width - 0.2, TEXT["title"], bold=True)
    note = _wrap(NOTE.format(pattern=task.pattern, labels=labels_note), width - 0.2, TEXT["axes"])
    lines = [_wrap(f"layer {i}: {r.detail}", width - 0.2, TEXT["layer"], bold=True) for i, r in enumerate(roles)]
    heights = [_text_height(title, TEXT["title"]), _text_height(note, TEXT["axes"])]
    for line in lines:  # a line saying what the layer is expected to do, then its row of heads
        heights += [_text_height(line, TEXT["layer"]), panel + 1.8]
    fig = plt.figure(figsize=(width, sum(heights)), layout="constrained")
    subs = fig.subfigures(len(heights), 1, height_ratios=heights)
    subs[0].text(0.005, 0.5, title, fontsize=TEXT["title"], va="center", weight="bold")
    subs[1].text(0.005, 0.5, note, fontsize=TEXT["axes"], va="center")
    for i, (w, role, line) in enumerate(zip(weights, roles, lines, strict=True)):
        subs[2 + 2 * i].text(0.005, 0.5, line, fontsize=TEXT["layer"], va="center", weight="bold")
        _layer_row(subs[3 + 2 * i], i, np.asarray(w), role, labels, scored)
    return fig


def attention_maps(exp: Experiment, params, path: Path) -> None:
    """Draws :func:`attention_figure` for one held-out example of ``exp``'s task into ``path``."""
    batch = exp.task.batch(exp.eval_key, 1)
    _, weights = exp.model(params)(batch.inputs, return_weights=True)  # layers x (1, H, L, L)
    fig = attention_figure(
        exp.task, np.asarray(batch.inputs[0]), np.asarray(batch.mask[0]), [np.asarray(w[0]) for w in weights]
    )
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
