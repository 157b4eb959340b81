"""jattn.paged_attention's 'pallas' path: Pallas interpret mode on a CPU, and lowered for CUDA without a GPU.

Interpret mode runs the kernel's bodies exactly (slow: sizes are small); values against tests/reference.py's
float64 attention on each request's keys, gathered with NumPy from its pages (placed in random order, table
entries past a request's pages junk). Also: padding rows, a request's bits alone and in a batch, the refusals
naming 'xla', and the automatic choice on a GPU (lowered: one Triton call, no warning let through; sm_80 and
sm_90 on jax 0.11+, sm_90 on jax 0.10: tests/cuda_lowering.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks, score_mods
from jattn._paged import pallas
from tests import reference as ref
from tests.cuda_lowering import ARCHS, cuda_text
from tests.paged_cases import Case, case, reference_rows

PAD = 2  # padding tokens past cu_q_lens[R]


def _case(seed: int, q_lens, kv_lens, Z: int, heads=(6, 2), depths=(11, 7)) -> Case:
    """:func:`tests.paged_cases.case` with this file's sizes."""
    return case(seed, q_lens, kv_lens, Z, heads, depths, PAD)


CASES = {  # name: (q_lens, kv_lens, Z, heads (N, K), dtype, mask)
    "decode": ([1, 1, 1, 1], [37, 1, 130, 64], 16, (6, 2), jnp.float32, masks.causal()),
    "prefill": ([23, 40, 1], [23, 40, 1], 64, (4, 4), jnp.float32, masks.causal()),
    "mixed-bf16": ([1, 40, 0, 7, 18], [90, 40, 13, 50, 150], 16, (6, 2), jnp.bfloat16, masks.causal()),
    "mixed-window": ([1, 19, 6], [150, 180, 70], 16, (6, 2), jnp.float32, masks.sliding_window(17)),
    "window-two-sided-mqa": ([3, 20], [70, 20], 64, (3, 1), jnp.float32, masks.causal() & masks.sliding_window(20, 5)),
    "no-mask-bf16": ([1, 5], [100, 5], 64, (8, 2), jnp.bfloat16, None),
}


@pytest.fixture
def splits(request, monkeypatch) -> None:
    """``"split-32"``: splits of 32 keys (two pages of 16, four splits of a page of 64) merged by log-sum-exp."""
    if request.param == "split-32":
        monkeypatch.setattr(pallas, "SPLIT_KV", 32)


@pytest.mark.parametrize(
    ("name", "splits"),
    [*((name, "one split") for name in CASES), ("mixed-window", "split-32"), ("no-mask-bf16", "split-32")],
    indirect=["splits"],
)
def test_values_against_the_reference_in_interpret_mode(name, splits):
    q_lens, kv_lens, Z, heads, dtype, mask = CASES[name]
    c = _case(1, q_lens, kv_lens, Z, heads)
    out, lse = jattn.paged_attention(*c.args(dtype), mask=mask, return_lse=True, implementation="pallas")
    assert out.dtype == dtype and lse.dtype == jnp.float32
    want = reference_rows(c, dtype, mask)
    np.testing.assert_allclose(ref.f64(out), want[0], **ref.tol(dtype))
    np.testing.assert_allclose(ref.f64(lse), want[1], **ref.tol(dtype))
    assert np.all(np.asarray(out[-PAD:]) == 0) and np.all(np.asarray(lse[-PAD:]) == -np.inf)  # padding rows


@pytest.mark.parametrize("splits", ["one split", "split-32"], indirect=True)
def test_a_request_has_the_same_bits_alone_and_in_a_batch(splits):
    """Request 0 of a batch, moved to position 2 of another batch with its pages elsewhere in a bigger pool.

    Its table is narrower alone (fewer splits, with split-32): splits without keys change no bit."""
    alone = _case(2, [9], [75], 16)
    batch = _case(3, [1, 30, 9, 4], [20, 60, 75, 90], 16)
    P = alone.k_pages.shape[0]
    pages = batch.table[2, : -(-75 // 16)]
    batch.k_pages[pages], batch.v_pages[pages] = alone.k_pages[alone.table[0, :5]], alone.v_pages[alone.table[0, :5]]
    batch.q[batch.cu[2] : batch.cu[3]] = alone.q[:9]
    assert batch.k_pages.shape[0] > P
    one = jattn.paged_attention(*alone.args(), return_lse=True, implementation="pallas")
    many = jattn.paged_attention(*batch.args(), return_lse=True, implementation="pallas")
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(np.asarray(a[:9]), np.asarray(b[batch.cu[2] : batch.cu[3]]))


def test_refusals_name_xla(monkeypatch):
    c = _case(4, [1, 3], [20, 3], 16)
    with pytest.raises(ValueError, match="a score_mod; implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), score_mod=score_mods.softcap(30.0), implementation="pallas")
    with pytest.raises(ValueError, match=r"mask .* implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), mask=masks.global_tokens([0]) | masks.causal(), implementation="pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match=r"ragged paged attention takes k and v interleaved.*implementation='xla'"):
        jattn.paged_attention(*c.args(), implementation="pallas")


@pytest.fixture
def on_gpu(monkeypatch):
    """A GPU's platform facts: the kernel is lowered, not interpreted."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chosen_on_a_gpu_and_lowered_to_triton(on_gpu, arch, dtype):
    """implementation=None on a GPU: one Triton kernel (no DeprecationWarning escapes: warnings are errors)."""
    c = _case(5, [1, 5, 20], [40, 5, 70], 16, heads=(8, 2), depths=(64, 32))
    mask = masks.causal() if dtype == jnp.bfloat16 else masks.sliding_window(24)
    text = cuda_text(lambda *a: jattn.paged_attention(*a, mask=mask, return_lse=True), *c.args(dtype), arch=arch)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "jattn_paged_forward" in text


def test_lowered_refuses_what_the_triton_tiles_cannot_hold(on_gpu):
    c = _case(6, [1], [20], 8, depths=(64, 64))
    with pytest.raises(ValueError, match=r"pages of Z = 8 tokens.*implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), implementation="pallas")
    c = _case(6, [1], [20], 16, depths=(48, 64))
    with pytest.raises(ValueError, match=r"head depths D = 48.*implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), implementation="pallas")
    assert jattn.paged_attention(*c.args()).shape == (1 + PAD, 6, 64)  # None: the xla path takes it


@pytest.mark.parametrize(
    ("arch", "Z", "depth", "dtype", "why"),
    [
        (80, 64, 256, jnp.bfloat16, "shared memory"),  # 2 Z (D + E) 2 B = 131,072 B > sm_80's 101,376
        (80, 64, 128, jnp.float32, "shared memory"),
        (90, 64, 128, jnp.float32, "spill"),  # within sm_90's shared memory, but it spills (make compile-check)
    ],
)
def test_a_page_too_large_for_the_chip_is_refused_by_name(on_gpu, monkeypatch, arch, Z, depth, dtype, why):
    """Tiles the compile check measured over the chip's shared memory or spilling are refused before lowering
    (a smaller page takes them); implementation=None then takes XLA's tiles."""
    monkeypatch.setattr(platform_facts, "compute_capability", lambda: arch)
    c = _case(6, [1], [70], Z, depths=(depth, depth))
    with pytest.raises(ValueError, match=rf"pages of Z = {Z} tokens.*{why}.*implementation='xla' takes it"):
        jattn.paged_attention(*c.args(dtype), implementation="pallas")
    text = cuda_text(lambda *a: jattn.paged_attention(*a), *c.args(dtype), arch="sm_90")  # the chip's facts: arch
    assert "__gpu$xla.gpu.triton" not in text
    smaller = _case(6, [1], [70], 16, depths=(depth, depth))
    text = cuda_text(lambda *a: jattn.paged_attention(*a), *smaller.args(dtype), arch="sm_90")
    assert text.count("__gpu$xla.gpu.triton") == (1 if dtype != jnp.float32 or 16 * depth <= 4096 else 0)
