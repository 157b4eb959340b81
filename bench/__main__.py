"""``python -m bench``: jattn's attention paths against jax.nn, Flax and PyTorch SDPA.

The default is fast (a few minutes on 2 cores); options pick shapes, dtype, modes, masks and
candidates. Prints a table (ms, useful GFLOP/s counting only unmasked work, ratio to PyTorch and to
the measured matmul peak, first-call time, compiled scratch memory) and writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import suite


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench``: every option with its help and (in ``--help``) its default."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048], help="sequence lengths, one table each")
    p.add_argument("--B", type=int, default=4, help="batch size")
    p.add_argument("--N", type=int, default=8, help="attention heads")
    p.add_argument("--D", type=int, default=64, help="head dimension")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="q, k, v dtype")
    p.add_argument(
        "--modes", nargs="+", default=["fwd"], choices=["fwd", "fwdbwd"], help="forward, or forward + backward"
    )
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=suite.MASKS, help="masks to time")
    p.add_argument("--window", type=int, default=256, help="sliding-window size of the 'window' and 'global' masks")
    p.add_argument(
        "--candidates",
        nargs="+",
        default=["jattn", "jax.nn", "torch"],
        choices=suite.CANDIDATES,
        metavar="NAME",
        help="attention implementations to time, from: " + ", ".join(suite.CANDIDATES),
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per candidate (the median is shown)")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="split the CPU into this many JAX devices (jattn-sharded); None: JAX's own count",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="directory for the JSON and PNG")
    p.add_argument("--module", action="store_true", help="jattn.nnx.SelfAttention(512, 8 heads), causal: paths")
    p.add_argument(
        "--model",
        action="store_true",
        help="one adam step of a 2-layer d_model 256 decoder (train.model) against the same in PyTorch eager, "
        "with the step split into attention forward, backward and the rest (--B, default 4; --T, default 2048)",
    )
    p.add_argument("--gpu", action="store_true", help="the GPU preset (bench/gpu.sh): " + str(suite.GPU_PRESET))
    p.add_argument("--flex", action="store_true", help="blockwise forward with softcap, alibi, sinks vs plain (ratios)")
    p.add_argument(
        "--gqa",
        action="store_true",
        help="grouped-query (N=8, K=2) causal fwd+bwd against torch enable_gqa=True (T=4096), and whether k, v "
        "reach the kernels unrepeated",
    )
    p.add_argument("--packed", action="store_true", help="8 packed causal documents vs full causal, blockwise (T=8192)")
    p.add_argument(
        "--gated",
        action="store_true",
        help="gated_linear_attention fwd+bwd, chunkwise vs recurrent vs softmax causal (B=1, N=4, T=8192 and 32768)",
    )
    p.add_argument(
        "--transforms",
        action="store_true",
        help="jvp vs forward (T=16384), forward-over-reverse HVP vs forward+backward (T=8192), jvp peak RSS (T=32768)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.cpu_devices:  # before JAX's backend starts; every other candidate still runs on device 0
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.gpu:
        import jax

        if jax.default_backend() != "gpu":
            p.error(f"--gpu needs JAX on an NVIDIA GPU, got backend {jax.default_backend()!r}")
        args = gpu_args(args)

    console = Console()
    special = next((name for name in SPECIAL if getattr(args, name)), None)
    missing = suite.torch_missing()
    if missing is not None and special in NEEDS_TORCH:
        p.error(f"--{special} times PyTorch beside jattn, but {missing}; {suite.TORCH_INSTALL}")
    if missing is not None and special is None and "torch" in args.candidates:  # then each table and the JSON too
        line = f"{missing}: PyTorch SDPA is left out; {suite.TORCH_INSTALL} to compare"
        console.print(line, markup=False, soft_wrap=True)
    if special is not None:  # a case with its own table
        SPECIAL[special](console, args, p.get_default("T") == args.T)
        return 0
    peak = suite.matmul_peak()
    console.print(f"matmul peak (jitted float32 2048^3): {peak:.0f} GFLOP/s")
    results = []
    for mode in args.modes:
        for mask in args.masks:
            for T in args.T:
                case = suite.Case(args.B, args.N, T, args.D, mask, mode, args.window, args.dtype)
                timings = suite.run_case(case, tuple(args.candidates), args.repeats)
                results.append({"case": dataclasses.asdict(case), "timings": timings})
                table = Table(title=f"B={args.B} N={args.N} T={T} D={args.D} {args.dtype} mask={mask} {mode}")
                for col in (
                    "candidate",
                    "ms",
                    "GFLOP/s",
                    "x torch",
                    "x peak",
                    "first call s",
                    "compile s (CPU s)",
                    "scratch MiB",
                ):
                    table.add_column(col, justify="right")
                torch_ms = timings.get("torch", {}).get("ms")
                for name, t in timings.items():
                    if "ms" not in t:
                        table.add_row(name, t["error"][:60], *("-",) * 5)
                        continue
                    table.add_row(
                        name,
                        f"{t['ms']:.1f}",
                        f"{t['gflops']:.1f}",
                        f"{torch_ms / t['ms']:.2f}" if torch_ms else "-",
                        f"{t['gflops'] / peak:.2f}",
                        f"{t['first_call_s']:.2f}",
                        "-" if t["compile_s"] is None else f"{t['compile_s']:.2f} ({t['compile_cpu_s']:.2f})",
                        f"{t['temp_mib']:.0f}",
                    )
                console.print(table)
                path, png = suite.save(results, peak, args.out)  # after every case: nothing lost on Ctrl-C
    console.print(f"wrote {path} and {png}")
    return 0


def _transforms(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--transforms`` tables (:mod:`bench.transforms`); ``--T`` (if given) sets the jvp's length."""
    from bench import transforms

    T = 16384 if default_T else args.T[0]
    cases = (
        (f"jvp, causal, B=1 N=8 T={T} D=64", transforms.forward_mode_case, T),
        ("forward-over-reverse HVP, causal, B=1 N=8 T=8192 D=64", transforms.hvp_case, 8192),
    )
    for title, case, length in cases:
        r = case(length, repeats=args.repeats)
        table = Table(title=title)
        for col in ("program", "ms", "scratch MiB"):
            table.add_column(col, justify="right")
        for name, row in r.items():
            if name != "ratio":
                table.add_row(name, f"{row['ms']:.1f}", f"{row['temp_mib']:.0f}")
        console.print(table)
        console.print(f"time ratio: {r['ratio']['time']:.2f}")
    console.print(f"jvp T=32768 peak RSS of a whole process: {transforms.peak_rss('jvp', 32768):.2f} GiB")


def _model(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--model`` table (:mod:`bench.model`): step and its parts, jattn and torch, and their ratio."""
    from bench import model

    for T in [2048] if default_T else args.T:
        rows = model.model_case(args.B, T, args.repeats)
        table = Table(title=f"decoder training step (2 layers, d_model 256, 4 heads, causal, adam), B={args.B} T={T}")
        parts = ("step", "attention fwd", "attention bwd", "rest")
        for col in ("framework", *(f"{p} ms" for p in parts)):
            table.add_column(col, justify="right")
        for fw, r in rows.items():
            table.add_row(fw, *(f"{r[p]:.1f}" for p in parts))
        table.add_row("torch / jattn", *(f"{rows['torch'][p] / rows['jattn'][p]:.2f}" for p in parts))
        console.print(table)
        table = Table(title=f"the rest, operation by operation (all layers, forward + backward), B={args.B} T={T}")
        for col in ("operation", "jattn (JAX) ms", "torch ms", "torch / jattn"):
            table.add_column(col, justify="right")
        for op, r in model.rest_case(args.B, T, args.repeats).items():
            table.add_row(op, f"{r['jattn']:.1f}", f"{r['torch']:.1f}", f"{r['torch'] / r['jattn']:.2f}")
        console.print(table)
        console.print(_step_profile_table(model, args.B, T))


def _step_profile_table(model, B: int, T: int) -> Table:
    """Where each framework's step goes by kind of operation, from XLA's and PyTorch's profilers."""
    ours, theirs = model.step_profile(B, T), model.torch_step_profile(B, T)
    table = Table(title=f"the whole step by kind of operation (profiled, ms a step), B={B} T={T}")
    for col in ("kind", "jattn (XLA:CPU) ms", "torch ms"):
        table.add_column(col, justify="right")
    kinds = [kind for kind, _ in model.OP_KINDS] + ["elementwise and reductions"]
    for kind in kinds:
        table.add_row(kind, f"{ours.get(kind, 0.0):.1f}", f"{theirs.get(kind, 0.0):.1f}")
    wall = "step (wall, profiled)"
    for name, r in (("step minus the kinds (they may overlap)", None), (wall, wall)):
        cells = [p[r] if r else p[wall] - sum(p.get(k, 0.0) for k in kinds) for p in (ours, theirs)]
        table.add_row(name, *(f"{c:.1f}" for c in cells))
    return table


def _flex(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--flex`` tables: the blockwise causal forward with score modifications against the plain one."""
    for T in args.T:
        rows = suite.flex_case(T, args.B, args.N, args.D, args.repeats)
        table = Table(title=f"blockwise causal forward, B={args.B} N={args.N} T={T} D={args.D}: modifications")
        for col in ("variant", "ms", "ratio to plain"):
            table.add_column(col, justify="right")
        for name, r in rows.items():
            table.add_row(name, f"{r['ms']:.1f}", f"{r['ratio']:.3f}")
        console.print(table)
        console.print(f"bias (B, 2, {T}, {T}) fwd+bwd scratch MiB: {suite.bias_memory_case(T, args.B)}")


def _gqa(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--gqa`` line: grouped-query causal fwd+bwd against torch (T=4096 unless ``--T``)."""
    for T in [4096] if default_T else args.T:
        r = suite.gqa_case(T, 1, args.N, 2, args.D, repeats=args.repeats)
        console.print(f"grouped-query causal fwd+bwd, B=1 N={args.N} K=2 T={T} D={args.D}: {r}")


def _packed(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--packed`` line: 8 packed causal documents against full causal (T=8192 unless ``--T``)."""
    for T in [8192] if default_T else args.T:
        r = suite.packed_case(T, args.B, args.N, args.D, repeats=args.repeats)
        console.print(f"packed documents, blockwise, B={args.B} N={args.N} T={T} D={args.D}: {r}")


def _module(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--module`` tables: ``nnx.SelfAttention(512, 8 heads)`` causal fwd+bwd on the dense and blockwise paths."""
    for T in args.T:
        rows = {impl: suite.module_case(T, impl, args.repeats) for impl in ("dense", "blockwise")}
        table = Table(title=f"nnx.SelfAttention(512, num_heads=8), causal, fwd+bwd, x (1, {T}, 512)")
        for col in ("path", "ms", "scratch MiB"):
            table.add_column(col, justify="right")
        for impl, r in rows.items():
            table.add_row(impl, f"{r['ms']:.1f}", f"{r['temp_mib']:.0f}")
        console.print(table)


def gpu_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the GPU preset (:data:`bench.suite.GPU_PRESET`) in place of its shapes and candidates."""
    return argparse.Namespace(**(vars(args) | suite.GPU_PRESET))


def _gated(console: Console, args: argparse.Namespace, default_T: bool) -> None:
    """The ``--gated`` table: :func:`jattn.gated_linear_attention`'s forms and softmax, fwd+bwd (:mod:`bench.gated`)."""
    from bench import gated

    for T in [8192, 32768] if default_T else args.T:
        rows = gated.gated_case(T, 1, 4, args.D, args.repeats)
        table = Table(title=f"gated linear attention, fwd+bwd, B=1 N=4 T={T} D={args.D}")
        for col in ("candidate", "ms", "x the chunkwise gated deltanet"):
            table.add_column(col, justify="right")
        for name, ms in rows.items():
            table.add_row(name, f"{ms:.1f}", f"{ms / rows['gated deltanet, chunkwise']:.2f}")
        console.print(table)


#: The options that run a case with its own table, in the order they are looked at, and their functions.
SPECIAL = {
    "flex": _flex,
    "gqa": _gqa,
    "packed": _packed,
    "gated": _gated,
    "transforms": _transforms,
    "model": _model,
    "module": _module,
}

#: The special cases that time PyTorch beside jattn (refused, with the reason, when torch does not import).
NEEDS_TORCH = ("gqa", "model")


if __name__ == "__main__":
    raise SystemExit(main())
