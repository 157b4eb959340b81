"""The benchmark suite as a library: candidates, timing, FLOP counts, table, JSON and a plot.

Every figure is the median of repeated runs after a warm-up call, with ``block_until_ready``
(or the torch equivalent), the candidates alternated within one process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
import unittest.mock
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks

MASKS = ("none", "causal", "window", "global")
CANDIDATES = (
    "jattn",
    "jattn-dense",
    "jattn-blockwise",
    "jattn-xla-tiles",
    "jattn-vmap",
    "jattn-sharded",
    "jattn-pallas",
    "jattn-cudnn",
    "jax.nn",
    "jax.nn-cudnn",
    "flax",
    "torch",
)
#: ``python -m bench --gpu`` (bench/gpu.sh): bf16, fwd and fwd+bwd, T = 2048..32768, on one NVIDIA GPU.
GPU_PRESET = dict(
    T=[2048, 4096, 8192, 16384, 32768],
    B=1,
    N=16,
    D=128,
    dtype="bfloat16",
    modes=["fwd", "fwdbwd"],
    masks=["none", "causal"],
    candidates=["jattn", "jattn-pallas", "jattn-cudnn", "jattn-blockwise", "jax.nn-cudnn", "torch"],
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape, mask and mode: q, k, v of shape (B, N, T, D)."""

    B: int
    N: int
    T: int
    D: int
    mask: str = "none"
    mode: str = "fwd"  # 'fwd' or 'fwdbwd'
    window: int = 256
    dtype: str = "float32"

    def predicate(self) -> masks.Mask | None:
        return {
            "none": None,
            "causal": masks.causal(),
            "window": masks.sliding_window(self.window),
            "global": masks.causal() & (masks.sliding_window(self.window) | masks.global_tokens([0])),
        }[self.mask]

    def density(self) -> float:
        """Fraction of (query, key) pairs the mask keeps (for the useful FLOP rate)."""
        m = self.predicate()
        if m is None:
            return 1.0
        kept = 0
        for start in range(0, self.T, 1024):
            rows = min(1024, self.T - start)
            kept += int(jnp.sum(m.dense(rows, self.T, q_offset=start)))
        return kept / self.T**2

    def flops(self) -> float:
        """Useful FLOPs: 4·B·N·T·S·D forward (two matmuls), 3.5x that forward + backward."""
        fwd = 4 * self.B * self.N * self.T * self.T * self.D * self.density()
        return fwd * (3.5 if self.mode == "fwdbwd" else 1.0)


def _inputs(case: Case):
    dtype = jnp.dtype(case.dtype)
    return tuple(jax.random.normal(jax.random.key(i), (case.B, case.N, case.T, case.D), dtype) for i in range(3))


def _dense_mask(case: Case) -> jax.Array | None:
    m = case.predicate()
    return None if m is None else m.dense(case.T, case.T)[None, None]


def candidate(name: str, case: Case) -> Callable | None:
    """The compiled call of one candidate on the case's inputs (returns its output), or None off its platform."""
    return _torch_candidate(case) if name == "torch" else _jax_candidate(name, case)


def _jax_candidate(name: str, case: Case) -> Callable | None:
    pred = case.predicate()
    if name.startswith("jattn"):
        impl = {
            "jattn": None,
            "jattn-dense": "dense",
            "jattn-blockwise": "blockwise",
            "jattn-xla-tiles": None,  # the default path with the fused CPU forward switched off
            "jattn-vmap": None,
            "jattn-sharded": None,
            "jattn-pallas": "pallas",
            "jattn-cudnn": "cudnn",
        }[name]

        def f(q, k, v):
            return jattn.attention(q, k, v, mask=pred, implementation=impl)

        if name == "jattn-vmap":  # the same work as "jattn", the batch axis mapped by jax.vmap
            f = jax.vmap(f)
        layout = lambda x: x  # noqa: E731
        if name == "jattn-sharded":  # heads over every device (on CPU: --cpu-devices, one a core)
            f, layout = _sharded_heads(f, case)
    else:
        layout = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (B, T, N, D)
        if name in ("jax.nn", "jax.nn-cudnn"):
            kw: dict = {"implementation": "cudnn"} if name == "jax.nn-cudnn" else {}
            if case.mask in ("causal", "window"):
                kw["is_causal"] = True
            if case.mask == "window":
                kw["local_window_size"] = (case.window, 0)
            if case.mask == "global":
                kw["mask"] = _dense_mask(case)

            def f(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, **kw)

        elif name == "flax":
            from flax import linen as nn

            dense = _dense_mask(case)

            def f(q, k, v):
                return nn.dot_product_attention(q, k, v, mask=dense)

        else:
            return None
    if case.mode == "fwdbwd":
        fwd = f

        def f(q, k, v):
            return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))(q, k, v)

    jitted = jax.jit(f)
    args = tuple(layout(x) for x in _inputs(case))
    t0, c0 = time.perf_counter(), time.process_time()
    switch = {"JATTN_FUSED_CPU": "0"} if name == "jattn-xla-tiles" else {}
    with unittest.mock.patch.dict(os.environ, switch):  # read at trace time (jattn._blockwise.fused_cpu.available)
        compiled = jitted.lower(*args).compile()
    compile_s = (time.perf_counter() - t0, time.process_time() - c0)

    def run():
        return jax.block_until_ready(compiled(*args))

    run.compile_s = compile_s  # (wall, this process's CPU): trace, lower and compile, no execution
    run.temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return run


def _sharded_heads(f: Callable, case: Case) -> tuple[Callable, Callable]:
    """``f`` under ``shard_map`` with the heads split over all devices, and the inputs' placement.

    On CPU, ``--cpu-devices n`` makes n devices of one process: each runs its own heads' tiles,
    so each core gets whole tiles rather than half of every op of one program.
    """
    devices = jax.devices()
    if len(devices) < 2 or case.N % len(devices):
        raise ValueError(f"jattn-sharded needs N={case.N} heads over >= 2 devices, got {len(devices)}")
    mesh = jax.make_mesh((len(devices),), ("heads",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    spec = jax.sharding.PartitionSpec(None, "heads")
    sharded = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return sharded, lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


#: How to get the PyTorch comparisons (the ``[bench]`` extra's pin, the CPU build).
TORCH_INSTALL = "pip install torch==2.13.0"


def torch_missing() -> str | None:
    """Why torch does not import (``"torch not installed (No module named 'torch')"``), or None when it does."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch not installed ({e})"
    return None


def _torch_candidate(case: Case) -> Callable:
    try:
        import torch
        from torch.nn import functional
    except ImportError as e:  # recorded by run_case as the candidate's error: in the table and the JSON
        raise ModuleNotFoundError("torch not installed") from e
    dtype = getattr(torch, case.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the flash kernel (below)
    q, k, v = (torch.from_numpy(np.array(x, np.float32)).to(device, dtype) for x in _inputs(case))
    kw: dict = {}
    if case.mask == "causal":
        kw["is_causal"] = True
    elif case.mask in ("window", "global"):
        kw["attn_mask"] = torch.from_numpy(np.array(_dense_mask(case))).to(device)
    if case.mode == "fwdbwd":
        for x in (q, k, v):
            x.requires_grad_(True)

    def sdpa():
        if device != "cuda" or "attn_mask" in kw:
            return functional.scaled_dot_product_attention(q, k, v, **kw)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return functional.scaled_dot_product_attention(q, k, v, **kw)

    def run():
        out = sdpa()
        if case.mode == "fwdbwd":
            out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    run.temp_mib = float("nan")
    return run


def module_case(T: int, implementation: str, repeats: int = 5, d_model: int = 512, heads: int = 8) -> dict:
    """``jattn.nnx.SelfAttention(d_model, num_heads=heads)`` causal, forward + backward on ``x (1, T, d_model)``.

    Median ms and the compiled scratch memory (MiB) of one path.
    """
    from flax import nnx

    import jattn.nnx

    model = jattn.nnx.SelfAttention(d_model, num_heads=heads, implementation=implementation, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(0), (1, T, d_model))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, masks.causal()))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times), "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20}


def matmul_peak(n: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of a jitted float32 (n, n) @ (n, n) on this machine: the roof for the ratios."""
    a = jax.random.normal(jax.random.key(0), (n, n))
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


# After a call with a large scratch (the dense paths) XLA hands the memory back to the OS on
# another thread, which slowed the next candidate's call: jattn window T=16384 590 against 165 ms
# after jax.nn's 16 GiB, torch full T=2048 146 against 124 ms after jax.nn's 1 GiB. The harness
# waits for that before going on.
SETTLE_MIB, SETTLE_S = 256, 1.0


def run_case(case: Case, candidates: tuple[str, ...], repeats: int) -> dict[str, dict]:
    """Median time of each candidate (alternated), its useful GFLOP/s, compile time and memory."""
    runs, compile_s, errors = {}, {}, {}
    for name in candidates:
        t0 = time.perf_counter()
        try:  # a path that refuses the case (or runs out of memory) is recorded, not fatal
            fn = candidate(name, case)
            if fn is None:
                continue
            fn()  # warm-up
        except Exception as e:
            errors[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        compile_s[name] = time.perf_counter() - t0
        runs[name] = fn
        _settle(fn)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            _settle(fn)
    flops = case.flops()
    return {
        name: {
            "ms": 1e3 * statistics.median(t),
            "gflops": flops / statistics.median(t) / 1e9,
            "first_call_s": compile_s[name],
            "compile_s": getattr(runs[name], "compile_s", (None, None))[0],
            "compile_cpu_s": getattr(runs[name], "compile_s", (None, None))[1],
            "temp_mib": runs[name].temp_mib,
        }
        for name, t in times.items()
    } | errors


def _settle(fn: Callable) -> None:
    if fn.temp_mib >= SETTLE_MIB:  # its scratch is returned to the OS while the next call runs
        time.sleep(SETTLE_S)


def save(results: list[dict], peak: float, out: Path) -> tuple[Path, Path]:
    """Writes ``results.json`` and ``results.png`` (time against T per candidate, log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps({"matmul_gflops": peak, "results": results}, indent=2) + "\n")
    groups = sorted({(r["case"]["mask"], r["case"]["mode"]) for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (mask, mode) in zip(axes[0], groups, strict=True):
        rows = [r for r in results if (r["case"]["mask"], r["case"]["mode"]) == (mask, mode)]
        for name in CANDIDATES:
            pts = sorted((r["case"]["T"], r["timings"][name]["ms"]) for r in rows if "ms" in r["timings"].get(name, {}))
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=name)
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms", title=f"mask={mask}, {mode}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / "results.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return path, png


FLEX_VARIANTS = ("plain", "softcap", "alibi", "sinks")


def flex_case(T: int = 2048, B: int = 1, N: int = 8, D: int = 64, repeats: int = 7, mask: str = "causal") -> dict:
    """Blockwise forward with a score modification or sinks against the plain one (issue 13's targets).

    Each variant of :data:`FLEX_VARIANTS` is jitted and warmed up, then the variants are timed
    alternately ``repeats`` times in this process; returns each one's median ms and its ratio to
    ``plain`` (targets: softcap and alibi <= 1.15, sinks <= 1.05).
    """
    case = Case(B, N, T, D, mask)
    q, k, v = _inputs(case)
    extra = {
        "plain": {},
        "softcap": dict(score_mod=jattn.score_mods.softcap(30.0)),
        "alibi": dict(score_mod=jattn.score_mods.alibi(jattn.score_mods.alibi_slopes(N))),
        "sinks": dict(sinks=jnp.zeros((N,), jnp.float32)),
    }
    fns = {}
    for name, kw in extra.items():
        f = jax.jit(
            lambda q, k, v, kw=kw: jattn.attention(q, k, v, mask=case.predicate(), implementation="blockwise", **kw)
        )
        jax.block_until_ready(f(q, k, v))
        fns[name] = f
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[name].append(time.perf_counter() - t0)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    return {n: {"ms": ms[n], "ratio": ms[n] / ms["plain"]} for n in ms}


def bias_memory_case(T: int = 2048, B: int = 1, N: int = 2, D: int = 64) -> dict:
    """Compiled scratch memory (MiB) of causal forward + backward with a ``(B, N, T, T)`` bias (its gradient too).

    For the blockwise path without and with the bias, and the dense path with it; ``bias_mib`` is
    the bias itself (issue 13: blockwise memory O(T) apart from the bias).
    """
    spec = jax.ShapeDtypeStruct((B, N, T, D), jnp.float32)
    bias = jax.ShapeDtypeStruct((B, N, T, T), jnp.float32)

    def temp(impl, with_bias):
        def loss(q, k, v, b):
            out = jattn.attention(q, k, v, bias=b if with_bias else None, mask=masks.causal(), implementation=impl)
            return jnp.sum(out)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(spec, spec, spec, bias).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    return {
        "bias_mib": B * N * T * T * 4 / 2**20,
        "blockwise_mib": temp("blockwise", False),
        "blockwise_bias_mib": temp("blockwise", True),
        "dense_bias_mib": temp("dense", True),
    }


def alternated_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each zero-argument callable (blocking), alternated round by round after one warm-up call each."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def gqa_case(T: int = 4096, B: int = 1, N: int = 8, K: int = 2, D: int = 64, repeats: int = 5) -> dict:
    """Grouped-query causal attention, forward + backward: jattn (k, v ``(B, K, 1, T, D)`` against q
    ``(B, K, N/K, T, D)``) against PyTorch SDPA with ``enable_gqa=True``, alternated in this process.

    Also whether the compiled program gives the fused kernels k with ``B·K`` rows (no repeat per query head).
    """
    import torch

    G = N // K
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, K, G, T, D))
    k, v = (jax.random.normal(x, (B, K, 1, T, D)) for x in keys[1:])
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jattn.attention(q, k, v, mask=masks.causal())), argnums=(0, 1, 2)))
    program = grad.lower(q, k, v).as_text()
    calls = [line for line in program.splitlines() if "custom_call @jattn_fused" in line]
    tq, tk, tv = (torch.tensor(np.asarray(x).reshape(B, -1, T, D), requires_grad=True) for x in (q, k, v))

    def theirs():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True).sum().backward()

    ms = alternated_ms({"jattn": lambda: jax.block_until_ready(grad(q, k, v)), "torch": theirs}, repeats)
    unrepeated = bool(calls) and all(f"tensor<{B * K}x" in line for line in calls)
    return {
        "jattn_ms": ms["jattn"],
        "torch_ms": ms["torch"],
        "x_torch": ms["torch"] / ms["jattn"],
        "kv_unrepeated": unrepeated,
    }


def packed_case(T: int = 8192, B: int = 1, N: int = 8, D: int = 64, docs: int = 8, repeats: int = 5) -> dict:
    """Packed documents against full causal attention on the blockwise path (issue 34's target: fwd+bwd >= 5x).

    ``docs`` documents of ``T // docs`` tokens each, causal within each: ``segment_ids(ids) &
    causal()`` with the ids a traced argument, against ``causal()`` alone. Forward and forward +
    backward, jitted and warmed up, timed alternately ``repeats`` times in this process; also the
    compiled scratch memory (MiB) of forward + backward of each.
    """
    case = Case(B, N, T, D, "causal")
    q, k, v = _inputs(case)
    ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // (T // docs), (B, T))

    def call(q, k, v, ids, packed):
        mask = masks.segment_ids(ids) & masks.causal() if packed else masks.causal()
        return jattn.attention(q, k, v, mask=mask, implementation="blockwise")

    def both(q, k, v, ids, packed):
        return jax.grad(lambda q, k, v: jnp.sum(call(q, k, v, ids, packed)), argnums=(0, 1, 2))(q, k, v)

    fns = {
        f"{name}{suffix}": jax.jit(functools.partial(f, packed=packed))
        for name, packed in (("causal", False), ("packed", True))
        for suffix, f in (("", call), ("_fwdbwd", both))
    }
    ms = alternated_ms(
        {n: functools.partial(lambda f: jax.block_until_ready(f(q, k, v, ids)), f) for n, f in fns.items()}, repeats
    )

    def scratch(packed):
        loss = jax.grad(lambda q, k, v, ids: jnp.sum(call(q, k, v, ids, packed)), argnums=(0, 1, 2))
        return jax.jit(loss).lower(q, k, v, ids).compile().memory_analysis().temp_size_in_bytes / 2**20

    return {
        "causal_ms": ms["causal"],
        "packed_ms": ms["packed"],
        "speedup": ms["causal"] / ms["packed"],
        "causal_fwdbwd_ms": ms["causal_fwdbwd"],
        "packed_fwdbwd_ms": ms["packed_fwdbwd"],
        "fwdbwd_speedup": ms["causal_fwdbwd"] / ms["packed_fwdbwd"],
        "causal_fwdbwd_mib": scratch(False),
        "packed_fwdbwd_mib": scratch(True),
        "qkv_mib": 3 * q.size * q.dtype.itemsize / 2**20,
    }
