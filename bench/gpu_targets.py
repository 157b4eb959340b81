r"""``python -m bench.gpu_targets``: issue #45's GPU targets, bf16, B=1, N=16, D=128, medians alternated in one process.

1. ``causal``: causal forward + backward at T=8192, jattn with ``implementation=None`` against
   ``jax.nn.dot_product_attention(implementation='cudnn')`` (target: jattn >= 0.9x cuDNN's speed);
2. ``window_softcap`` (sliding window 1024 and a soft cap of 50) and ``documents`` (8 packed documents,
   causal within each), forward + backward at T=16384, jattn against PyTorch's ``flex_attention``
   compiled with the same block mask and score mod (target: >= 1.0x), skipped without torch on the GPU;
3. ``jvp``: ``jax.jvp`` of causal attention at T=16384 against its forward (target: <= 3.5x), and the
   jvp program's compiled scratch memory at T/2 and T (O(T): about 2x, not 4x).

Each row says which path jattn's automatic choice took (``jattn.choose_implementation``). ``--T-scale``
divides every T (``--T-scale 64`` runs the same script in seconds, for a look on CPU, where the GPU
kernel is interpreted: no figure). Writes ``--out`` (JSON) and prints a table; bench/gpu.sh runs it.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

import jattn
from bench.suite import alternated_ms
from jattn import masks, score_mods

B, N, D = 1, 16, 128
WINDOW, CAP, DOCS = 1024, 50.0, 8


def _qkv(T: int, layout: str = "bnth"):
    """bf16 q, k, v ``(B, N, T, D)`` (``layout='bnth'``) or ``(B, T, N, D)`` (jax.nn's)."""
    shape = (B, N, T, D) if layout == "bnth" else (B, T, N, D)
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)


def _fwdbwd(f):
    """Jitted forward + backward of ``sum(f(q, k, v))`` in float32."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def _blocking(f, *args):
    return lambda: jax.block_until_ready(f(*args))


def causal_target(T: int, repeats: int) -> dict:
    """jattn (automatic choice) against jax.nn's cuDNN, causal forward + backward."""
    q, k, v = _qkv(T)
    ours = _fwdbwd(lambda q, k, v: jattn.attention(q, k, v, mask=masks.causal()))
    cudnn = _fwdbwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    ms = alternated_ms({"jattn": _blocking(ours, q, k, v), "cudnn": _blocking(cudnn, qt, kt, vt)}, repeats)
    path = jattn.choose_implementation(q, k, v, mask=masks.causal())
    return {"T": T, "path": path, **_ms(ms), "x_peer": ms["cudnn"] / ms["jattn"], "target": ">= 0.9"}


def _ms(ms: dict) -> dict:
    return {f"{name}_ms": round(t, 3) for name, t in ms.items()}


def flex_mods(T: int, kind: str, device: str = "cuda"):
    """``(mask_mod, score_mod)`` of ``kind`` for PyTorch's flex_attention: the masks and mods of :func:`jattn_call`."""
    import torch

    doc = torch.arange(T, device=device) // (T // DOCS)
    if kind == "window_softcap":
        return (lambda b, h, i, j: (i >= j) & (i - j <= WINDOW)), (lambda s, b, h, i, j: CAP * torch.tanh(s / CAP))
    return (lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)), None


def jattn_call(T: int, kind: str) -> tuple[masks.Mask, dict]:
    """``(mask, keyword arguments)`` of ``kind`` for jattn.attention (window_softcap or documents)."""
    if kind == "window_softcap":
        return masks.sliding_window(WINDOW), dict(score_mod=score_mods.softcap(CAP))
    ids = jnp.arange(T, dtype=jnp.int32)[None] // (T // DOCS)
    return masks.segment_ids(ids) & masks.causal(), {}


def _flex(T: int, kind: str):
    """PyTorch's compiled flex_attention forward + backward on the GPU with ``kind``'s mask and score mod, or None."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    mask_mod, score_mod = flex_mods(T, kind)
    block = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    attend = torch.compile(functools.partial(flex_attention, block_mask=block, score_mod=score_mod))
    q, k, v = (torch.randn(B, N, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def run():
        attend(q, k, v).float().sum().backward()
        torch.cuda.synchronize()

    return run


def flex_target(T: int, kind: str, repeats: int) -> dict:
    """jattn (automatic choice) against flex_attention, forward + backward, for ``kind`` (window_softcap, documents)."""
    q, k, v = _qkv(T)
    mask, kw = jattn_call(T, kind)
    ours = _fwdbwd(lambda q, k, v: jattn.attention(q, k, v, mask=mask, **kw))
    fns = {"jattn": _blocking(ours, q, k, v)}
    theirs = _flex(T, kind)
    if theirs is not None:
        fns["flex"] = theirs
    ms = alternated_ms(fns, repeats)
    row = {"T": T, "case": kind, "path": jattn.choose_implementation(q, k, v, mask=mask, **kw), **_ms(ms)}
    return row | ({"x_peer": ms["flex"] / ms["jattn"], "target": ">= 1.0"} if "flex" in ms else {})


def jvp_target(T: int, repeats: int) -> dict:
    """jvp of causal attention against its forward (time), and the jvp's compiled scratch memory at T/2 and T."""

    def f(q, k, v):
        return jattn.attention(q, k, v, mask=masks.causal())

    def jvp(q, k, v):
        return jax.jvp(f, (q, k, v), (q, k, v))

    q, k, v = _qkv(T)
    forward, tangent = jax.jit(f), jax.jit(jvp)
    ms = alternated_ms({"forward": _blocking(forward, q, k, v), "jvp": _blocking(tangent, q, k, v)}, repeats)

    def scratch(n: int) -> float:
        spec = jax.ShapeDtypeStruct((B, N, n, D), jnp.bfloat16)
        analysis = jax.jit(jvp).lower(spec, spec, spec).compile().memory_analysis()
        return analysis.temp_size_in_bytes / 2**20 if analysis is not None else float("nan")

    half, full = scratch(T // 2), scratch(T)
    return {
        "T": T,
        "path": jattn.choose_implementation(q, k, v, mask=masks.causal()),
        **_ms(ms),
        "x_forward": ms["jvp"] / ms["forward"],
        "target": "<= 3.5",
        "scratch_mib_half_T": half,
        "scratch_mib_T": full,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_targets", description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--T-scale", type=int, default=1, help="divide every T (a quick look; not a figure)")
    p.add_argument("--out", type=Path, default=Path("bench/results-gpu/targets.json"))
    args = p.parse_args(argv)
    s, r = args.T_scale, args.repeats
    rows = {
        "causal": causal_target(8192 // s, r) if jax.default_backend() == "gpu" else None,
        "window_softcap": flex_target(16384 // s, "window_softcap", r),
        "documents": flex_target(16384 // s, "documents", r),
        "jvp": jvp_target(16384 // s, r),
    }
    machine = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "host": platform.node()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "jax": jax.__version__, "rows": rows}, indent=2) + "\n")
    for name, row in rows.items():
        print(f"{name:15s}", "skipped (cuDNN needs a GPU)" if row is None else json.dumps(row))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
