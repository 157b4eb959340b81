"""``python -m bench.triton_compile`` (``make compile-check``): every Triton kernel of jattn compiled for real chips, no GPU.

For each configuration of :data:`VARIANTS` x :data:`DEPTHS` x :data:`DTYPES` x :data:`ARCHS`, the jax venv
lowers the gradient, jvp and ``linearize`` programs (bench/triton_extract.py: the forward, dq, dk/dv,
tangent and one-pass forward+tangent kernels, with the launch jattn/_gpu/tuning.py chooses for that
arch, D and dtype) and the triton venv compiles each distinct kernel to a cubin (bench/triton_cubin.py,
``--jobs`` processes at once). Two interpreters: jaxlib and triton bundle their own MLIR and LLVM.

One line per (kernel, configuration, arch), then a summary table (the largest over the variants).
Exit status 1 where a kernel does not compile, asks for more shared memory than its table row's chips
give (:data:`SMEM_LIMIT`) or spills more than :func:`spill_limit`. The triton venv: ``make compile-check``
creates ``.venv-triton`` (``triton==3.8.0``, its ``tt`` op set jaxlib 0.10.2's); ``TRITON_PY`` names another.

``--blocks/--warps/--stages/--precision`` (with ``--kernels``) override the table for every cell: to try a
launch before writing it into the table. ``--D/--dtype/--arch/--variant`` narrow the matrix.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from bench.compile_matrix import matrix_parser, text_table

VARIANTS = ("plain", "features", "paged")  # causal; + dropout, ALiBi and a soft cap, sinks; paged attention
DEPTHS = (64, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
ARCHS = (80, 90)
#: Shared memory a table row may ask for, bytes: the smallest opt-in limit of the chips that take it
#: (sm_80's row serves sm_86 and sm_89 too: 99 KiB; sm_90's, sm_90: 227 KiB).
SMEM_LIMIT = {80: 101376, 90: 232448}
TRITON_PY = os.environ.get("TRITON_PY", ".venv-triton/bin/python")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_cubin.py")


class Config(NamedTuple):
    variant: str
    D: int
    dtype: str
    arch: int


def spill_limit(D: int, dtype: str) -> int:
    """Bytes of spill stores a kernel may have: 0 for 16-bit inputs at D <= 128, else 1 KiB."""
    return 0 if dtype != "float32" and D <= 128 else 1024


def _override(a) -> None:
    """Replaces every cell of the tuning table with ``--blocks/--warps/--stages/--precision`` (for ``--kernels``)."""
    from jattn._gpu import tuning

    for cell, choice in tuning.TABLE.items():
        launches = {}
        for kernel in a.kernels or tuning.KERNELS:
            old = choice.launch(kernel)
            launches[kernel] = tuning.Launch(a.warps or old.warps, a.stages or old.stages)
        extra = {"blocks": tuple(a.blocks)} if a.blocks else {}
        extra |= {"precision": a.precision} if a.precision else {}
        tuning.TABLE[cell] = dataclasses.replace(choice, **launches, **extra)


def _extract_all(configs: list[Config], work: str) -> tuple[list[dict], dict]:
    """``(rows, jobs)``: one row per (config, kernel) with its launch; the distinct ``(key, arch)`` compile jobs."""
    from bench.triton_extract import extract
    from jattn._gpu import tuning

    rows, jobs = [], {}
    for c in configs:
        choice = tuning.choose(c.arch, c.dtype, c.D)
        for kernel, call in extract(c.variant, c.D, c.dtype, c.arch).items():
            path = os.path.join(work, f"{call['key']}.ttir")
            if not os.path.exists(path):
                with open(path, "w") as fh:
                    fh.write(call["text"])
            launch = {k: call[k] for k in ("num_warps", "num_stages", "key")}
            rows.append(dict(config=c, kernel=kernel, blocks=choice.blocks, precision=choice.precision, **launch))
            job = dict(path=path, arch=c.arch, num_warps=call["num_warps"], num_stages=call["num_stages"])
            jobs.setdefault((call["key"], c.arch), dict(key=call["key"], **job))
    return rows, jobs


def _compile_all(jobs: dict, work: str, n: int) -> dict:
    """``{(key, arch): statistics}``: the jobs dealt over ``n`` triton processes run at once, largest first."""
    order = sorted(jobs.values(), key=lambda j: -os.path.getsize(j["path"]))
    shards = [order[i::n] for i in range(n)]
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(work, "cache"))
    procs = []
    for i, shard in enumerate(s for s in shards if s):
        spec, out = os.path.join(work, f"job{i}.json"), os.path.join(work, f"out{i}.jsonl")
        with open(spec, "w") as fh:
            json.dump(shard, fh)
        procs.append((subprocess.Popen([TRITON_PY, WORKER, spec, out], env=env), out))
    results = {}
    for proc, out in procs:
        proc.wait()
        if os.path.exists(out):
            with open(out) as fh:
                for line in fh:
                    r = json.loads(line)
                    results[(r["key"], r["arch"])] = r
    return results


def problems(row: dict, res: dict | None) -> list[str]:
    """What is wrong with one kernel's statistics (empty: nothing)."""
    c = row["config"]
    if res is None or "error" in res:
        return ["no result (the triton process failed)" if res is None else res["error"]]
    found = []
    if res["shared"] > SMEM_LIMIT[c.arch]:
        found.append(f"shared {res['shared']} > {SMEM_LIMIT[c.arch]} (the row's chips' opt-in limit)")
    limit = spill_limit(c.D, c.dtype)
    if res.get("spill_st") is not None and res["spill_st"] > limit:
        found.append(f"spill stores {res['spill_st']} B > {limit} B")
    return found


def _line(row: dict, res: dict | None, found: list[str]) -> str:
    """The printed line of one (kernel, configuration, arch)."""
    c = row["config"]
    head = (
        f"{'FAIL' if found else 'OK  '} {row['kernel']:<15} {c.variant:<8} D={c.D:<3} {c.dtype:<8} sm_{c.arch} "
        f"blocks={row['blocks'][0]}x{row['blocks'][1]} warps={row['num_warps']} stages={row['num_stages']}"
    )
    if res and "error" not in res:
        head += (
            f" smem={res['shared']}B regs={res.get('regs')} spill_st={res.get('spill_st')}B stack={res.get('stack')}B"
        )
    return head + ("  " + "; ".join(found) if found else "")


def summary(rows: list[dict], results: dict, markdown: bool = False) -> str:
    """Per kernel, D and dtype, each arch's launch and largest shared memory (KiB), registers and spill stores (B)."""
    cells: dict = {}
    for row in rows:
        c, res = row["config"], results.get((row["key"], row["config"].arch))
        key = (row["kernel"], c.D, c.dtype)
        old = cells.setdefault(key, {}).get(c.arch, (row, -1, -1, -1))
        if res is None or "error" in res:
            cells[key][c.arch] = (row, float("inf"), old[2], old[3])
            continue
        stats = (res["shared"] / 1024, res.get("regs") or 0, res.get("spill_st") or 0)
        cells[key][c.arch] = (row, *(max(o, s) for o, s in zip(old[1:], stats, strict=True)))
    head = ["kernel", "D", "dtype", *(f"sm_{a}: blocks, warps/stages, smem KiB, regs, spills B" for a in ARCHS)]
    lines = [head]
    for (kernel, D, dtype), by_arch in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        out = [kernel, str(D), dtype]
        for arch in ARCHS:
            if arch not in by_arch:
                out.append("")
                continue
            row, smem, regs, spill = by_arch[arch]
            out.append(
                f"{row['blocks'][0]}x{row['blocks'][1]}, {row['num_warps']}/{row['num_stages']}, "
                f"{smem:.0f}, {regs}, {spill}"
            )
        lines.append(out)
    if markdown:
        rule = ["---"] * len(head)
        return "\n".join("| " + " | ".join(r) + " |" for r in [lines[0], rule, *lines[1:]])
    return text_table(lines)


def _args(argv=None):
    p = matrix_parser(__doc__, VARIANTS, DEPTHS, DTYPES, ARCHS, "triton processes")
    p.add_argument("--blocks", type=int, nargs=2, default=None, help="override: (bq, bk) of every cell")
    p.add_argument("--warps", type=int, default=None, help="override: num_warps")
    p.add_argument("--stages", type=int, default=None, help="override: num_stages")
    p.add_argument(
        "--precision", default=None, choices=("ieee", "tf32x3", "bf16x3", "tf32"), help="override: float32 dots"
    )
    p.add_argument("--kernels", nargs="+", default=None, help="the kernels --warps/--stages apply to (default all)")
    p.add_argument("--markdown", action="store_true", help="the summary as a Markdown table")
    p.add_argument("--keep", default=None, help="a folder to keep the Triton IR and the statistics in")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    import jaxlib

    if jaxlib.__version__ != "0.10.2":
        print(
            f"FAIL jaxlib {jaxlib.__version__}: the check lowers with jaxlib 0.10.2, whose Triton dialect triton 3.8.0 reads"
        )
        return 1
    if not os.path.exists(TRITON_PY):
        print(f"FAIL no {TRITON_PY}: make compile-check creates it (a venv with triton==3.8.0), or set TRITON_PY")
        return 1
    if any(x is not None for x in (a.blocks, a.warps, a.stages, a.precision)):
        _override(a)
    work = a.keep or tempfile.mkdtemp(prefix="jattn-triton-")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    configs = [Config(*c) for c in itertools.product(a.variant, a.D, a.dtype, a.arch)]
    rows, jobs = _extract_all(configs, work)
    t1 = time.time()
    results = _compile_all(jobs, work, max(1, a.jobs))
    bad = 0
    for row in rows:
        res = results.get((row["key"], row["config"].arch))
        found = problems(row, res)
        bad += bool(found)
        print(_line(row, res, found))
    print(summary(rows, results, a.markdown))
    print(
        f"{len(rows)} kernels in {len(configs)} configurations, {len(jobs)} distinct compiled: {bad} failed; "
        f"lowering {t1 - t0:.0f} s, compiling {time.time() - t1:.0f} s ({a.jobs} processes)"
    )
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
