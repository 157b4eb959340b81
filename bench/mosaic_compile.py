"""``python -m bench.mosaic_compile`` (part of ``make compile-check``): jattn's Mosaic GPU kernels compiled to cubins
for Hopper and Blackwell, no GPU.

For each configuration of :data:`VARIANTS` x :data:`DEPTHS` x :data:`DTYPES` x :data:`ARCHS`, the jax venv (jax
0.12+) lowers the programs (bench/mosaic_extract.py: forward, dq, dk/dv, the one-pass jvp, the tangent; the paged
kernel) and the compiler venv compiles each distinct kernel with JAX's own CUDA plugin, as a GPU would
(bench/mosaic_cubin.py, a stand-in driver from bench/fake_cuda.c reporting the chip; ``--jobs`` at once).
Shared memory is checked where it is decided: Mosaic GPU's lowering refuses a kernel past 227 KiB, and jattn
refuses such calls by name first (those are listed, not failed).

One line per (kernel, configuration), then a summary (the largest over the variants). Exit status 1 where a
kernel does not lower or compile, or spills more than it did when measured (:data:`SPILLS`). ``make compile-check`` creates the compiler
venv ``.venv-mosaic`` (``jax-cuda13-pjrt`` of the lowering jaxlib's version, no dependencies) and the stand-in
driver; ``MOSAIC_PY`` and ``FAKE_CUDA_DIR`` name others.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from bench.compile_matrix import matrix_parser, text_table

VARIANTS = ("plain", "features", "paged")  # causal; + dropout, ALiBi and a soft cap, sinks; paged attention
DEPTHS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")  # the tensor cores' 16-bit inputs: the Mosaic GPU kernels refuse float32 by name
ARCHS = (90, 100)
#: Spill stores each Mosaic GPU kernel has today, bytes, by variant and (arch, kernel, D), the same for bfloat16 and
#: float16 (measured 2026-12-07: jax 0.12.1, jax-cuda13-pjrt 0.12.1). A kernel not named spills nothing. They are
#: ceilings: a change that makes a kernel spill more, or one more kernel spill, fails the check; one that brings a
#: kernel down should lower its entry. Every kernel runs one warpgroup (128 threads, at most 255 registers each);
#: Hopper's keep their float32 accumulators in registers, Blackwell's in tensor memory, and there a 128-row tile
#: gives each thread a row: its kernels take a tile 64 columns at a time (``over_columns``), which dropout's bits
#: and a score modification's derivative still fill (docs/design/pallas.md, "Mosaic GPU compiled for the chips").
SPILLS = {
    "plain": {
        **{(90, "dkdv", 256): 1536, (90, "tangent", 256): 360},
        **{(90, "forward_tangent", D): b for D, b in ((128, 60), (256, 2392))},
        (100, "tangent", 128): 88,
    },
    "features": {
        **{(90, "dq", D): b for D, b in ((128, 24), (256, 376))},
        **{(90, "dkdv", D): b for D, b in ((128, 112), (256, 1776))},
        **{(90, "forward_tangent", D): b for D, b in ((128, 152), (256, 2540))},
        **{(90, "tangent", D): b for D, b in ((128, 8), (256, 468))},
        (100, "forward", 128): 24,
        **{(100, "dq", D): b for D, b in ((64, 1412), (128, 1432))},
        **{(100, "dkdv", D): b for D, b in ((64, 448), (128, 448))},
        **{(100, "forward_tangent", D): b for D, b in ((64, 616), (128, 604))},
        **{(100, "tangent", D): b for D, b in ((64, 384), (128, 440))},
    },
    "paged": {(90, "paged", 256): 172},
}
MOSAIC_PY = os.environ.get("MOSAIC_PY", ".venv-mosaic/bin/python")
FAKE_CUDA_DIR = os.environ.get("FAKE_CUDA_DIR", ".venv-mosaic/fake-cuda")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mosaic_cubin.py")

_STATS = {
    "stack": r"(\d+) bytes stack frame",
    "spill_st": r"(\d+) bytes spill stores",
    "spill_ld": r"(\d+) bytes spill loads",
    "regs": r"Used (\d+) registers",
}


class Config(NamedTuple):
    variant: str
    D: int
    dtype: str
    arch: int


def statistics(text: str, arch: int) -> dict:
    """The PTX compiler's statistics of the one kernel in ``text`` (its ``-v`` output), or ``{"error": ...}``."""
    target = re.search(r"Compiling entry function '(\w+)' for '(sm_\w+)'", text)
    if target is None:
        tail = " | ".join(line for line in text.strip().splitlines()[-3:])
        return {"error": f"no cubin (the plugin's pipeline failed before the PTX compiler): {tail[:300]}"}
    if target.group(2) != f"sm_{arch}a":
        return {"error": f"compiled for {target.group(2)}, not sm_{arch}a"}
    found = {key: re.search(pattern, text) for key, pattern in _STATS.items()}
    missing = [key for key, m in found.items() if m is None]
    if missing:
        return {"error": f"no {', '.join(missing)} in the PTX compiler's output"}
    return {key: int(m.group(1)) for key, m in found.items()}


def spill_limit(c: Config, kernel: str) -> int:
    """Bytes of spill stores ``kernel`` may have in configuration ``c`` (:data:`SPILLS`)."""
    return SPILLS[c.variant].get((c.arch, kernel, c.D), 0)


def problems(res: dict, c: Config, kernel: str) -> list[str]:
    """What is wrong with one kernel's statistics in configuration ``c`` (empty: nothing)."""
    if "error" in res:
        return [res["error"]]
    limit = spill_limit(c, kernel)
    if res["spill_st"] > limit:
        return [f"spill stores {res['spill_st']} B > {limit} B (bench/mosaic_compile.py SPILLS)"]
    return []


def _compile(path: str, arch: int) -> dict:
    """One kernel through the compiler venv: its statistics."""
    env = dict(
        os.environ,
        FAKE_CUDA_CC=str(arch),
        MOSAIC_GPU_DUMP_PTXAS="1",
        LD_LIBRARY_PATH=os.path.abspath(FAKE_CUDA_DIR) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
    )
    env.pop("MOSAIC_GPU_DUMP_TO", None)  # the statistics come on stdout
    run = subprocess.run([MOSAIC_PY, WORKER, path], env=env, capture_output=True, text=True, timeout=600)
    return statistics(run.stdout + run.stderr, arch)


def _extract_all(configs: list[Config], work: str) -> tuple[list[dict], dict, list[str]]:
    """``(rows, jobs, refusals)``: a row per (config, kernel); the distinct ``(key, arch)`` compiles; the refusals."""
    from bench.mosaic_extract import extract

    rows, jobs, refusals = [], {}, []
    for c in configs:
        kernels, refused = extract(c.variant, c.D, c.dtype, c.arch)
        refusals += [f"{c.variant} D={c.D} {c.dtype} sm_{c.arch}: {r}" for r in refused]
        for kernel, call in sorted(kernels.items()):
            path = os.path.join(work, f"{call['key']}.mlirbc")
            with open(path, "wb") as fh:
                fh.write(call["module"])
            rows.append(dict(config=c, kernel=kernel, key=call["key"]))
            jobs.setdefault((call["key"], c.arch), path)
    return rows, jobs, refusals


def summary(rows: list[dict], results: dict) -> str:
    """Per kernel, D and dtype, each arch's largest registers and spill stores (B) over the variants."""
    cells: dict = {}
    for row in rows:
        c, res = row["config"], results[(row["key"], row["config"].arch)]
        old = cells.setdefault((row["kernel"], c.D, c.dtype), {}).get(c.arch, (0, 0))
        new = (res.get("regs", -1), res.get("spill_st", -1)) if "error" not in res else (-1, -1)
        cells[(row["kernel"], c.D, c.dtype)][c.arch] = tuple(max(a, b) for a, b in zip(old, new, strict=True))
    head = ["kernel", "D", "dtype", *(f"sm_{a}a: regs, spills B" for a in ARCHS)]
    lines = [head]
    for (kernel, D, dtype), by_arch in sorted(cells.items()):
        lines.append(
            [kernel, str(D), dtype, *(", ".join(map(str, by_arch[a])) if a in by_arch else "-" for a in ARCHS)]
        )
    return text_table(lines)


def _args(argv=None):
    p = matrix_parser(__doc__, VARIANTS, DEPTHS, DTYPES, ARCHS, "compiles")
    return p.parse_args(argv)


def _ready() -> str | None:
    """Why the check cannot run here (None: it can)."""
    import jax

    if jax.__version_info__ < (0, 12):
        return f"jax {jax.__version__}: the Mosaic GPU kernels are lowered for this check with jax 0.12+"
    if not os.path.exists(MOSAIC_PY):
        return f"no compiler venv at {MOSAIC_PY} (make compile-check creates .venv-mosaic)"
    if not os.path.exists(os.path.join(FAKE_CUDA_DIR, "libcuda.so.1")):
        return f"no stand-in driver in {FAKE_CUDA_DIR} (make compile-check builds it from bench/fake_cuda.c)"
    return None


def main(argv=None) -> int:
    a = _args(argv)
    why = _ready()
    if why:
        print(f"FAIL {why}")
        return 1
    configs = [Config(*c) for c in itertools.product(a.variant, a.D, a.dtype, a.arch)]
    with tempfile.TemporaryDirectory() as work:
        rows, jobs, refusals = _extract_all(configs, work)
        with ThreadPoolExecutor(a.jobs) as pool:
            futures = {job: pool.submit(_compile, path, job[1]) for job, path in jobs.items()}
        results = {job: f.result() for job, f in futures.items()}
    failed = 0
    for row in rows:
        c, res = row["config"], results[(row["key"], row["config"].arch)]
        found = problems(res, c, row["kernel"])
        failed += bool(found)
        stats = "" if "error" in res else f" regs={res['regs']} spill_st={res['spill_st']}B stack={res['stack']}B"
        print(
            f"{'FAIL' if found else 'OK  '} {row['kernel']:<15} {c.variant:<8} D={c.D:<3} {c.dtype:<8} sm_{c.arch}a"
            f"{stats}" + ("  " + "; ".join(found) if found else "")
        )
    for r in refusals:
        print(f"REFUSED BY NAME {r[:200]}")
    print(summary(rows, results))
    print(f"{len(rows)} kernel rows ({len(jobs)} distinct compiles), {failed} failed; {len(refusals)} refused by name")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
