"""The jax_triton route, measured: jattn's forward in Triton's DSL (:mod:`bench.triton_dsl`), three ways, no GPU.

For when JAX removes Pallas' Triton backend (deprecated from 0.11): can jattn's kernel be written once in
Triton's own DSL and launched through jax_triton on the chips Mosaic GPU does not serve (sm_80-89)?

    make jax-triton-route

runs the three steps, each in its own venv (Triton and jaxlib each bundle an LLVM; the interpreter wants torch):

- ``values``: Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors) against a float64 NumPy
  reference: causal with GQA, B != N != T != S (T < S, and T > S: rows that see no key), float16 and
  float32; exits 1 past the tolerance.
- ``stats``: Triton's CUDA backend compiles the kernel for sm_80 and sm_90 (D 64, 128; bf16, f16) to cubins at
  the Pallas forward's launch (:data:`LAUNCH`), measured as ``make compile-check`` measures Pallas' kernels
  (:mod:`bench.triton_cubin`): shared memory, registers, spills.
- ``lower``: ``jax_triton.triton_call`` in a jitted function lowered for CUDA
  (``lowering_platforms=("cuda",)``) for sm_80 and sm_90: the custom call it emits (jax_triton compiles the
  cubin while lowering; it needs JAX's CUDA plugin installed, not a GPU).

Dimension key: B batch, N query heads, K kv heads, G = N / K, T queries, S keys, D head depth.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile

import numpy as np

B, N, K, T, S, D = 2, 6, 2, 100, 130, 64
BLOCK = 64
#: ``(arch, D) -> ((bq, bk), warps)``: the forward's launch in jattn's tuning table for 16-bit inputs
#: (``jattn/_gpu/tuning.py``, ``TABLE``), so the DSL kernel is measured where the Pallas one was; 2 stages.
LAUNCH = {(80, 64): ((64, 32), 4), (80, 128): ((64, 32), 4), (90, 64): ((64, 32), 4), (90, 128): ((32, 64), 8)}
#: The tolerances of a float64 comparison, by dtype name (tests/reference.py's, for the interpreter's values).
TOL = {"float16": dict(atol=2e-3, rtol=2e-3), "float32": dict(atol=1e-5, rtol=1e-5)}


def kinds(t: int, s: int, bq: int = BLOCK, bk: int = BLOCK) -> np.ndarray:
    """``(nq, nk)`` int32 tile kinds of the bottom-right aligned causal mask: 0 empty, 1 partial, 2 full."""
    q0 = np.arange(0, t, bq)[:, None]
    q1 = np.minimum(q0 + bq, t) - 1
    k0 = np.arange(0, s, bk)[None, :]
    k1 = np.minimum(k0 + bk, s) - 1
    shift = s - t
    return np.where(k0 > q1 + shift, 0, np.where(k1 <= q0 + shift, 2, 1)).astype(np.int32)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(o (B*N, T, D), lse (B*N, T))`` of causal GQA attention (kv head ``bn // G``; no key: 0, -inf)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    G = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, G, axis=0), np.repeat(v, G, axis=0)
    s = np.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
    keep = np.arange(k.shape[1])[None, :] <= np.arange(q.shape[1])[:, None] + (k.shape[1] - q.shape[1])
    s = np.where(keep, s, -np.inf)
    top = np.where(keep.any(-1), s.max(-1), 0.0)  # a row that sees no key: lse -inf, output 0 (the kernel's)
    total = np.sum(np.exp(s - top[..., None]), -1)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + top
    return np.einsum("bts,bsd->btd", np.exp(s - top[..., None]) / np.where(total > 0, total, 1.0)[..., None], v), lse


def _operands(dtype: str, t: int = T, s: int = S) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B * N, t, D)).astype(dtype)
    k, v = (rng.standard_normal((B * K, s, D)).astype(dtype) for _ in range(2))
    return q, k, v


def values() -> int:
    """Triton's interpreter against :func:`reference`; prints each dtype's largest error; 1 past ``TOL``."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from bench.triton_dsl import forward

    failed = 0
    for dtype in TOL:
        for t, s in ((T, S), (S, T)):  # more keys than queries, and fewer: the first rows then see no key
            q, k, v = _operands(dtype, t, s)
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            o, lse = torch.empty_like(tq), torch.empty((B * N, t), dtype=torch.float32)
            tiles = torch.from_numpy(kinds(t, s))
            args = (tq, tk, tv, tiles, 1 / np.sqrt(D), t, s, tiles.shape[1], o, lse)
            forward[(tiles.shape[0], B * N)](*args, G=N // K, D=D, BQ=BLOCK, BK=BLOCK)
            want_o, want_lse = reference(q, k, v)
            finite = np.isfinite(want_lse)
            lse_err = np.abs(lse.numpy()[finite] - want_lse[finite])
            err = max(np.max(np.abs(o.numpy() - want_o)), np.max(lse_err))
            ok = np.allclose(o.numpy(), want_o, **TOL[dtype]) and np.allclose(lse.numpy(), want_lse, **TOL[dtype])
            print(f"values {dtype} T={t} S={s}: largest error {err:.2e} ({'within' if ok else 'PAST'} {TOL[dtype]})")
            failed |= not ok
    return int(failed)


def stats() -> int:
    """The kernel compiled for sm_80 and sm_90 at D 64, 128 (bf16, f16): one JSON line each; 1 on an error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench import triton_cubin
    from bench.triton_dsl import forward

    failed = 0
    for (arch, depth), ((bq, bk), warps) in LAUNCH.items():
        for dtype in ("bf16", "fp16"):
            sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "kinds_ptr": "*i32"}
            sig |= {"scale": "fp32", "T": "i32", "S": "i32", "NK": "i32", "o_ptr": f"*{dtype}", "lse_ptr": "*fp32"}
            const = {"G": 3, "D": depth, "BQ": bq, "BK": bk}
            src = ASTSource(fn=forward, signature={**sig, **dict.fromkeys(const, "constexpr")}, constexprs=const)
            with contextlib.redirect_stdout(io.StringIO()):  # ptxas -v, once compile_one has turned it on
                ttir = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
            with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as fh:
                fh.write(ttir.asm["ttir"])
            key = f"dsl-forward-D{depth}-{dtype}-{bq}x{bk}-w{warps}"
            res = triton_cubin.compile_one(dict(key=key, path=fh.name, num_warps=warps, num_stages=2, arch=arch))
            os.unlink(fh.name)
            print(json.dumps(dict(key=key, arch=arch, triton=triton.__version__, **res)))
            failed |= "error" in res or bool(res.get("over"))
    return int(failed)


def lower() -> int:
    """``jax_triton.triton_call`` lowered for CUDA at sm_80 and sm_90: the custom calls; 1 where none is found."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while unset; 1 is its default
    import jax
    import jax.numpy as jnp
    import jax_triton

    from bench.triton_dsl import forward

    _patch_dce(jax_triton)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _operands("float32"))
    tiles = jnp.asarray(kinds(T, S))
    failed = 0
    for cc in (80, 90):

        def call(q, k, v, tiles, cc=cc):
            out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B * N, T), jnp.float32))
            return jax_triton.triton_call(
                q, k, v, tiles, 1 / np.sqrt(D), T, S, tiles.shape[1], kernel=forward, out_type=out,
                grid=(tiles.shape[0], B * N), G=N // K, D=D, BQ=BLOCK, BK=BLOCK, num_warps=4, num_stages=2,
                compute_capability=cc,
            )  # fmt: skip

        text = jax.jit(call).trace(q, k, v, tiles).lower(lowering_platforms=("cuda",)).as_text()
        found = text.count("@triton_kernel_call")
        print(f"lower sm_{cc}: jax {jax.__version__}, jax_triton {jax_triton.__version__}: {found} triton_kernel_call")
        failed |= found != 1
    return int(failed)


def _patch_dce(jax_triton) -> None:
    """jax_triton 0.4.1's dead-code rule takes ``(used_outs, eqn)``; jax 0.12 calls it with ``live_ins`` too."""
    from jax._src.interpreters import partial_eval as pe

    prim = jax_triton.triton_lib.triton_kernel_call_p
    rule = pe.dce_rules[prim]
    if rule.__code__.co_argcount == 2:
        pe.dce_rules[prim] = lambda used_outs, live_ins, eqn: rule(used_outs, eqn)


if __name__ == "__main__":
    sys.exit({"values": values, "stats": stats, "lower": lower}[sys.argv[1]]())
