"""Compiles Triton IR text to a cubin with Triton's own compiler: the triton venv's half of ``python -m bench.triton_compile``.

Run by path in a venv with ``triton`` from PyPI (3.8.0, whose ``tt`` op set equals jaxlib 0.10.2's), never
with jax in the process (jaxlib and triton each bundle their own MLIR and LLVM):

    .venv-triton/bin/python bench/triton_cubin.py job.json results.jsonl

``job.json`` is a list of ``{key, path, num_warps, num_stages, arch}`` (the module text at ``path``); each
is parsed with this Triton's dialects and taken through every stage of its CUDA backend (make_ttir
included, as XLA's pipeline runs it) to a cubin with the bundled ptxas. One JSON line per job in
``results.jsonl``: ``shared`` (bytes of dynamic shared memory the launch asks for), ``regs``,
``spill_st``/``spill_ld``/``stack`` (bytes, from ``ptxas -v``), ``seconds``, or ``error``. A kernel whose
shared memory is over the arch's opt-in limit stops after the llir stage (ptxas is not run).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time

#: Max dynamic shared memory per block (opt-in), bytes: the launch fails above it.
SMEM_OPTIN = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _stages(job: dict):
    """``(stages {ext: fn}, module, metadata)`` of Triton's CUDA backend for one job, its module parsed."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import IRSource, make_backend

    target = GPUTarget("cuda", job["arch"], 32)
    backend = make_backend(target)
    context = ir.context()
    src = IRSource(job["path"], context, backend)
    opts = backend.parse_options(dict(num_warps=job["num_warps"], num_stages=job["num_stages"], num_ctas=1))
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    metadata = {"hash": "0" * 64, "target": target, **opts.__dict__}
    codegen = backend.get_codegen_implementation(opts)
    module = src.make_ir(target, opts, codegen, backend.get_module_map(), context)
    return stages, module, metadata


def _ptxas(log: str) -> dict:
    """Registers, stack and spills from ``ptxas -v``'s log (None where it says nothing)."""
    m = re.search(r"Used (\d+) registers", log)
    out = {"regs": int(m.group(1)) if m else None}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["stack"], out["spill_st"], out["spill_ld"] = (int(x) for x in m.groups()) if m else (None,) * 3
    return out


def compile_one(job: dict) -> dict:
    """One job's statistics (module docstring), or ``{"error": ...}``."""
    from triton import knobs

    t0 = time.time()
    stages, module, metadata = _stages(job)
    knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v
    log, limit = io.StringIO(), SMEM_OPTIN.get(job["arch"])
    with contextlib.redirect_stdout(log):
        for ext, stage in stages.items():  # ttir, ttgir, llir, ptx, cubin
            module = stage(module, metadata)
            if ext == "llir" and limit is not None and metadata.get("shared", 0) > limit:
                return dict(shared=int(metadata["shared"]), over=True, seconds=round(time.time() - t0, 1))
    return dict(shared=int(metadata.get("shared", 0)), **_ptxas(log.getvalue()), seconds=round(time.time() - t0, 1))


def main(job_path: str, out_path: str) -> int:
    """Compiles every job of ``job_path``, appending one JSON line each to ``out_path``; 0."""
    import triton

    with open(job_path) as fh:
        jobs = json.load(fh)
    with open(out_path, "w") as out:
        for job in jobs:
            try:
                res = compile_one(job)
            except Exception as e:  # a compile failure: the message Triton or ptxas gives
                res = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
            out.write(json.dumps(dict(key=job["key"], arch=job["arch"], triton=triton.__version__, **res)) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
