"""The MQAR comparison of the linear-attention family (train/family.py): its table and, tiny, its ordering."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interrupt import interrupt_once_logged
from train import config as train_config
from train import family

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_has_a_row_a_model_and_a_column_a_number_of_pairs():
    results = {"attention": {16: {None: 1.0}, 8: {None: 0.99}}, "linear": {8: {None: 0.4321}, 16: {None: 0.25}}}
    assert family.table(results) == (
        "| model | 8 pairs | 16 pairs |\n|---|---|---|\n| attention | 99.0 | 100.0 |\n| linear | 43.2 | 25.0 |\n"
    )


def test_a_sweep_reports_the_best_finished_rate_beside_its_accuracy():
    results = {"deltanet": {8: {1e-3: 0.5, 3e-3: 0.91, 1e-2: None}, 64: {1e-3: None, 3e-3: None}}}
    assert family.table(results) == "| model | 8 pairs | 64 pairs |\n|---|---|---|\n| deltanet | 91.0 (0.003) | - |\n"
    assert family.best({1e-3: 0.2, 3e-3: 0.2}) == (1e-3, 0.2)  # a tie: the first rate tried
    assert family.best({1e-3: None}) is None


def test_every_recurrent_kind_of_jattn_is_in_the_comparison():
    import jattn

    assert set(family.MIXERS) == {"attention", "linear", *jattn.RECURRENT_KINDS}


def test_a_rate_of_the_sweep_is_its_own_run(tmp_path: Path):
    default = family.config("gla", 16, tmp_path)
    swept = family.config("gla", 16, tmp_path, lr=3e-3)
    assert (default.workdir, swept.workdir) == (str(tmp_path / "gla-16"), str(tmp_path / "gla-16-lr0.003"))
    assert swept.learning_rate == 3e-3 and default.learning_rate != 3e-3


def test_no_train_reads_back_finished_runs_only(tmp_path: Path):
    """A rate that never ran is "-" and nothing is trained: the run directories stay absent."""
    assert family.main(["--mixers", "linear", "--pairs", "8", "--learning-rates", "1e-3", "3e-3", "--no-train",
                        "--out", str(tmp_path), "--steps", "10"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "family.json").read_text()) == {"linear": {"8": {"0.001": None, "0.003": None}}}
    assert "| linear | - |" in (tmp_path / "family.md").read_text()
    assert not (tmp_path / "linear-8-lr0.001").exists()


@pytest.mark.parametrize("pairs, symbols", [(8, 32), (32, 32), (64, 64)])
def test_a_run_draws_every_pair_a_distinct_key_and_the_config_validates(tmp_path: Path, pairs: int, symbols: int):
    cfg = family.config("deltanet", pairs, tmp_path, steps=10)
    assert (cfg.task.num_pairs, cfg.task.num_queries, cfg.task.num_keys, cfg.task.num_values) == (
        pairs, pairs, symbols, symbols)  # fmt: skip
    assert cfg.workdir == str(tmp_path / f"deltanet-{pairs}")
    assert train_config.make_task(cfg).length == 4 * pairs - 1
    train_config.validate(cfg)


@pytest.mark.heavy
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
    acc = {m: row["8"]["config"] for m, row in json.loads((tmp_path / "family.json").read_text()).items()}
    assert acc["attention"] > acc["deltanet"] > acc["linear"] + 0.1, acc
    assert (tmp_path / "family.png").is_file()


@pytest.mark.heavy
def test_sigint_stops_the_comparison_at_a_checkpoint_and_reports_nothing_unfinished(tmp_path: Path):
    """Ctrl-C during the first run: status 130, its checkpoint saved, the next model not started, no table written."""
    cmd = [sys.executable, "-m", "train.family", "--mixers", "linear", "deltanet", "--pairs", "8"]
    proc = subprocess.Popen([*cmd, "--steps", "100000", "--out", str(tmp_path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    out = interrupt_once_logged(proc, tmp_path / "linear-8" / "metrics.jsonl", lines=1, wait=300)
    assert proc.returncode == 130, out
    assert "interrupted" in out and "run the same command to resume" in out
    assert list((tmp_path / "linear-8" / "checkpoints").iterdir())
    assert not (tmp_path / "deltanet-8").exists() and not (tmp_path / "family.json").exists()
