"""The Mosaic GPU modules of jattn's kernels, lowered for CUDA on a machine without a GPU (the jax venv's half of
``python -m bench.mosaic_compile``).

Each configuration's programs (bench/triton_extract.py's: the gradient, the jvp, ``linearize``; or the paged
kernel's) are lowered with jattn's platform facts switched to a GPU of the configuration's compute capability and
the Mosaic GPU kernels as the only GPU backend, under an abstract device of that chip (tests/cuda_lowering.py).
Each ``mosaic_gpu_v2`` custom call carries its kernel as Mosaic GPU's serialized MLIR (``backend_config
["module"]``), which the CUDA plugin's compiler reads as it is (bench/mosaic_cubin.py); the kernel's name
(``jattn_mosaic_forward``, ...) is the module's symbol. Needs jax 0.12+ (0.10's lowering of the tcgen05 kernels
fails, and its Mosaic GPU serialization is older than the plugins on PyPI for it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import jax

import jattn._paths.pallas as pallas_path
import jattn._platform as platform_facts
from bench.triton_extract import programs
from jattn._checks import KernelRefusalError
from jattn._gpu import backend_for

__all__ = ["DEVICE_KINDS", "extract"]

#: The abstract device JAX's GPU table maps to each compute capability (Mosaic GPU reads the arch from it).
DEVICE_KINDS = {90: "NVIDIA H100", 100: "NVIDIA B200"}


@contextlib.contextmanager
def _on_gpu(arch: int) -> Iterator[None]:
    """jattn's platform facts as on a GPU of compute capability ``arch``, its Mosaic GPU kernels the only backend."""
    saved = platform_facts.platform, platform_facts.compute_capability, jax.default_backend, pallas_path.gpu_backends
    platform_facts.platform, jax.default_backend = (lambda: "gpu"), (lambda: "gpu")
    platform_facts.compute_capability = lambda: arch
    pallas_path.gpu_backends = lambda cc: (backend_for(cc),)
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[arch], num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        platform_facts.platform, platform_facts.compute_capability, jax.default_backend, pallas_path.gpu_backends = (
            saved
        )


def _modules(module) -> Iterator[tuple[str, bytes]]:
    """``(name, serialized module)`` of each ``mosaic_gpu_v2`` call in a lowered StableHLO module."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    def name(bytecode: bytes) -> str:
        ctx = jax_mlir.make_ir_context()
        mosaic_gpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True  # its serialized ops' dialect (stable_mosaic_gpu): the name is enough
        with ctx:
            return ir.StringAttr(ir.Module.parse(bytecode).operation.attributes["sym_name"]).value

    def walk(op) -> Iterator[tuple[str, bytes]]:
        op = op.operation if hasattr(op, "operation") else op
        target = op.attributes["call_target_name"] if op.name == "stablehlo.custom_call" else None
        if target is not None and ir.StringAttr(target).value == "mosaic_gpu_v2":
            bytecode = ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["module"]).value_bytes
            yield name(bytecode), bytecode
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    yield from walk(child)

    yield from walk(module.operation)


def extract(variant: str, D: int, dtype: str, arch: int) -> tuple[dict[str, dict], list[str]]:
    """``({kernel: {module, key}}, refusals)``: each Mosaic GPU kernel of one configuration once, and the refusals.

    ``kernel`` is the name without its ``jattn_mosaic_`` prefix; ``key`` hashes the module (a kernel that two
    programs share compiles once). A program whose kernel refuses the configuration by name (the tcgen05 kernels
    past their shared memory at D=256; the paged kernel's widest pages) is listed in ``refusals``, not lowered.
    """
    fns, args = programs(variant, D, dtype)
    found: dict[str, dict] = {}
    refusals: list[str] = []
    with _on_gpu(arch):
        for program, fn in fns.items():
            try:
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            except (KernelRefusalError, ValueError) as e:
                if "Mosaic GPU" not in str(e):
                    raise
                refusals.append(f"{program}: {str(e).splitlines()[0]}")
                continue
            for name, module in _modules(lowered.compiler_ir("stablehlo")):
                key = hashlib.sha256(module).hexdigest()[:16]
                found.setdefault(name.removeprefix("jattn_mosaic_"), dict(module=module, key=key))
    return found, refusals
