"""Nothing silent: run-directory faults, config keys, progress bar, pictures.

Every fault is provoked in a temporary run directory; every library call that could hang runs in
a thread with a time limit, every command in a subprocess with a timeout.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import train.__main__ as cli
from train import config, loop, plots, rundir
from train.checkpoints import CheckpointError, DamagedCheckpointWarning
from train.rundir import MetricsError, RunError
from train.tasks import TASKS, Induction, Reverse

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 120  # seconds: generous on 2 shared cores, far below "hangs forever"

TINY = {
    "name": "tiny",
    "steps": 40,
    "warmup_steps": 5,
    "log_every": 10,
    "eval_every": 20,
    "checkpoint_every": 10,
    "batch_size": 8,
    "eval_batches": 1,
    "control": False,
    "model.d_model": 16,
    "model.num_heads": 1,
    "model.num_layers": 1,
}


def overrides(workdir: Path, **changes) -> list[str]:
    return [f"--config.{k}={v}" for k, v in ({**TINY, "workdir": workdir} | changes).items()]


def tiny(workdir: Path, **changes):
    return config.override(config.load(), overrides(workdir, **changes))


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread; fails the test if it runs past ``seconds`` (a hang)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def train(cfg, **kwargs) -> dict:
    return within(LIMIT, loop.train, cfg, progress=False, pictures=False, **kwargs)


def rows(workdir: Path) -> list[tuple]:
    """The numbers of metrics.jsonl (all but the timing)."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["acc"], r.get("eval")) for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 40-step run (checkpoints 30 and 40); tests copy it before changing it."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train(tiny(workdir))
    return workdir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    return workdir


def snapshot(workdir: Path) -> dict[str, bytes]:
    return {name: (workdir / name).read_bytes() for name in ("config.json", "metrics.jsonl")}


# -- resuming ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model.d_model": 32}, "model.d_model 16 -> 32"),
        ({"seed": 1}, "seed 0 -> 1"),
        ({"model.positions": "alibi"}, "model.positions 'learned' -> 'alibi'"),
        ({"learning_rate": 0.003}, "learning_rate 0.001 -> 0.003"),
        ({"task.num_pairs": 4, "task.num_queries": 4}, "task.num_pairs 8 -> 4; task.num_queries 8 -> 4"),
    ],
)
def test_resuming_another_run_is_refused_and_the_old_run_stays_intact(run, change, named):
    before = snapshot(run)
    with pytest.raises(RunError) as error:
        train(tiny(run, **change))
    message = str(error.value)
    assert "\n" not in message and named in message and "--config.resume=False" in message
    assert snapshot(run) == before  # config.json and metrics.jsonl untouched
    _, _, step = loop.restore(run)  # train.eval still reads the old run
    assert step == 40


def test_resume_false_moves_the_old_run_aside_and_starts_afresh(run):
    summary = train(tiny(run, resume=False, seed=1, steps=10, eval_every=10))
    aside = run.with_name("run.old-1")
    assert summary["moved_aside"] == str(aside) and summary["step"] == 10
    assert json.loads((aside / "config.json").read_text())["seed"] == 0  # the old run, whole
    assert [r[0] for r in rows(aside)] == [10, 20, 30, 40]
    assert json.loads((run / "config.json").read_text())["seed"] == 1
    assert [r[0] for r in rows(run)] == [10]


def test_a_resumed_run_may_run_longer_and_log_differently(run, finished):
    summary = train(tiny(run, steps=50, eval_every=50, checkpoint_every=50))
    assert summary["step"] == 50
    assert rows(run)[:4] == rows(finished) and rows(run)[4][0] == 50
    assert json.loads((run / "config.json").read_text())["steps"] == 50


def test_a_run_continued_from_an_odd_step_keeps_its_cadence(tmp_path):
    """Continued from step 23, its chunks end on multiples of log_every: evals and checkpoints at 30, 40, 50."""
    workdir = tmp_path / "run"
    train(tiny(workdir, steps=23, eval_every=10, checkpoint_every=10, log_every=5, warmup_steps=2))
    train(tiny(workdir, steps=60, eval_every=10, checkpoint_every=10, log_every=5, warmup_steps=2))
    steps = [r[0] for r in rows(workdir)]
    assert steps == [5, 10, 15, 20, 23, 25, 30, 35, 40, 45, 50, 55, 60]
    assert [r[0] for r in rows(workdir) if r[3] is not None] == [10, 20, 23, 30, 40, 50, 60]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-2:] == [50, 60]  # the newest kept (before: 23 and 60)


@pytest.mark.parametrize("entry", ["train.eval", "train.sample"])
def test_a_bad_example_count_is_named(entry, finished, capsys):
    """``--examples`` 0, -1 and 'two': status 2 and one line naming the flag, no traceback; the command as users run
    it (a subprocess) for one value, its ``main`` in this process for the others (the same parser and exit)."""
    module = importlib.import_module(entry)
    for count in ("0", "-1", "two"):
        got = {"0": "0", "-1": "-1", "two": "'two'"}[count]
        if count == "two":
            done = subprocess.run(
                [sys.executable, "-m", entry, "--run", str(finished), "--examples", count],
                capture_output=True, text=True, timeout=LIMIT, cwd=ROOT,
            )  # fmt: skip
            code, err = done.returncode, done.stderr
        else:
            with pytest.raises(SystemExit) as exit_:
                module.main(["--run", str(finished), "--examples", count])
            code, err = exit_.value.code, capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, (count, err)
        assert f"argument --examples: must be a positive int, got {got}" in err


def test_an_interrupted_control_says_so_and_the_verdict_lists_only_drawn_pictures(tmp_path, monkeypatch, capsys):
    cfg = tiny(tmp_path / "run", control=True)
    main = {"moved_aside": None, "interrupted": False, "lengths": [], "workdir": str(tmp_path / "run")}
    calls = iter([main, {"interrupted": True, "step": 7}])
    monkeypatch.setattr(loop, "train", lambda *a, **k: next(calls))
    assert cli.run(cfg, progress=False) == 130
    assert (
        "interrupted the control at step 7: checkpoint saved; run the same command to resume" in capsys.readouterr().out
    )
    monkeypatch.setattr(loop, "verdict", lambda *a: "verdict")
    for mixer, pictures in [("attention", "curves.png, attention.png"), ("linear", "curves.png")]:
        monkeypatch.setattr(loop, "train", lambda *a, **k: main)
        assert cli.run(tiny(tmp_path / "run", **{"model.mixer": mixer}), progress=False) == 0
        assert f"(metrics.jsonl, {pictures}, checkpoints/)" in capsys.readouterr().out


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match=r"holds files but no config\.json"):
        train(tiny(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "", ".hidden"])
def test_run_names_stay_inside_runs(name, capsys, monkeypatch):
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"--config.name={name}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'name'" in err and repr(name) in err


# -- checkpoints ---------------------------------------------------------------------------------


def test_checkpoints_that_is_a_file_stops_the_command_at_once_in_one_line(run):
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a directory")
    before = snapshot(run)
    cmd = [sys.executable, "-m", "train", "--quiet", *overrides(run)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"checkpoint directory {run / 'checkpoints'} is not a directory" in proc.stderr
    assert snapshot(run) == before  # metrics.jsonl not truncated, config.json not rewritten


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_checkpoints_stop_the_run_at_once(run):
    (run / "checkpoints").chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="cannot write checkpoints to"):
            train(tiny(run, steps=60))
    finally:
        (run / "checkpoints").chmod(0o755)


def test_a_failing_background_save_stops_the_run_at_once(tmp_path):
    checkpoints = tmp_path / "checkpoints"

    def break_checkpoints(step):  # after the save of step 10 has started in the background
        for _ in range(100 if step == 20 else 0):
            shutil.rmtree(checkpoints, ignore_errors=True)
            try:  # the save in flight may make the directory again in between: retry
                checkpoints.write_text("the disk went away")
                break
            except IsADirectoryError:
                continue
        return False

    with pytest.raises(CheckpointError) as error:
        train(tiny(tmp_path), should_stop=break_checkpoints)
    assert "\n" not in str(error.value) and str(checkpoints) in str(error.value)


def damage(step_dir: Path, how: str) -> None:
    if how == "empty":
        shutil.rmtree(step_dir)
        step_dir.mkdir()
    elif how == "partial":
        (step_dir / "default" / "_METADATA").unlink()
    else:  # corrupted data
        for f in (step_dir / "default").rglob("d/*"):
            f.write_bytes(b"\0garbage" * 4)


@pytest.fixture
def reads_garbage():
    """Swallows orbax's late "Event loop is closed" errors after a failed TensorStore read.

    The reads of a damaged checkpoint that had not failed yet complete on TensorStore's threads
    after orbax has closed the event loop of the restore: library noise ("Exception ignored")
    after the error we report. They are swallowed here, waiting until none has come for 0.5 s,
    instead of landing in whichever test runs next.
    """
    late, previous = [time.monotonic()], sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
            late.append(time.monotonic())
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() - late[-1] < 0.5 and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.unraisablehook = previous


@pytest.mark.usefixtures("reads_garbage")
@pytest.mark.parametrize("how", ["empty", "partial", "corrupted"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(run, finished, how):
    damage(run / "checkpoints" / "40", how)
    (run / "summary.json").unlink()  # stopped before its summary: not complete, so the command resumes it
    with pytest.warns(DamagedCheckpointWarning, match="checkpoint step 40 .* cannot be read"):
        summary = train(tiny(run))
    assert summary["step"] == 40
    assert rows(run) == rows(finished)  # steps 31-40 again, the same numbers; step 40 logged once
    assert (run / "checkpoints.damaged" / "40").is_dir()
    _, _, step = loop.restore(run)
    assert step == 40


@pytest.mark.usefixtures("reads_garbage")
def test_no_readable_checkpoint_is_refused_in_one_line(run):
    damage(run / "checkpoints" / "30", "corrupted")
    damage(run / "checkpoints" / "40", "empty")
    (run / "summary.json").unlink()  # stopped before its summary: not complete, so the command resumes it
    before = snapshot(run)
    with pytest.raises(CheckpointError) as error, pytest.warns(DamagedCheckpointWarning):
        train(tiny(run))
    message = str(error.value)
    assert "\n" not in message and len(message) < 300
    assert f"no readable checkpoint in {run / 'checkpoints'} (steps 40, 30 are damaged)" in message
    assert snapshot(run) == before


# -- metrics -------------------------------------------------------------------------------------


def test_a_damaged_metrics_line_is_named_by_file_and_line(run):
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2][:25] + "\n"  # a torn write
    (run / "metrics.jsonl").write_text("".join(lines))
    before = snapshot(run)
    with pytest.raises(MetricsError) as error:
        train(tiny(run))
    assert str(error.value).startswith(f"{run / 'metrics.jsonl'} line 3 is damaged")
    assert snapshot(run) == before


def test_metrics_lines_are_appended_whole(tmp_path):
    log = rundir.MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1, "loss": 2.0})
    log.append({"step": 2, "loss": 1.0})
    assert log.read() == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
    assert log.keep_until(1, log.read()) == [{"step": 1, "loss": 2.0}]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


# -- the command line ----------------------------------------------------------------------------


def test_the_command_reports_another_run_in_one_line(run, capsys):
    with pytest.raises(SystemExit) as exit_info:
        within(LIMIT, cli.main, ["--quiet", *overrides(run, **{"model.num_layers": 2})])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.num_layers 1 -> 2" in err


def test_progress_bar_keeps_the_elapsed_time_at_80_columns():
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    bar = loop.progress_bar(console=console)
    bar.add_task("induction/attention", total=2000, completed=350, stats="loss 0.123 acc 0.456 48k tok/s")
    console.print(bar.make_tasks_table(bar.tasks))
    line = console.export_text().rstrip("\n")
    assert len(line) <= 80 and "\n" not in line
    assert re.search(r"350/2000 \d:\d\d:\d\d eta --:--", line), line
    assert "loss 0.123" in line


# -- what a newcomer trips over (issue #31) ---------------------------------------------------------

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


def test_every_config_key_has_one_description_and_none_is_stale():
    """Every key of every config file (and every field of every task) is in config.KEYS; KEYS names no other."""
    task_keys = {f"task.{f.name}" for task in TASKS.values() for f in dataclasses.fields(task)}
    known = set(config.flatten(config.load())) | task_keys
    for name in CONFIGS:
        for key in config.flatten(config.load(f"configs/{name}.py")):
            model_key = key.replace("control_model.", "model.", 1)
            assert model_key in config.KEYS, f"configs/{name}.py: {key} has no description"
    assert task_keys <= set(config.KEYS)
    assert set(config.KEYS) - known == {"control_model"}  # the group (its keys are model keys)


@pytest.mark.parametrize("name", ["default", "sort"])
def test_help_lists_each_key_with_the_config_files_default_and_its_meaning(name, capsys, monkeypatch):
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["--config", f"configs/{name}.py", "--help"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the meanings are wrapped over lines
    assert f"(defaults of configs/{name}.py)" in out
    for key, value in config.flatten(config.load(f"configs/{name}.py")).items():
        assert re.search(rf"^  {re.escape(f'{key} = {value!r}')}( |$)", out, re.MULTILINE), key
        assert " ".join(config.describe(key).split()) in flat, key
    assert max(map(len, out.splitlines())) <= 100


@pytest.mark.parametrize(
    ("arg", "nearest"),
    [
        ("--config.step=5", "did you mean 'steps'?"),
        ("--config.model.d_mdoel=32", "did you mean 'model.d_model'?"),
        ("--config.d_model=32", "did you mean 'model.d_model'?"),
        ("--config.modle.d_model=32", "did you mean 'model.d_model'?"),
        ("--config.warmup=5", "did you mean 'warmup_steps'?"),
        ("--config.mesh.dat=2", "did you mean 'mesh.data'?"),
    ],
)
def test_an_unknown_key_is_answered_with_the_nearest(arg, nearest, capsys, monkeypatch):
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.rstrip().endswith(nearest), err


def test_unknown_keys_of_config_files_are_answered_with_the_nearest():
    cfg = config.load("configs/sort.py")
    with cfg.unlocked():
        cfg.stepz = 5
    with pytest.raises(config.ConfigError, match=r"unknown config key 'stepz' \(value 5\); did you mean 'steps'\?$"):
        config.validate(cfg)
    cfg = config.load("configs/sort.py")
    with cfg.unlocked():
        cfg.task.sise = 4
    with pytest.raises(config.ConfigError, match=r"'task.sise' for task 'sort' .*; did you mean 'task.size'\?$"):
        config.validate(cfg)
    assert config.did_you_mean("zzz", config.flatten(cfg)) == ""  # nothing near: no guess


def parsed(argv: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """The config ``python -m train argv`` would train, and what it printed (nothing is trained)."""
    got = []

    def run(cfg, **kwargs) -> int:
        got.append(cfg)
        return 0

    monkeypatch.setattr(cli, "run", run)
    assert cli.main(argv) == 0
    return got[0], capsys.readouterr().out


@pytest.mark.parametrize(("name", "steps"), [("sort", 200), ("default", 150), ("alibi", 7)])
def test_a_short_run_scales_the_warmup_it_did_not_set_to_the_files_fraction(name, steps, monkeypatch, capsys):
    file = config.load(f"configs/{name}.py")
    cfg, out = parsed(["--config", f"configs/{name}.py", f"--config.steps={steps}"], monkeypatch, capsys)
    assert cfg.warmup_steps == file.warmup_steps * steps // file.steps < steps
    assert out.count("\n") == 1 and f"scaled to {cfg.warmup_steps}," in out and "--config.warmup_steps" in out
    again, _ = parsed(["--config", f"configs/{name}.py", f"--config.steps={steps}"], monkeypatch, capsys)
    assert again.to_dict() == cfg.to_dict()  # the same command, the same run
    cfg, out = parsed(
        ["--config", f"configs/{name}.py", f"--config.steps={file.warmup_steps + 1}"], monkeypatch, capsys
    )
    assert cfg.warmup_steps == file.warmup_steps and out == ""  # fits: kept, no note


def test_an_explicit_warmup_not_below_steps_names_the_flag(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", "configs/sort.py", "--config.steps=200", "--config.warmup_steps=300"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "'warmup_steps'=300 must be below 'steps'=200: pass --config.warmup_steps=N with N < 200" in err


def test_a_scaled_warmup_resumes_and_continuing_names_its_flag(tmp_path, monkeypatch, capsys):
    """The same command is the same run; more steps without the warm-up are refused with the flag to pass."""
    argv = ["--config", "configs/sort.py", f"--config.workdir={tmp_path}", "--config.steps=200"]
    cfg, _ = parsed(argv, monkeypatch, capsys)
    rundir.write_config(tmp_path, cfg)  # as a run of that command leaves it
    again, _ = parsed(argv, monkeypatch, capsys)
    assert rundir.plan(tmp_path, again) == "resume"
    longer, _ = parsed([*argv, "--config.steps=400"], monkeypatch, capsys)
    with pytest.raises(RunError, match=r"\(warmup_steps 20 -> 200\): .*pass --config.warmup_steps=20 to continue it"):
        rundir.plan(tmp_path, longer)
    kept, _ = parsed([*argv, "--config.steps=400", "--config.warmup_steps=20"], monkeypatch, capsys)
    assert rundir.plan(tmp_path, kept) == "resume"


def files(workdir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run directory: its bytes and modification time."""
    return {
        str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*") if p.is_file()
    }


def nothing_built(monkeypatch) -> None:
    for name in ("build", "make_train_chunk", "make_evaluate", "compare"):
        monkeypatch.setattr(loop, name, lambda *a, name=name, **k: pytest.fail(f"loop.{name} called"))


def test_a_complete_run_says_so_and_exits_at_once(run, capsys, monkeypatch):
    before = files(run)
    nothing_built(monkeypatch)
    assert within(LIMIT, cli.main, ["--quiet", *overrides(run)]) == 0
    out = capsys.readouterr().out
    assert f"{run.resolve()} is already complete at step 40 (--config.steps=40): nothing to train" in out
    assert "rerun with --config.steps=N for an N > 40" in out and "after 40 steps" in out  # and the verdict
    assert files(run) == before


def test_a_complete_run_trains_its_unfinished_control_then_both_are_complete(run, capsys, monkeypatch):
    before = {k: v for k, v in files(run).items() if k in ("config.json", "metrics.jsonl", "summary.json")}
    assert within(LIMIT, cli.main, ["--quiet", *overrides(run, control=True)]) == 0
    out = capsys.readouterr().out
    assert "already complete" not in out and "the control (mixer=none, positions=learned) reaches" in out
    assert [r[0] for r in rows(run / "control")] == [10, 20, 30, 40]
    assert all(files(run)[k] == v for k, v in before.items())  # the run itself: nothing trained
    nothing_built(monkeypatch)
    assert within(LIMIT, cli.main, ["--quiet", *overrides(run, control=True)]) == 0
    assert f"{run.resolve()} and its control are already complete at step 40" in capsys.readouterr().out


def test_the_files_of_a_run_share_one_mode(finished, tmp_path):
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in finished.iterdir() if p.is_file()}
    assert {"config.json", "metrics.jsonl", "summary.json"} <= set(modes)
    assert len(set(modes.values())) == 1, modes
    old = os.umask(0o022)
    try:
        rundir.write_atomic(tmp_path / "atomic.json", "{}\n")
        (tmp_path / "plain.json").write_text("{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "atomic.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o644


# -- pictures ------------------------------------------------------------------------------------


def test_curves_draw_the_run_and_its_control_on_the_same_axes(tmp_path, finished):
    path = tmp_path / "curves.png"
    log = rundir.MetricsLog(finished / "metrics.jsonl").read()
    plots.curves({"attention": log, "control (no attention)": log[:2]}, path, chance=0.1, title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tasks_say_what_their_attention_pattern_looks_like():
    assert Reverse(size=8).pattern == "an anti-diagonal: answer position t reads position 15-t"
    assert "previous occurrence" in Induction(size=12).pattern and "t-11" in Induction(size=12).pattern
