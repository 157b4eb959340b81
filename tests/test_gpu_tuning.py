"""The GPU kernel's launches are the tuning table's (jattn/_gpu/tuning.py), read from the CUDA lowering.

Each ``__gpu$xla.gpu.triton`` custom call carries its launch in its backend config (``num_warps``,
``num_stages``), its grid (``grid_y``: the query or key blocks, so the tiles) and its Triton module
(MLIR bytecode, re-read here with jaxlib's Triton dialect: the float32 dots' input precision). Lowered
for sm_80 and sm_90 where JAX can (jax 0.11+, tests/cuda_lowering.py); jax 0.10 lowers for sm_90 only
without a GPU, and the compute capability jattn reads is set instead. The compiled statistics behind the
table (shared memory, registers, spills) are ``make compile-check``'s (bench/triton_compile.py).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

import jattn
import jattn._paths.pallas as pallas_path
import jattn._platform as platform_facts
from jattn import masks
from jattn._gpu import tuning
from tests.cuda_lowering import ARCHS, cuda_text

B, N, T, S = 1, 3, 200, 300

#: (arch, dtype, D): cells whose choices differ (tiles; warps, per kernel in the first).
CELLS = [(80, jnp.bfloat16, 128), (90, jnp.float16, 64), (90, jnp.float32, 256), (80, jnp.float32, 64)]


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel is lowered, not interpreted
    # the Triton kernel on every arch (on sm_90 the automatic choice takes it for what the Mosaic GPU one refuses)
    monkeypatch.setattr(pallas_path, "gpu_backends", lambda cc: ("triton",))


def _lowered(monkeypatch, arch: int, fn, *args) -> str:
    """``fn`` lowered for CUDA on sm_``arch``: JAX's target where it can set one, else jattn's compute capability."""
    if f"sm_{arch}" in ARCHS:
        return cuda_text(fn, *args, arch=f"sm_{arch}")
    monkeypatch.setattr(platform_facts, "compute_capability", lambda: arch)
    return cuda_text(fn, *args, arch="sm_90")


def _calls(text: str) -> list[dict]:
    """``{kernel, grid_y, num_warps, num_stages, ir}`` of each Triton call in a lowered program's text."""
    calls = []
    for chunk in text.split("mhlo.backend_config = {")[1:]:
        ir = re.search(r'ir = "([^"]*)"', chunk).group(1)
        rest = chunk.replace(ir, "", 1)
        field = {k: int(re.search(rf"\b{k} = (\d+)", rest).group(1)) for k in ("grid_y", "num_warps", "num_stages")}
        name = re.search(r'name = "jattn_gpu_(\w+)"', rest).group(1)
        calls.append(dict(kernel=name, ir=ir, **field))
    return calls


def _programs(dtype, D: int):
    """The gradient (forward, dq, dk/dv) and jvp (forward+tangent) programs, and their operands."""
    q = jnp.zeros((B, N, T, D), dtype)
    k = v = jnp.zeros((B, N, S, D), dtype)

    def f(q, k, v):
        return jattn.attention(q, k, v, mask=masks.causal(), implementation="pallas")

    def grad(q, k, v):
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    return (grad, lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))), (q, k, v)


@pytest.mark.parametrize(("arch", "dtype", "D"), CELLS)
def test_each_kernel_launches_with_the_tables_warps_stages_and_tiles(on_gpu, monkeypatch, arch, dtype, D):
    choice = tuning.choose(arch, dtype, D)
    fns, args = _programs(dtype, D)
    seen = set()
    for fn in fns:
        for call in _calls(_lowered(monkeypatch, arch, fn, *args)):
            kernel, (warps, stages) = call["kernel"], choice.launch(call["kernel"])
            assert (call["num_warps"], call["num_stages"]) == (warps, stages), (kernel, call)
            blocks = math.ceil(S / choice.blocks[1]) if kernel == "dkdv" else math.ceil(T / choice.blocks[0])
            assert call["grid_y"] == blocks, (kernel, call["grid_y"], choice.blocks)
            seen.add(kernel)
    assert seen == {"forward", "dq", "dkdv", "forward_tangent"}


def test_the_cells_tested_choose_differently():
    """The lowering test above could not pass with one fixed launch: its cells' choices differ."""
    choices = [tuning.choose(*cell) for cell in CELLS]
    assert len({c.blocks for c in choices}) > 1
    assert len({c.launch(k) for c in choices for k in tuning.KERNELS}) > 1


def _ttir(ir: str) -> str:
    """The Triton module of a backend config's ``ir`` (MLIR's escaped bytecode) as MLIR text."""
    from jax._src.lib.mlir import ir as mlir
    from jaxlib.triton import dialect as tt_dialect

    raw = re.sub(r"\\(\\|[0-9A-Fa-f]{2})", lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)), ir)
    ctx = mlir.Context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        return mlir.Module.parse(raw.encode("latin-1")).operation.get_asm(enable_debug_info=False)


def _dots(ttir: str) -> set[tuple[str, str]]:
    """``(input precision, operand element type)`` of every ``tt.dot`` (no attribute printed: ``ieee``, the default)."""
    found = set()
    for line in re.findall(r"tt\.dot [^\n]*", ttir):
        precision = re.search(r"inputPrecision = (\w+)", line)
        operand = re.search(r": tensor<[0-9x]+x(\w+)>", line).group(1)
        found.add((precision.group(1) if precision else "ieee", operand))
    return found


@pytest.mark.parametrize("arch", [80, 90])
def test_float32_dots_take_the_tables_algorithm_and_16_bit_dots_their_inputs(on_gpu, monkeypatch, arch):
    """float32: every ``tt.dot`` of every kernel has the table's input precision; bfloat16: bfloat16 operands."""
    want = tuning.choose(arch, jnp.float32, 64).precision
    for dtype in (jnp.float32, jnp.bfloat16):
        (grad, jvp), args = _programs(dtype, 64)
        for fn in (grad, jvp):
            for call in _calls(_lowered(monkeypatch, arch, fn, *args)):
                dots = _dots(_ttir(call["ir"]))
                if dtype == jnp.float32:
                    assert dots == {(want, "f32")}, (call["kernel"], dots)
                else:
                    assert {operand for _, operand in dots} == {"bf16"}, (call["kernel"], dots)


def test_precision_is_refused_by_name(on_gpu):
    """The kernel fixes its own dots (the table's): an explicit precision= is a ValueError naming it."""
    q = jnp.zeros((B, N, 7, 16), jnp.float32)
    with pytest.raises(ValueError, match="precision"):
        jattn.attention(q, q, q, precision=jax.lax.Precision.HIGHEST, implementation="pallas")


def test_every_chip_takes_the_row_of_the_largest_table_arch_it_reaches():
    for dtype, D in ((jnp.bfloat16, 16), (jnp.float16, 128), (jnp.float32, 256)):
        for arch, row in ((75, 80), (80, 80), (86, 80), (89, 80), (90, 90), (100, 90), (120, 90)):
            assert tuning.choose(arch, dtype, D) == tuning.TABLE[(row, tuning.dtype_class(dtype), max(64, D))]
