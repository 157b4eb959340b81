"""``python -m bench.fused_cpu``: the fused C++ forward sketch against PyTorch SDPA, alternated.

Without ``--blas`` the kernel's own products run; ``--blas openblas`` takes NumPy's OpenBLAS, and
MKL (from PyPI, in a separate venv) runs as
``MKL_THREADING_LAYER=SEQUENTIAL python -m bench.fused_cpu --blas /tmp/mkl/lib/libmkl_rt.so.3``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from bench.fused_cpu import Fused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fused_cpu", description=__doc__)
    p.add_argument("--T", type=int, nargs="+", default=[2048])
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--N", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--tiles", nargs="+", default=["512x512", "256x512"], help="rows x keys")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blas", default=None, help="'openblas' (NumPy's) or a CBLAS library's path; default: built in")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    fused = Fused(args.blas)
    print(
        f"products: {fused.blas or 'built in'}; {args.threads} threads; the sketch against torch SDPA, medians of {args.repeats}"
    )
    rng = np.random.default_rng(0)
    for T in args.T:
        q, k, v = (rng.standard_normal((args.B * args.N, T, args.D), dtype=np.float32) for _ in range(3))
        tq, tk, tv = (torch.from_numpy(x).view(args.B, args.N, T, args.D) for x in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).reshape(-1, T, args.D).numpy()
        for tile in args.tiles:
            rows, keys = map(int, tile.split("x"))
            err = np.abs(fused(q, k, v, rows=rows, keys=keys, threads=args.threads) - want).max()
            candidates = {
                "fused": functools.partial(fused, q, k, v, rows=rows, keys=keys, threads=args.threads),
                "torch": functools.partial(torch.nn.functional.scaled_dot_product_attention, tq, tk, tv),
            }
            times: dict[str, list[float]] = {name: [] for name in candidates}
            for _ in range(args.repeats):
                for name, fn in candidates.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
            print(
                f"T={T} tile {tile}: fused {ms['fused']:.1f} ms, torch {ms['torch']:.1f} ms, "
                f"speed {ms['torch'] / ms['fused']:.3f}x torch, max |diff| {err:.1e}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
