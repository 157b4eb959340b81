"""attention.png readable by a newcomer: titled panels, each layer's expected role, legible thinned ticks.

Pictures are drawn from synthetic weights (no model, no training) and checked through matplotlib's
objects: titles, tick labels and their sizes, never pixels.
"""

from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.axes import Axes

from train import config, plots
from train.tasks import MQAR, TASKS, Induction, Reverse, Sort, Task

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")
PANEL = re.compile(r"layer (\d+), head (\d+): (.*)", re.DOTALL)
MIN_POINTS = 8  # smallest readable text: 8 points is 12 pixels at the saved 110 dpi


def example(task: Task, layers: int, heads: int, seed: int = 0):
    """One sampled sequence of ``task`` and causal attention weights ``(H, L, L)`` per layer, rows summing to 1."""
    batch = task.batch(jax.random.key(seed), 1)
    tokens, scored = np.asarray(batch.inputs[0]), np.asarray(batch.mask[0])
    rng = np.random.default_rng(seed)
    n = len(tokens)
    causal = np.tril(np.ones((n, n), bool))
    weights = []
    for _ in range(layers):
        w = np.where(causal, rng.random((heads, n, n), dtype=np.float32), 0)
        weights.append(w / w.sum(-1, keepdims=True))
    return tokens, scored, weights


def panels(fig) -> dict[tuple[int, int], Axes]:
    """The heat-map axes of a figure (in all its subfigures), by ``(layer, head)`` read from their titles."""
    found = {}
    for ax in fig.findobj(Axes):
        match = PANEL.fullmatch(ax.get_title())
        if ax.images and match:
            found[int(match[1]), int(match[2])] = ax
    return found


def unwrapped(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def draw():
    """Draws :func:`plots.attention_figure` from synthetic weights and closes every figure afterwards."""

    def draw_(task: Task, layers: int = 2, heads: int = 2):
        tokens, scored, weights = example(task, layers, heads)
        return plots.attention_figure(task, tokens, scored, weights), tokens, scored

    yield draw_
    plt.close("all")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_panel_names_its_layer_head_and_the_layers_role(draw, name):
    task = TASKS[name]()
    fig, _, _ = draw(task, layers=2, heads=3)
    found = panels(fig)
    assert sorted(found) == [(i, h) for i in range(2) for h in range(3)]
    texts = [unwrapped(t.get_text()) for t in fig.findobj(plt.Text)]
    for i, role in enumerate(task.roles(2)):
        assert "no expected role" not in role.title
        for h in range(3):
            assert unwrapped(found[i, h].get_title()) == f"layer {i}, head {h}: {role.title}"
        assert f"layer {i}: {role.detail}" in texts  # the line above the layer's row
    assert any(task.rule in t for t in texts) and any(task.pattern in t for t in texts)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_labels_are_big_enough_and_do_not_overlap(draw, name):
    fig, tokens, _ = draw(TASKS[name]())
    fig.canvas.draw()
    for ax in panels(fig).values():
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            assert len(labels) == len(tokens)  # short sequences: every position labelled with its token
            assert min(label.get_fontsize() for label in labels) >= MIN_POINTS
            boxes = [label.get_window_extent() for label in labels]
            assert not any(a.overlaps(b) for a, b in itertools.pairwise(boxes))
        assert ax.title.get_fontsize() >= MIN_POINTS and ax.xaxis.label.get_fontsize() >= MIN_POINTS
    width, height = fig.bbox.width, fig.bbox.height  # pixels, as the labels' extents
    for text in fig.findobj(plt.Text):
        if text.get_text() and text.get_visible():
            assert text.get_fontsize() >= MIN_POINTS, text.get_text()
            box = text.get_window_extent()
            assert box.x0 >= -1 and box.x1 <= width + 1 and box.y0 >= -1 and box.y1 <= height + 1, text.get_text()


def test_tick_labels_read_position_and_token_and_mark_the_scored_rows_in_red(draw):
    task = MQAR()  # pairs at 0-15; queries (scored: their next token is the answer) at 16, 18, ..., 30
    fig, tokens, _ = draw(task)
    names = task.token_names()
    ax = panels(fig)[1, 0]
    labels = ax.get_yticklabels()
    assert [label.get_text() for label in labels] == [f"{i}: {names[t]}" for i, t in enumerate(tokens)]
    red = [i for i, label in enumerate(labels) if label.get_color() == "C3"]
    assert red == list(range(16, 31, 2))


def test_long_sequences_label_a_few_positions_on_a_figure_of_bounded_size(draw):
    task = Induction(size=1024, vocab=64)  # L = 2047, as configs/long_induction.py
    fig, tokens, _ = draw(task, layers=2, heads=2)
    assert max(fig.get_size_inches()) < 30  # not 0.18 inch per position
    for ax in panels(fig).values():
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            assert 5 <= len(labels) <= plots.TOKEN_LABELS // 2
            positions = [int(label.get_text()) for label in labels]  # numbers only, evenly spaced from 0
            assert positions[0] == 0 and len(set(np.diff(positions))) == 1 and positions[-1] < len(tokens)
            assert min(label.get_fontsize() for label in labels) >= MIN_POINTS


@pytest.mark.parametrize(("length", "step"), [(1, 1), (32, 1), (33, 5), (95, 10), (2047, 200), (10**6, 100_000)])
def test_tick_positions_every_position_up_to_32_then_a_round_step(length, step):
    ticks = plots.tick_positions(length)
    assert ticks == range(0, length, step)
    assert len(ticks) == length or len(ticks) <= plots.TOKEN_LABELS // 2


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_has_its_tasks_roles_for_its_number_of_layers(name):
    cfg = importlib.import_module(f"configs.{name}").get_config()
    task, layers = config.make_task(cfg), cfg.model.num_layers
    assert layers in task.layer_roles, f"{name}: {task.name} has no roles written for {layers} layers"
    roles = task.roles(layers)
    assert len(roles) == layers and all(r.title and r.detail for r in roles)
    assert max(len(r.title) for r in roles) <= 60  # a panel title, not a paragraph


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_says_what_one_layer_does_and_marks_undescribed_depths(draw, name):
    task = TASKS[name]()
    assert {1, 2} <= set(task.layer_roles)
    fig, _, _ = draw(task, layers=3, heads=1)
    titles = [unwrapped(ax.get_title()) for ax in panels(fig).values()]
    assert len(titles) == 3 and all(t.endswith("no expected role written") for t in titles)


def test_the_roles_positions_are_those_of_the_data():
    """Each role's offsets, checked against sequences the task samples: position t's answer is where it says."""
    batch = Induction(size=9, vocab=5).batch(jax.random.key(1), 16)
    k = int(re.search(r"t reads t-(\d+) by position", Induction(size=9).roles(1)[0].title)[1])
    t = np.flatnonzero(batch.mask[0])
    np.testing.assert_array_equal(batch.targets[:, t], batch.inputs[:, t - k])

    batch = Reverse(size=5, vocab=7).batch(jax.random.key(2), 16)
    c = int(re.search(r"reads position (\d+)-t", Reverse(size=5).roles(1)[0].title)[1])
    t = np.flatnonzero(batch.mask[0])
    np.testing.assert_array_equal(batch.targets[:, t], batch.inputs[:, c - t])


def test_the_rules_name_the_scored_positions():
    for task in (Sort(size=7), Reverse(size=5), Induction(size=9)):
        first = int(re.search(r"from (?:the '\|' \()?position (\d+)", task.rule)[1])
        assert first == np.flatnonzero(task.batch(jax.random.key(0), 1).mask[0])[0], task.rule
    task = MQAR(num_pairs=5, num_queries=4)
    scored = np.flatnonzero(task.batch(jax.random.key(0), 1).mask[0]).tolist()
    assert scored == [10, 12, 14, 16] and "query key (positions 10, 12, ..., 16)" in task.rule
    assert "query key (positions 4, 6)" in MQAR(num_pairs=2, num_queries=2).rule
