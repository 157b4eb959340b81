"""The MQAR comparison of the linear-attention family (train/family.py): its table and, tiny, its ordering."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train import config as train_config
from train import family

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_has_a_row_a_model_and_a_column_a_number_of_pairs():
    results = {"attention": {16: 1.0, 8: 0.99}, "linear": {8: 0.4321, 16: 0.25}}
    assert family.table(results) == (
        "| model | 8 pairs | 16 pairs |\n|---|---|---|\n| attention | 99.0 | 100.0 |\n| linear | 43.2 | 25.0 |\n"
    )


@pytest.mark.parametrize("pairs, symbols", [(8, 32), (32, 32), (64, 64)])
def test_a_run_draws_every_pair_a_distinct_key_and_the_config_validates(tmp_path: Path, pairs: int, symbols: int):
    cfg = family.config("deltanet", pairs, tmp_path, steps=10)
    assert (cfg.task.num_pairs, cfg.task.num_queries, cfg.task.num_keys, cfg.task.num_values) == (
        pairs, pairs, symbols, symbols)  # fmt: skip
    assert cfg.workdir == str(tmp_path / f"deltanet-{pairs}")
    assert train_config.make_task(cfg).length == 4 * pairs - 1
    train_config.validate(cfg)


@pytest.mark.long
def test_tiny_mqar_ranks_softmax_above_the_delta_rule_above_plain_linear(tmp_path: Path):
    """Zoology's finding at a size CI affords: softmax attention recalls best, the delta rule next, linear last.

    ``python -m train.family`` with 8 key-value pairs (configs/mqar_family.py: d_model 64, 2 layers, a short
    convolution) and 1000 steps a model, held-out per-token accuracy on the queries; run as users run it, at
    XLA's default flags (the fast-compile flags make test gives the suite, JATTN_FAST_XLA_FLAGS, made it 3x
    slower: 306 s).
    """
    fast = set(os.environ.get("JATTN_FAST_XLA_FLAGS", "").split())
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in fast)
    env = os.environ | {"XLA_FLAGS": flags, "JAX_NUMPY_RANK_PROMOTION": "raise", "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
    cmd = [sys.executable, "-m", "train.family", "--mixers", "attention", "deltanet", "linear", "--pairs", "8"]
    cmd += ["--steps", "1000", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    acc = {m: row["8"] for m, row in json.loads((tmp_path / "family.json").read_text()).items()}
    assert acc["attention"] > acc["deltanet"] > acc["linear"] + 0.1, acc
    assert (tmp_path / "family.png").is_file()
