"""The training program: data generators, a tiny end-to-end run, bit-identical resume, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn.nnx
import train.__main__ as cli
import train.eval
from tests.interrupt import interrupt_once_logged
from train import config, loop
from train.model import Decoder
from train.tasks import MQAR, Induction, Reverse, Sort

ROOT = Path(__file__).resolve().parent.parent


def tiny(tmp_path, **changes):
    cfg = config.load()
    overrides = dict(
        workdir=str(tmp_path),
        name="tiny",
        steps=60,
        warmup_steps=10,
        log_every=20,
        eval_every=60,
        checkpoint_every=20,
        batch_size=32,
        eval_batches=2,
        control=False,
    )
    overrides |= changes
    return config.override(cfg, [f"--config.{k}={v}" for k, v in overrides.items()])


# -- data ---------------------------------------------------------------------------------------


def _batch(task, n=64):
    b = task.batch(jax.random.key(3), n)
    return np.asarray(b.inputs), np.asarray(b.targets), np.asarray(b.mask)


def test_mqar_answers_are_the_values_bound_to_the_queried_keys():
    task = MQAR(num_pairs=5, num_queries=3, num_keys=9, num_values=7)
    x, y, m = _batch(task)
    assert x.shape == y.shape == m.shape == (64, task.length) == (64, 15)
    assert x.min() >= 0 and max(x.max(), y.max()) < task.vocab_size
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    for xi, yi, mi in zip(x, y, m, strict=True):
        keys, values = xi[0:10:2], xi[1:10:2]
        assert len(set(keys)) == 5 and keys.max() < 9 and values.min() >= 9
        answers = [10 + 2 * j for j in range(3)]  # input positions of the queries
        assert list(np.flatnonzero(mi)) == answers
        for p in answers:
            assert xi[p] in keys and yi[p] == values[list(keys).index(xi[p])]


def test_sort_reverse_induction_masks_cover_exactly_the_answer():
    x, y, m = _batch(Sort(size=6, vocab=3))
    seq = np.concatenate([x, y[:, -1:]], axis=1)
    np.testing.assert_array_equal(seq[:, 6:], np.sort(seq[:, :6], axis=1))
    np.testing.assert_array_equal(m, np.arange(11)[None].repeat(64, 0) >= 5)
    assert seq.max() < 3

    x, y, m = _batch(Reverse(size=4, vocab=5))
    seq = np.concatenate([x, y[:, -1:]], axis=1)
    assert np.all(seq[:, 4] == 5) and seq[:, :4].max() < 5
    np.testing.assert_array_equal(seq[:, 5:], seq[:, 3::-1])
    np.testing.assert_array_equal(m, np.arange(8)[None].repeat(64, 0) >= 4)

    x, y, m = _batch(Induction(size=5, vocab=7))
    seq = np.concatenate([x, y[:, -1:]], axis=1)
    np.testing.assert_array_equal(seq[:, 5:], seq[:, :5])
    np.testing.assert_array_equal(m, np.arange(9)[None].repeat(64, 0) >= 4)


def test_eval_stream_is_held_out_from_training_stream():
    exp = loop.build(tiny("/unused"))
    train_keys = {tuple(jax.random.key_data(jax.random.fold_in(exp.train_key, s)).tolist()) for s in range(500)}
    eval_keys = {tuple(jax.random.key_data(jax.random.fold_in(exp.eval_key, i)).tolist()) for i in range(8)}
    assert not train_keys & eval_keys


# -- training -----------------------------------------------------------------------------------


@pytest.mark.long
def test_tiny_sort_run_beats_chance_and_writes_its_run_directory(tmp_path):
    cfg = tiny(tmp_path, steps=300, eval_every=100, log_every=50, checkpoint_every=100, warmup_steps=30)
    with cfg.unlocked():
        cfg.task = config.load("configs/sort.py").task
    summary = loop.train(cfg, progress=False)
    assert summary["eval"]["token_acc"] > summary["chance"] + 0.4, summary
    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png", "attention.png"):
        assert (tmp_path / name).is_file(), name
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [50, 100, 150, 200, 250, 300]
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.long
def test_resume_is_bit_identical(tmp_path):
    straight = loop.train(tiny(tmp_path / "a"), progress=False, pictures=False)
    stopped = loop.train(tiny(tmp_path / "b"), progress=False, pictures=False, should_stop=lambda step: step >= 40)
    assert stopped["interrupted"] and stopped["step"] == 40
    resumed = loop.train(tiny(tmp_path / "b"), progress=False, pictures=False)
    assert resumed["step"] == straight["step"] == 60 and not resumed["interrupted"]
    rows = {d: (tmp_path / d / "metrics.jsonl").read_text() for d in "ab"}
    assert rows["a"].count("\n") == 3
    for a, b in zip(rows["a"].splitlines(), rows["b"].splitlines(), strict=True):
        a, b = json.loads(a), json.loads(b)
        assert (a["step"], a["loss"], a["acc"], a.get("eval")) == (b["step"], b["loss"], b["acc"], b.get("eval"))
    _, pa, _ = loop.restore(tmp_path / "a")
    _, pb, step = loop.restore(tmp_path / "b")
    assert step == 60
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(x, y)
    assert straight["eval"] == resumed["eval"]


def test_eval_entry_reloads_and_prints_examples(tmp_path, capsys):
    loop.train(tiny(tmp_path), progress=False, pictures=False)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["mesh"], saved["distributed"]  # a run made before these keys existed reloads with their defaults
    del saved["control_model"], saved["extrapolate"], saved["model"]["positions"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert train.eval.main(["--run", str(tmp_path), "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "at step 60: held-out token accuracy" in out
    assert out.count("input ") == 2 and out.count("target ") == 2 and out.count("pred ") == 2


def test_control_has_no_attention():
    exp = loop.build(config.override(config.load(), ["--config.model.mixer=none"]))
    model = exp.model(exp.init_params)
    kinds = {type(m) for _, m in nnx.iter_graph(model)}
    assert jattn.nnx.SelfAttention not in kinds and nnx.Linear in kinds


# -- command line -------------------------------------------------------------------------------

BAD_CONFIGS = [
    (["--config.model.foo=3"], "unknown config key 'model.foo'"),
    (["--config.nope=1"], "unknown config key 'nope'"),
    (["--config.task.name=parity"], "config key 'task.name': unknown task 'parity'"),
    (["--config.task.bogus=4"], "unknown config key 'task.bogus'"),
    (["--config.model.num_heads=3"], "config key 'model.num_heads'=3 does not divide 'model.d_model'=64"),
    (["--config.model.d_model=0"], "config key 'model.d_model' must be positive, got 0"),
    (["--config.batch_size=-4"], "config key 'batch_size' must be positive, got -4"),
    (["--config.task.num_pairs=0"], "config key 'task.num_pairs' must be positive, got 0"),
    (["--config.steps=many"], "config key 'steps': bad value 'many'"),
    (["--config.model.mixer=rnn"], "config key 'model.mixer': unknown mixer 'rnn'"),
    (["--config", "configs/missing.py"], "config file 'configs/missing.py' does not exist"),
    (["--config.name=../../x"], "config key 'name' must be one directory name inside runs/"),
    (["--config.resume=maybe"], "config key 'resume': bad value 'maybe'"),
    (["--config.seed=1.5"], "config key 'seed': bad value '1.5'"),
    (["--config.learning_rate=-1e-3"], "config key 'learning_rate' must be positive, got -0.001"),
    (["--config.weight_decay=nan"], "config key 'weight_decay'"),
    (["--config.model.positions=rope"], "config key 'model.positions': unknown positions 'rope'"),
    (["--config.control_model.mixer=rnn"], "the control (control_model={'mixer': 'rnn'}): config key 'model.mixer'"),
    (["--config.extrapolate=(2,)"], "config key 'extrapolate'=(2,): task 'mqar' has no longer version"),
    (["--config.extrapolate=(0,)"], "config key 'extrapolate' must be a tuple of integers >= 1, got (0,)"),
    (
        ["--config.model.mixer=linear", "--config.model.window=4"],
        "config key 'model.window'=4 needs softmax attention: 'model.mixer'='linear' takes the causal mask only",
    ),
    (["--config.control_model.d_model=32"], "on the command line control_model takes the keys its config file sets"),
    (
        ["--config.model.mixer=gated_deltanet", "--config.model.num_kv_heads=1"],
        "config key 'model.num_kv_heads'=1: 'model.mixer'='gated_deltanet' keeps a state per head",
    ),
    (
        ["--config.model.mixer=gla", "--config.model.window=4"],
        "config key 'model.window'=4 needs softmax attention: 'model.mixer'='gla' takes the causal mask only",
    ),
]


def test_config_flags_parse_a_file_and_typed_overrides():
    path = list(sys.path)
    argv = ["--config", "configs/gqa.py", "--config.steps", "5", "--config.model.global_tokens=(0, 3)"]
    cfg = config.parse(argv)
    assert (cfg.name, cfg.steps, cfg.model.num_kv_heads, cfg.model.global_tokens) == ("gqa", 5, 1, (0, 3))
    assert sys.path == path  # `from configs import default` resolves without editing sys.path
    for bad, named in [
        (["--config.steps=5.5"], "'steps': bad value '5.5'"),
        (["--config.x.y=1"], "'x'"),
        (["z"], "'z'"),
    ]:
        with pytest.raises(config.ConfigError, match=named) as info:
            config.parse(bad)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(("argv", "message"), BAD_CONFIGS)
def test_cli_rejects_bad_config_before_compiling(argv, message, capsys, monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(loop, "train", no_training)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.long
def test_sigint_saves_a_checkpoint_and_the_same_command_resumes(tmp_path):
    same = [f"--config.workdir={tmp_path}", "--config.control=False", "--config.warmup_steps=10"]
    cmd = [sys.executable, "-m", "train", "--quiet", *same]
    cmd += [
        "--config.steps=4000",
        "--config.log_every=10",
        "--config.eval_every=2000",
        "--config.checkpoint_every=2000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    out = interrupt_once_logged(proc, metrics, lines=2, wait=120)
    assert proc.returncode == 130, out
    step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 0 < step < 4000 and f"interrupted at step {step}" in out
    _, _, saved = loop.restore(tmp_path)
    assert saved == step  # the checkpoint is the last logged step: nothing lost
    longer = ["--config.steps=" + str(step + 20), "--config.eval_every=10", "--config.checkpoint_every=10"]
    resumed = config.override(config.load(), [*same, "--config.log_every=10", *longer])
    summary = loop.train(resumed, progress=False, pictures=False)  # the same run (steps and logging may change)
    assert summary["step"] == step + 20 and not summary["interrupted"]


# -- generation with the cache ------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"task.name": "'sort'"},
        {"task.name": "'reverse'"},
        {"task.name": "'induction'"},
        {"model.window": 3, "model.global_tokens": "(0,1)"},
        {"model.mixer": "linear"},
        {"model.num_heads": 4, "model.num_kv_heads": 1},
        {"model.positions": "alibi", "model.num_heads": 4},
    ],
)
def test_cached_greedy_decoding_equals_full_forward_greedy(changes):
    from train import sample

    cfg = config.load()
    if "task.name" in changes:
        name = changes.pop("task.name").strip("'")
        with cfg.unlocked():
            cfg.task = config.load(f"configs/{name}.py").task
    cfg = config.override(cfg, [f"--config.{k}={v}" for k, v in changes.items()])
    exp = loop.build(cfg)
    batch = exp.task.batch(jax.random.key(0), 3)
    cached = sample.greedy_cached(exp, exp.init_params, batch.inputs)
    full = sample.greedy_full(exp, exp.init_params, batch.inputs)
    assert cached.shape == (3, int(np.asarray(batch.mask[0]).sum()))
    np.testing.assert_array_equal(cached, full)


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["sort", "reverse", "induction", "window", "global_window", "linear", "gqa"])
def test_every_config_trains_in_the_tiny_setting(name, tmp_path):
    cfg = config.load(f"configs/{name}.py")
    tiny_cfg = tiny(tmp_path)
    with cfg.unlocked():
        for key in ("workdir", "name", "steps", "warmup_steps", "log_every", "eval_every", "checkpoint_every"):
            cfg[key] = tiny_cfg[key]
        cfg.batch_size, cfg.eval_batches = 32, 2
    summary = loop.train(cfg, progress=False, pictures=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["step"] == 60 and rows[-1]["loss"] < rows[0]["loss"]


def test_decoder_is_causal_gradient_reaches_only_the_past():
    exp = loop.build(config.load())
    tokens = exp.task.batch(jax.random.key(0), 1).inputs
    length = tokens.shape[1]
    reach = []
    for t in (0, 7, length - 1):

        def out_t(params, t=t):
            return jnp.sum(exp.model(params)(tokens)[0, t])

        grads = jax.grad(out_t)(exp.init_params)
        reach.append(np.abs(np.asarray(grads["pos"][...])).sum(-1) > 0)  # (L,) rows of the position table
    for t, r in zip((0, 7, length - 1), reach, strict=True):
        np.testing.assert_array_equal(r, np.arange(length) <= t)


def test_long_context_config_trains_on_the_blockwise_path(tmp_path):
    """configs/long_induction.py at a tiny size: blockwise attention (no (T, T) scores) and a falling loss."""
    cfg = config.load("configs/long_induction.py")
    assert cfg.model.implementation == "blockwise" and cfg.task.size * 2 >= 2048
    tiny_cfg = tiny(tmp_path)
    with cfg.unlocked():
        for key in ("workdir", "name", "steps", "warmup_steps", "log_every", "eval_every", "checkpoint_every"):
            cfg[key] = tiny_cfg[key]
        cfg.batch_size, cfg.eval_batches = 16, 2
        cfg.task.size, cfg.model.block_size = 24, 16  # T = 48 in tiles of 16
    exp = loop.build(cfg)
    tokens = exp.task.batch(jax.random.key(0), 2).inputs  # (2, 48)
    jaxpr = str(jax.make_jaxpr(lambda p: exp.model(p)(tokens))(exp.init_params))
    assert "scan[" in jaxpr and "48,48]" not in jaxpr
    summary = loop.train(cfg, progress=False, pictures=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["step"] == 60 and rows[-1]["loss"] < rows[0]["loss"]


def test_bad_attention_path_is_a_config_error():
    for key, value, message in (
        ("model.implementation", "flash", "'model.implementation'='flash'"),
        ("model.block_size", -1, "'model.block_size'"),
    ):
        cfg = config.override(config.load(), [f"--config.{key}={value}"])
        with pytest.raises(config.ConfigError, match=message):
            config.validate(cfg)


def test_cudnn_without_a_gpu_is_a_config_error_before_the_run_directory(tmp_path):
    """Checked once the backend starts (after a multi-process run joins), before anything is written."""
    cfg = config.override(
        config.load(), [f"--config.workdir={tmp_path / 'run'}", "--config.model.implementation=cudnn"]
    )
    config.validate(cfg)
    with pytest.raises(
        config.ConfigError, match=r"'model.implementation'='cudnn' needs an NVIDIA GPU; this backend is 'cpu'"
    ):
        loop.train(cfg, progress=False)
    assert not (tmp_path / "run").exists()


# -- positions: ALiBi against a learned table, past the training length ---------------------------


def test_bad_positions_is_a_config_error():
    cfg = config.load("configs/alibi.py")
    for changes, message in (
        ({"model.positions": "rope"}, "config key 'model.positions': unknown positions 'rope'; choose from"),
        ({"model.mixer": "linear"}, "'model.positions'='alibi' needs softmax attention: 'model.mixer'='linear'"),
        ({"control_model.positions": "rope"}, r"the control \(control_model=.*unknown positions 'rope'"),
    ):
        bad = cfg.copy_and_resolve_references()
        for key, value in changes.items():
            group, name = key.split(".")
            bad[group][name] = value
        with pytest.raises(config.ConfigError, match=message):
            config.validate(bad)
    with pytest.raises(ValueError, match="positions must be one of"):
        Decoder(8, 8, d_model=8, num_heads=1, num_layers=1, positions="rope", rngs=nnx.Rngs(0))


@pytest.mark.heavy
@pytest.mark.long
def test_alibi_config_extrapolates_where_learned_positions_do_not(tmp_path):
    """configs/alibi.py scaled down (400 steps, 2L only): ALiBi keeps its accuracy at 2L, the table does not.

    The command as users run it, at XLA's default flags: its 800 steps took 64 s there against
    102 s with the fast-compile flags make test gives the rest of the suite (it names them in
    JATTN_FAST_XLA_FLAGS; other XLA flags pass through). Strict promotion as in the suite.
    """
    overrides = [
        f"--config.workdir={tmp_path}",
        "--config.steps=400",
        "--config.warmup_steps=40",
        "--config.learning_rate=5e-3",
        "--config.eval_every=400",
        "--config.checkpoint_every=400",
        "--config.eval_batches=2",
        "--config.extrapolate=(2,)",
    ]
    cfg = config.override(config.load("configs/alibi.py"), overrides)
    assert cfg.model.positions == "alibi" and cfg.control and dict(cfg.control_model) == {"positions": "learned"}
    fast = set(os.environ.get("JATTN_FAST_XLA_FLAGS", "").split())
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in fast)
    env = os.environ | {"XLA_FLAGS": flags, "JAX_NUMPY_RANK_PROMOTION": "raise", "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
    cmd = [sys.executable, "-m", "train", "--quiet", "--config", "configs/alibi.py", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "warning:" not in proc.stderr, proc.stderr  # the command prints each warning as one such line
    alibi = json.loads((tmp_path / "summary.json").read_text())
    learned = json.loads((tmp_path / "control" / "summary.json").read_text())
    assert (alibi["positions"], learned["positions"]) == ("alibi", "learned")
    (a1, a2), (l1, l2) = ([r["token_acc"] for r in s["lengths"]] for s in (alibi, learned))
    assert [r["length"] for r in alibi["lengths"]] == [r["length"] for r in learned["lengths"]] == [23, 47]
    assert l1 > 0.95 and a1 > 0.6, (alibi["lengths"], learned["lengths"])  # both learned the task at L
    assert a2 > 0.5 and l2 < 0.2 and a2 > l2 + 0.4, (alibi["lengths"], learned["lengths"])  # chance is 1/64
    assert (tmp_path / "lengths.png").is_file()
    assert f"{a2:.1%} at 47" in proc.stdout
