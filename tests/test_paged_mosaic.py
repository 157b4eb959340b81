"""jattn.paged_attention's Mosaic GPU kernel (Hopper sm_90, :mod:`jattn._paged.mosaic`): interpreted and lowered.

In Mosaic GPU's interpret mode (jax 0.12+; older JAX skips those tests, as tests/test_mosaic_gpu.py does), the
kernel chosen as an sm_90 GPU chooses it: values against tests/reference.py's float64 attention on each
request's keys gathered from its pages (random order, junk past each request's pages), decode and prefill mixed,
GQA, causal and sliding windows, bfloat16; a request's bits alone and in a batch, and unchanged by NaN in stale
slots. Lowered for CUDA sm_90 without a GPU: one ``mosaic_gpu`` custom call, and float32 (refused by name)
falling back to the Triton kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks
from jattn._paged import mosaic, pallas
from jattn._paged.checks import check_paged
from tests import reference as ref
from tests.cuda_lowering import cuda_text
from tests.paged_cases import Case, case, reference_rows

PAD = 2  # padding tokens past cu_q_lens[R]
needs_interpreter = pytest.mark.skipif(
    jax.__version_info__ < (0, 12), reason=f"Mosaic GPU's interpreter runs the kernel from jax 0.12 ({jax.__version__})"
)


def _case(seed: int, q_lens, kv_lens, Z: int = 64, heads=(4, 2), depths=(64, 64)) -> Case:
    """:func:`tests.paged_cases.case` with this file's sizes."""
    return case(seed, q_lens, kv_lens, Z, heads, depths, PAD)


@pytest.fixture
def mosaic_chosen(monkeypatch):
    """The Mosaic GPU kernel interpreted, where an sm_90 GPU would lower it (the Triton kernel must not run)."""
    monkeypatch.setattr(pallas, "backends", lambda interpret: ("mosaic_gpu", "triton"))
    monkeypatch.setattr(pallas, "_call", lambda *a: pytest.fail("the Triton kernel ran"))


CASES = {  # name: (q_lens, kv_lens, heads (N, K), depths (D, E), mask)
    "mixed-gqa-causal": ([1, 20, 0, 3], [150, 20, 10, 70], (6, 2), (64, 64), masks.causal()),  # 48 rows: 64
    "mixed-window-group-8": ([1, 18], [140, 90], (8, 1), (128, 64), masks.sliding_window(40)),  # 128 rows
}


@pytest.fixture
def splits(request, monkeypatch) -> None:
    """``"split-64"``: splits of one page of 64 keys merged by log-sum-exp."""
    if request.param == "split-64":
        monkeypatch.setattr(pallas, "SPLIT_KV", 64)


@needs_interpreter
@pytest.mark.parametrize(
    ("name", "splits"), [("mixed-gqa-causal", "one split"), ("mixed-window-group-8", "split-64")], indirect=["splits"]
)
def test_values_against_the_reference_in_interpret_mode(mosaic_chosen, name, splits):
    q_lens, kv_lens, heads, depths, mask = CASES[name]
    c = _case(1, q_lens, kv_lens, heads=heads, depths=depths)
    out, lse = jattn.paged_attention(*c.args(jnp.bfloat16), mask=mask, return_lse=True, implementation="pallas")
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    want = reference_rows(c, jnp.bfloat16, mask)
    np.testing.assert_allclose(ref.f64(out), want[0], **ref.tol(jnp.bfloat16))
    np.testing.assert_allclose(ref.f64(lse), want[1], **ref.tol(jnp.bfloat16))
    assert np.all(np.asarray(out[-PAD:]) == 0) and np.all(np.asarray(lse[-PAD:]) == -np.inf)  # padding rows


@needs_interpreter
def test_a_request_has_the_same_bits_alone_and_in_a_batch(mosaic_chosen):
    """Request 0 alone, and at position 1 of a batch with its pages elsewhere in a bigger pool."""
    alone = _case(2, [9], [75])
    batch = _case(3, [1, 9, 4], [20, 75, 90])
    pages = batch.table[1, :2]
    batch.k_pages[pages], batch.v_pages[pages] = alone.k_pages[alone.table[0, :2]], alone.v_pages[alone.table[0, :2]]
    batch.q[batch.cu[1] : batch.cu[2]] = alone.q[:9]
    one = jattn.paged_attention(*alone.args(jnp.bfloat16), return_lse=True, implementation="pallas")
    many = jattn.paged_attention(*batch.args(jnp.bfloat16), return_lse=True, implementation="pallas")
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(np.asarray(a[:9]), np.asarray(b[batch.cu[1] : batch.cu[2]]))


@needs_interpreter
def test_no_data_race_in_shared_memory(mosaic_chosen, monkeypatch):
    """Mosaic GPU's interpreter checking every shared-memory access (TMA copies of each page, wgmma) for races."""
    monkeypatch.setattr(mosaic, "DETECT_RACES", True)
    c = _case(4, [2], [130])
    out = jattn.paged_attention(*c.args(jnp.bfloat16), implementation="pallas")
    np.testing.assert_allclose(
        ref.f64(out), reference_rows(c, jnp.bfloat16, masks.causal())[0], **ref.tol(jnp.bfloat16)
    )


@needs_interpreter
def test_stale_slots_do_not_leak_in_interpret_mode(mosaic_chosen):
    """NaN in every stale slot (past kv_len on a request's pages, pages no table names) changes no bit of the output.

    The kernel zeroes v past kv_len on a request's last page (0 weight times NaN is NaN); kv_len 64 fills its page.
    """
    c = _case(6, [1, 20, 0, 3], [150, 64, 10, 70], heads=(6, 2))
    want = jattn.paged_attention(*c.args(jnp.bfloat16), return_lse=True, implementation="pallas")
    Z = c.k_pages.shape[1]
    used = np.zeros(c.k_pages.shape[:2], bool)
    for r, kv in enumerate(c.kv_lens):
        for j in range(kv):
            used[c.table[r, j // Z], j % Z] = True
    assert not used.all()
    c.k_pages[~used], c.v_pages[~used] = np.nan, np.nan
    got = jattn.paged_attention(*c.args(jnp.bfloat16), return_lse=True, implementation="pallas")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.fixture
def on_sm90(monkeypatch):
    """An sm_90 GPU's platform facts: the kernel is lowered, not interpreted."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(platform_facts, "compute_capability", lambda: 90)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.mark.parametrize(("heads", "dtype"), [((8, 2), jnp.bfloat16), ((8, 1), jnp.float16)])  # 64, 128 rows
def test_lowered_for_sm90_to_one_mosaic_gpu_call_and_float32_to_triton(on_sm90, heads, dtype):
    """implementation=None on sm_90: 16-bit pools take the Mosaic GPU kernel; float32, refused by it by name, Triton."""
    c = _case(5, [1, 5, 20], [40, 5, 130], heads=heads)
    lower = lambda dtype: cuda_text(lambda *a: jattn.paged_attention(*a, return_lse=True), *c.args(dtype))  # noqa: E731
    text = lower(dtype)
    assert text.count("@mosaic_gpu") == 1 and "__gpu$xla.gpu.triton" not in text
    if platform_facts.has_pallas_triton():
        text = lower(jnp.float32)
        assert text.count("__gpu$xla.gpu.triton") == 1 and "@mosaic_gpu" not in text
    p = c.args(jnp.float32)
    assert "float32 inputs" in mosaic.refusal(check_paged(*p, None, None), interpret=False)


# (Z, D, heads): a page of Z tokens at D = E, N query heads on K kv heads (64 rows a program at G <= 4, 128 at 8)
FITS = [(64, 256, (8, 2)), (256, 128, (8, 2)), (128, 128, (8, 1))]
OVER = [(128, 256, (8, 2)), (256, 128, (8, 1))]


def test_pages_whose_tiles_overflow_shared_memory_are_refused_by_name_and_only_those(on_sm90, monkeypatch):
    """Mosaic GPU's lowering checks a kernel's shared memory against a block's 227 KiB (and raises past it): the
    configurations the kernel admits lower to it; those it refuses by name take another kernel, and admitted
    anyway would not lower."""

    def lowered(Z, D, heads):
        c = _case(5, [1, 5, 20], [40, 5, 330], Z=Z, heads=heads, depths=(D, D))
        return cuda_text(lambda *a: jattn.paged_attention(*a, return_lse=True), *c.args(jnp.bfloat16))

    for Z, D, heads in FITS:
        assert lowered(Z, D, heads).count("@mosaic_gpu") == 1, (Z, D, heads)
    for Z, D, heads in OVER:
        c = _case(5, [1, 5, 20], [40, 5, 330], Z=Z, heads=heads, depths=(D, D))
        why = mosaic.refusal(check_paged(*c.args(jnp.bfloat16), None, None), interpret=False)
        assert why is not None and "shared memory" in why, (Z, D, heads)
        assert "@mosaic_gpu" not in lowered(Z, D, heads)
    monkeypatch.setattr(mosaic, "SMEM_LIMIT", 10**9)  # admitted anyway: Mosaic GPU's own check raises
    for Z, D, heads in OVER:
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            lowered(Z, D, heads)
