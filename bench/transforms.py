"""Forward mode and second order on the blockwise path: time and memory against the forward and the backward.

``python -m bench --transforms`` runs :func:`forward_mode_case` (jvp of causal attention against the
forward, targets: within 3x its time and 1.5x its memory) and :func:`hvp_case` (a forward-over-reverse
Hessian-vector product against one forward + backward, target: within 5x), and :func:`peak_rss` (a
fresh process that runs one jvp, target at T = 32768: at most 1 GiB). Timings alternate the candidates
in one process, medians of ``repeats``; memory is XLA's compiled scratch (``memory_analysis``) and the
peak RSS of a whole process.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jattn
from jattn import masks

__all__ = ["PROGRAMS", "forward_mode_case", "hvp_case", "inputs", "peak_rss"]


def inputs(B: int, N: int, T: int, D: int) -> tuple[jax.Array, ...]:
    """Six normal float32 arrays (B, N, T, D): q, k, v and their tangents."""
    keys = jax.random.split(jax.random.key(0), 6)
    return tuple(jax.random.normal(key, (B, N, T, D), jnp.float32) for key in keys)


def _attend(q, k, v):
    return jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise")


def _loss(q, k, v):
    return jnp.sum(jnp.sin(_attend(q, k, v)))


#: What each candidate computes, from (q, k, v) and tangents (dq, dk, dv).
PROGRAMS: dict[str, Callable] = {
    "forward": lambda x, t: _attend(*x),
    "jvp": lambda x, t: jax.jvp(_attend, x, t),
    "forward+backward": lambda x, t: jax.grad(_loss, (0, 1, 2))(*x),
    "hvp (forward over reverse)": lambda x, t: jax.jvp(jax.grad(_loss, (0, 1, 2)), x, t)[1],
}


def _time(names: tuple[str, ...], x: tuple, t: tuple, repeats: int) -> dict[str, dict]:
    """Median ms (alternated in this process) and compiled scratch MiB of each program in ``names``."""
    fns = {n: jax.jit(PROGRAMS[n]) for n in names}
    out = {}
    for n, f in fns.items():
        compiled = f.lower(x, t).compile()
        jax.block_until_ready(compiled(x, t))
        out[n] = {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20, "times": [], "f": compiled}
    for _ in range(repeats):
        for n in names:
            t0 = time.perf_counter()
            jax.block_until_ready(out[n]["f"](x, t))
            out[n]["times"].append(time.perf_counter() - t0)
    return {n: {"ms": 1e3 * statistics.median(r["times"]), "temp_mib": r["temp_mib"]} for n, r in out.items()}


def forward_mode_case(T: int = 16384, B: int = 1, N: int = 8, D: int = 64, repeats: int = 5) -> dict:
    """jvp of causal blockwise attention against its forward: ms, scratch MiB and the ratios (targets 3x, 1.5x)."""
    q, k, v, dq, dk, dv = inputs(B, N, T, D)
    r = _time(("forward", "jvp"), (q, k, v), (dq, dk, dv), repeats)
    r["ratio"] = {"time": r["jvp"]["ms"] / r["forward"]["ms"]}
    return r


def hvp_case(T: int = 8192, B: int = 1, N: int = 8, D: int = 64, repeats: int = 5) -> dict:
    """A forward-over-reverse Hessian-vector product against one forward + backward (target: within 5x)."""
    q, k, v, dq, dk, dv = inputs(B, N, T, D)
    r = _time(("forward+backward", "hvp (forward over reverse)"), (q, k, v), (dq, dk, dv), repeats)
    r["ratio"] = {"time": r["hvp (forward over reverse)"]["ms"] / r["forward+backward"]["ms"]}
    return r


_CHILD = """
import resource, sys, jax
from bench import transforms as t
n, T = sys.argv[1], int(sys.argv[2])
x = t.inputs(1, 8, T, 64)
jax.block_until_ready(jax.jit(t.PROGRAMS[n])(x[:3], x[3:]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def peak_rss(program: str = "jvp", T: int = 32768) -> float:
    """Peak RSS (GiB) of a fresh process that compiles and runs ``program`` once (B=1, N=8, D=64, causal)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, program, str(T)], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])
