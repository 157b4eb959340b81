"""The MQAR comparison of the linear-attention family (train/family.py): its table and, tiny, its ordering."""

from pathlib import Path

import pytest

from train import family


def test_the_table_has_a_row_a_model_and_a_column_a_number_of_pairs():
    results = {"attention": {16: 1.0, 8: 0.99}, "linear": {8: 0.4321, 16: 0.25}}
    assert family.table(results) == (
        "| model | 8 pairs | 16 pairs |\n|---|---|---|\n| attention | 99.0 | 100.0 |\n| linear | 43.2 | 25.0 |\n"
    )


@pytest.mark.long
def test_tiny_mqar_ranks_softmax_above_the_delta_rule_above_plain_linear(tmp_path: Path):
    """Zoology's finding at a size CI affords: softmax attention recalls best, the delta rule next, linear last.

    MQAR with 8 key-value pairs (configs/mqar_family.py: d_model 64, 2 layers, a short convolution) for
    STEPS steps each, held-out per-token accuracy on the queries.
    """
    acc = {m: family.accuracy(m, 8, tmp_path, steps=STEPS) for m in ("attention", "deltanet", "linear")}
    assert acc["attention"] > acc["deltanet"] > acc["linear"] + 0.1, acc


STEPS = 1000
