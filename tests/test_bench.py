"""The benchmark: its FLOP accounting (useful work counts only unmasked pairs), results and harness."""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from bench import __main__ as bench_main
from bench import gpu_targets, suite


@pytest.mark.parametrize(
    ("mask", "kept"),
    [
        ("none", lambda T, w: T * T),
        ("causal", lambda T, w: T * (T + 1) // 2),
        ("window", lambda T, w: sum(min(t, w) + 1 for t in range(T))),
        ("global", lambda T, w: sum(min(t, w) + 1 for t in range(T)) + sum(1 for t in range(T) if t > w)),
    ],
)
def test_density_counts_exactly_the_attended_pairs(mask, kept):
    case = suite.Case(B=2, N=3, T=37, D=8, mask=mask, window=5)
    assert case.density() == pytest.approx(kept(37, 5) / 37**2)
    assert case.flops() == pytest.approx(4 * 2 * 3 * 37 * 37 * 8 * case.density())
    assert suite.Case(2, 3, 37, 8, mask, "fwdbwd", 5).flops() == pytest.approx(3.5 * case.flops())


def test_save_writes_the_json_and_a_png_of_fake_timings(tmp_path):
    """The GPU run's writer on made-up timings: JSON round-trips, failed candidates are kept, the PNG is a PNG."""
    results = [
        {
            "case": {**dataclasses.asdict(suite.Case(1, 16, T, 128, mask, mode, dtype="bfloat16"))},
            "timings": {
                "jattn-pallas": {"ms": T / 1000, "gflops": 1.0, "first_call_s": 0.1, "temp_mib": 0.0},
                "torch": {"ms": T / 900, "gflops": 1.0, "first_call_s": 0.1, "temp_mib": float("nan")},
                "jattn-cudnn": {"error": "ValueError: no GPU"},
            },
        }
        for T in (2048, 4096)
        for mask in ("none", "causal")
        for mode in ("fwd", "fwdbwd")
    ]
    path, png = suite.save(results, 123.0, tmp_path / "out")
    back = json.loads(path.read_text())
    assert back["matmul_gflops"] == 123.0 and len(back["results"]) == 8
    assert back["results"][3]["timings"]["jattn-cudnn"] == {"error": "ValueError: no GPU"}
    assert back["results"][7]["timings"]["jattn-pallas"]["ms"] == pytest.approx(4.096)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_preset_and_script():
    """``--gpu`` swaps in the preset (bf16, T = 2048..32768, the issue's candidates); gpu.sh parses."""
    args = bench_main.gpu_args(argparse.Namespace(T=[512], dtype="float32", repeats=3, out="x", module=False))
    assert args.T == [2048, 4096, 8192, 16384, 32768] and args.dtype == "bfloat16" and args.repeats == 3
    assert args.modes == ["fwd", "fwdbwd"]
    assert set(args.candidates) == {"jattn", "jattn-pallas", "jattn-cudnn", "jattn-blockwise", "jax.nn-cudnn", "torch"}
    assert set(args.candidates) <= set(suite.CANDIDATES)
    script = Path(__file__).parents[1] / "bench" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    with pytest.raises(SystemExit):  # no GPU here: --gpu refuses before timing anything
        bench_main.main(["--gpu"])


@pytest.mark.parametrize("kind", ["window_softcap", "documents"])
def test_gpu_targets_give_flex_attention_the_same_mask_and_score_mod(kind):
    """bench.gpu_targets' PyTorch mask_mod and score_mod (on CPU here) equal jattn's mask and score mod, densely."""
    torch = pytest.importorskip("torch")
    T = 2048
    mask, kw = gpu_targets.jattn_call(T, kind)
    mask_mod, score_mod = gpu_targets.flex_mods(T, kind, device="cpu")
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    np.testing.assert_array_equal(mask_mod(0, 0, i, j).numpy(), np.asarray(mask.dense(T, T)).reshape(T, T))
    s = np.linspace(-120.0, 120.0, 101)
    ours = np.asarray(kw["score_mod"](jnp.asarray(s), 0, 0, 0, 0)) if kw else s
    theirs = score_mod(torch.tensor(s), 0, 0, 0, 0).numpy() if score_mod is not None else s
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-4)
    assert kind != "window_softcap" or np.abs(ours).max() < gpu_targets.CAP  # the cap bites


def test_a_failing_candidate_is_recorded_not_fatal():
    """jax.nn's cuDNN path cannot run on CPU: run_case keeps its error and times the rest."""
    timings = suite.run_case(suite.Case(1, 1, 16, 8), ("jattn-dense", "jax.nn-cudnn"), repeats=1)
    assert timings["jattn-dense"]["ms"] > 0
    assert set(timings["jax.nn-cudnn"]) == {"error"}


def test_without_torch_the_run_says_so_first_and_records_it_per_case(monkeypatch, capsys, tmp_path):
    """torch not importable (None in sys.modules, as for a missing package): one line first, then each case's
    table and JSON keep the torch row with its error; the other candidates are timed as usual."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(suite, "matmul_peak", lambda: 100.0)
    monkeypatch.setenv("COLUMNS", "200")
    args = ["--T", "24", "40", "--B", "1", "--N", "2", "--D", "8", "--masks", "causal", "--repeats", "1"]
    assert bench_main.main([*args, "--candidates", "jattn-dense", "torch", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("torch not installed (") and "left out; pip install torch==2.13.0 to compare" in first
    assert out.count("torch not installed") == 3  # the line, then the torch row of each of the 2 tables
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["case"]["T"] for r in results] == [24, 40]
    for r in results:
        assert r["timings"]["torch"] == {"error": "ModuleNotFoundError: torch not installed"}
        assert r["timings"]["jattn-dense"]["ms"] > 0
    assert bench_main.main([*args, "--candidates", "jattn-dense", "--out", str(tmp_path)]) == 0
    assert "not installed" not in capsys.readouterr().out  # torch not asked for: nothing said
    for special in ("--gqa", "--model"):  # the cases that time torch beside jattn refuse, naming why
        with pytest.raises(SystemExit) as exit_info:
            bench_main.main([special])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"{special} times PyTorch beside jattn, but torch not installed (" in err and "2.13.0" in err


def test_a_call_with_gigabytes_of_scratch_lets_the_memory_go_before_the_next(monkeypatch):
    events = []

    def fake(name, case):
        def run():
            events.append(name)

        run.temp_mib = {"dense": 16384.0, "blockwise": 6.0, "torch": float("nan")}[name]
        return run

    monkeypatch.setattr(suite, "candidate", fake)
    monkeypatch.setattr(suite.time, "sleep", lambda s: events.append(s))
    timings = suite.run_case(suite.Case(1, 2, 64, 8), ("blockwise", "dense", "torch"), repeats=2)
    pause = suite.SETTLE_S
    assert events == ["blockwise", "dense", pause, "torch"] + ["blockwise", "dense", pause, "torch"] * 2
    assert set(timings) == {"blockwise", "dense", "torch"}


def test_help_gives_every_option_a_meaning_and_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["--help"])
    assert exit_info.value.code == 0
    shown = "".join(capsys.readouterr().out.split())  # help text is wrapped over lines, hyphens too
    options = [a for a in bench_main.parser()._actions if a.option_strings != ["-h", "--help"]]
    assert len(options) == 20
    for action in options:
        assert action.help, action.option_strings
        assert "".join(f"{action.help} (default: {action.default})".split()) in shown, action.option_strings


def test_transforms_programs_compute_what_their_rows_say():
    """bench/transforms.py's jvp and HVP (blockwise) equal the same transformations of the dense path, at a small T."""
    from bench import transforms

    x = transforms.inputs(1, 2, 64, 8)
    (q, k, v), t = x[:3], x[3:]

    def dense(q, k, v):
        return jattn.attention(q, k, v, mask=jattn.masks.causal(), implementation="dense")

    def loss(q, k, v):
        return jnp.sum(jnp.sin(dense(q, k, v)))

    (_, tangent), (_, want) = transforms.PROGRAMS["jvp"]((q, k, v), t), jax.jvp(dense, (q, k, v), t)
    np.testing.assert_allclose(tangent, want, rtol=1e-4, atol=1e-5)
    hvp, want = (
        transforms.PROGRAMS["hvp (forward over reverse)"]((q, k, v), t),
        jax.jvp(jax.grad(loss, (0, 1, 2)), (q, k, v), t)[1],
    )
    for g, w in zip(hvp, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_the_model_bench_compares_the_same_model():
    """bench/model.py's PyTorch decoder has the jattn decoder's parameters, tensor by tensor (sizes, as a multiset)."""
    pytest.importorskip("torch")
    from flax import nnx

    from bench import model
    from train.model import Decoder

    ours = Decoder(
        model.VOCAB, 64, d_model=model.D_MODEL, num_heads=model.HEADS, num_layers=model.LAYERS, rngs=nnx.Rngs(0)
    )
    theirs = model._torch_decoder(64)
    sizes = sorted(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    assert sizes == sorted(p.numel() for p in theirs.parameters())


def test_the_step_profile_finds_the_attention_kernels_and_the_matmuls():
    """bench --model's profile of the jattn step (XLA's own trace, in a subprocess): the fused kernels and the
    matmuls are found, and the kinds add up to no more than the profiled step's wall time on every core (XLA may run
    independent operations at once)."""
    from bench import model

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the step has no fused kernels")
    kinds = model.step_profile(1, 1024, steps=2)  # T·S = 2^20: the automatic choice takes blockwise
    wall = kinds.pop("step (wall, profiled)")
    assert kinds["attention kernels (custom calls)"] > 0 and kinds["matmuls"] > 0
    assert 0 < sum(kinds.values()) <= wall * os.cpu_count()
    assert model.op_kind("copy_bitcast_fusion.7") == "layout copies (transposes)"
    assert model.op_kind("multiply_tanh_fusion") == "elementwise and reductions"


def test_the_compile_check_fails_a_kernel_over_its_shared_memory_or_spill_target():
    """bench/triton_compile.py's verdict on one kernel's statistics: the row's chips' limit and the spill targets."""
    from bench.triton_compile import SMEM_LIMIT, Config, problems

    def verdict(D, dtype, arch, **stats):
        return problems({"config": Config("plain", D, dtype, arch)}, {"shared": 0, "spill_st": 0, **stats})

    for arch, limit in SMEM_LIMIT.items():
        assert not verdict(64, "bfloat16", arch, shared=limit)
        assert verdict(64, "bfloat16", arch, shared=limit + 1)
    for D, dtype, allowed in ((64, "float16", 0), (128, "bfloat16", 0), (256, "bfloat16", 1024), (64, "float32", 1024)):
        assert not verdict(D, dtype, 90, spill_st=allowed)
        assert verdict(D, dtype, 90, spill_st=allowed + 4)
    assert verdict(64, "float32", 80, error="CalledProcessError: ptxas failed")
    assert problems({"config": Config("plain", 64, "float32", 80)}, None)


_PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'jattn_mosaic_dq_mosaic_gpu_kernel' for 'sm_{arch}a'
ptxas info    : Function properties for jattn_mosaic_dq_mosaic_gpu_kernel
    {stack} bytes stack frame, {spills} bytes spill stores, {loads} bytes spill loads
ptxas info    : Used {regs} registers, used 2 barriers, 1 bytes smem
"""


def test_the_mosaic_compile_check_reads_the_ptx_compilers_statistics_and_holds_each_kernel_to_its_ceiling():
    """bench/mosaic_compile.py: the statistics of a hand-written PTX compiler report, the arch it names, the
    pipeline failing before it; a kernel may spill what SPILLS records for it and no byte more (others: none)."""
    from bench.mosaic_compile import SPILLS, Config, problems, statistics

    text = _PTXAS.format(arch=90, stack=104, spills=108, loads=96, regs=251) + "JIT session error: Symbols not found"
    assert statistics(text, 90) == {"stack": 104, "spill_st": 108, "spill_ld": 96, "regs": 251}
    assert "not sm_100a" in statistics(text, 100)["error"]
    assert "no cubin" in statistics("error: 'nvvm.wgmma' op failed to verify", 90)["error"]
    assert "no regs" in statistics(text.replace("Used 251 registers", ""), 90)["error"]
    for variant, table in SPILLS.items():
        for (arch, kernel, D), ceiling in table.items():
            c = Config(variant, D, "bfloat16", arch)
            assert ceiling > 0 and not problems({"spill_st": ceiling}, c, kernel)
            assert problems({"spill_st": ceiling + 4}, c, kernel)
    plain = Config("plain", 128, "float16", 90)
    assert not problems({"spill_st": 0}, plain, "forward") and problems({"spill_st": 4}, plain, "forward")
    features = SPILLS["features"][(90, "dq", 128)]  # a ceiling by variant: plain dq spills nothing
    assert problems({"spill_st": features}, plain, "dq")
    assert not problems({"spill_st": features}, plain._replace(variant="features"), "dq")
    assert problems({"error": "no cubin"}, plain, "forward") == ["no cubin"]


@pytest.mark.parametrize(("t", "s", "bq", "bk"), [(100, 130, 64, 64), (130, 100, 32, 64), (77, 77, 64, 32)])
def test_the_jax_triton_route_classifies_tiles_and_computes_its_reference_as_jattn_does(t, s, bq, bk):
    """bench/jax_triton_route.py (run in venvs of its own): its tile kinds against jattn's causal mask, tile by
    tile (empty: no pair kept, full: every pair), and its float64 reference against jattn's dense path."""
    from bench import jax_triton_route as route

    keep = np.asarray(jattn.masks.causal().dense(t, s))  # bottom-right aligned, as the route's kernel
    kinds = route.kinds(t, s, bq, bk)
    assert kinds.shape == (-(-t // bq), -(-s // bk))
    for (i, j), kind in np.ndenumerate(kinds):
        tile = keep[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        assert kind == (0 if not tile.any() else 2 if tile.all() else 1), (i, j)
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((6, t, 16)), rng.standard_normal((2, s, 16)), rng.standard_normal((2, s, 16))
    o, lse = route.reference(q, k, v)
    with jax.enable_x64(True):
        qg, kg, vg = (
            jnp.asarray(q).reshape(1, 2, 3, t, 16),
            jnp.asarray(k)[None, :, None],
            jnp.asarray(v)[None, :, None],
        )
        want, want_lse = jattn.attention(qg, kg, vg, mask=jattn.masks.causal(), implementation="dense", return_lse=True)
    # the route's reference: row bn reads kv head bn // 3, as q (1, K=2, G=3) here; a row with no key: 0, -inf
    np.testing.assert_allclose(o, np.asarray(want).reshape(6, t, 16), atol=1e-12)
    np.testing.assert_allclose(lse, np.asarray(want_lse).reshape(6, t), atol=1e-12)
