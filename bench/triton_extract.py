"""The Triton IR of jattn's GPU kernels, lowered for CUDA on a machine without a GPU (the jax venv's half of
``python -m bench.triton_compile``).

Each configuration's programs (the gradient: forward, dq, dk/dv; the jvp: forward and tangent in one
kernel; ``linearize``: forward, then tangent) are lowered with jattn's platform facts switched to a GPU
of the configuration's compute capability (as tests/test_lowering.py does), so the kernels take that
row of :mod:`jattn._gpu.tuning`. Each ``__gpu$xla.gpu.triton`` custom call carries its Triton module as
MLIR bytecode (``backend_config["ir"]``), re-printed here as MLIR text with jaxlib's own Triton dialect
(bytecode does not cross MLIR versions, text does), with the launch (``num_warps``, ``num_stages``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

import jattn
import jattn._paths.pallas as pallas_path
import jattn._platform as platform_facts
from jattn import masks, score_mods

__all__ = ["extract", "programs"]

B, N, T = 1, 2, 256  # causal: diagonal (masked) and full tiles both


def programs(variant: str, D: int, dtype: str) -> tuple[dict[str, Callable], tuple]:
    """``({name: fn}, (q, k, v))``: the gradient, jvp and linearize programs of one variant, D and dtype.

    ``variant`` ``"plain"`` (causal) or ``"features"`` (causal, dropout 0.1, ALiBi composed with a soft
    cap of 30, sinks): between them every branch the kernels compile; ``"paged"``: :func:`jattn.paged_attention`'s
    kernel, a mixed batch (a prefill and a decode) against a pool of 64-token pages (args: its operands).
    """
    if variant == "paged":
        return _paged(D, dtype)
    q = k = v = jnp.zeros((B, N, T, D), jnp.dtype(dtype))
    kw: dict = dict(mask=masks.causal(), implementation="pallas")
    if variant == "features":
        mod = score_mods.compose(score_mods.alibi(score_mods.alibi_slopes(N)), score_mods.softcap(30.0))
        kw |= dict(score_mod=mod, sinks=jnp.ones((N,), jnp.float32), dropout_rate=0.1, dropout_rng=jax.random.key(0))

    def f(q, k, v):
        return jattn.attention(q, k, v, **kw)

    def grad(q, k, v):
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    def jvp(q, k, v):
        return jax.jvp(f, (q, k, v), (q, k, v))

    def linearized(q, k, v):
        return jax.linearize(f, q, k, v)[1](q, k, v)

    return {"grad": grad, "jvp": jvp, "linearize": linearized}, (q, k, v)


def _paged(D: int, dtype: str) -> tuple[dict[str, Callable], tuple]:
    """The paged kernel's program and operands: q ``(Q, N, D)``, pages ``(P, 64, 1, D)``, the tables."""
    q = jnp.zeros((40, N, D), jnp.dtype(dtype))
    pages = jnp.zeros((16, 64, 1, D), jnp.dtype(dtype))
    tables = (jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32), jnp.array([200, 150], jnp.int32))
    cu = jnp.array([0, 39, 40], jnp.int32)

    def paged(q, k_pages, v_pages, table, kv_lens, cu_q_lens):
        return jattn.paged_attention(q, k_pages, v_pages, table, kv_lens, cu_q_lens, implementation="pallas")

    return {"paged": paged}, (q, pages, pages, *tables, cu)


@contextlib.contextmanager
def _on_gpu(arch: int) -> Iterator[None]:
    """jattn's platform facts as on a GPU of compute capability ``arch`` (kernels lowered, not interpreted).

    The Triton kernel on every arch: on sm_90 the automatic choice takes it for what the Mosaic GPU kernel refuses.
    """
    saved = platform_facts.platform, platform_facts.compute_capability, jax.default_backend, pallas_path.gpu_backends
    platform_facts.platform, jax.default_backend = (lambda: "gpu"), (lambda: "gpu")
    platform_facts.compute_capability = lambda: arch
    pallas_path.gpu_backends = lambda cc: ("triton",)
    try:
        yield
    finally:
        platform_facts.platform, platform_facts.compute_capability, jax.default_backend, pallas_path.gpu_backends = (
            saved
        )


def _triton_calls(module) -> Iterator[dict]:
    """``{name, text, num_warps, num_stages}`` of each ``__gpu$xla.gpu.triton`` call in a lowered module."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    def text(bytecode: bytes) -> str:
        ctx = ir.Context()
        tt_dialect.register_dialect(ctx)
        with ctx:
            return ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)

    def walk(op) -> Iterator[dict]:
        op = op.operation if hasattr(op, "operation") else op
        target = op.attributes["call_target_name"] if op.name == "stablehlo.custom_call" else None
        if target is not None and ir.StringAttr(target).value == "__gpu$xla.gpu.triton":
            key = "mhlo.backend_config" if "mhlo.backend_config" in list(op.attributes) else "backend_config"
            cfg = ir.DictAttr(op.attributes[key])
            launch = {k: ir.IntegerAttr(cfg[k]).value for k in ("num_warps", "num_stages")}
            name = ir.StringAttr(cfg["name"]).value.removeprefix("jattn_gpu_")
            yield dict(name=name, text=text(ir.StringAttr(cfg["ir"]).value_bytes), **launch)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    yield from walk(child)

    yield from walk(module.operation)


def extract(variant: str, D: int, dtype: str, arch: int) -> dict[str, dict]:
    """``{kernel: {name, text, num_warps, num_stages, key}}``: each kernel of one configuration, once.

    ``key`` hashes the module text and the launch: identical kernels (the forward of the gradient
    and of ``linearize``; two archs given the same choice) compile once.
    """
    fns, args = programs(variant, D, dtype)
    found: dict[str, dict] = {}
    with _on_gpu(arch):
        for fn in fns.values():
            try:
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            except ValueError as e:  # the paged kernel refuses a tile too large for the arch: xla's tiles take it
                if variant == "paged" and "cannot take this call" in str(e):
                    continue
                raise
            for call in _triton_calls(lowered.compiler_ir("stablehlo")):
                digest = hashlib.sha256(f"{call['num_warps']} {call['num_stages']}\n{call['text']}".encode())
                found.setdefault(call["name"], dict(call, key=digest.hexdigest()[:16]))
    return found
