"""The fused kernels lower for the hardware they are written for, checked on a CPU (issue #45).

``jax.jit(f).trace(*args).lower(lowering_platforms=(...,))`` builds the program the accelerator would
compile: a kernel that cannot be lowered for its hardware fails here, in CI, without one.

TPU: splash attention is a Mosaic ``tpu_custom_call`` (forward one, backward two: dK/dV and dQ); the
same call lowered for the CPU runs the kernel in interpret mode and holds none. The platform switch
selects the TPU translation, as in tests/test_pallas.py.

GPU: jattn's kernel must reach Triton in every derivative it takes; the platform facts are switched
to a GPU (jattn's platform switch, and the backend the kernel asks whether to interpret on), so the
kernel is lowered rather than interpreted. The forward is one ``__gpu$xla.gpu.triton`` call, the
gradient three (forward, dq, dk/dv), the jvp one (the forward and its tangent in one kernel),
``linearize`` two (forward, then tangent); no program holds a ``(T, S)``-shaped array (nor one of
the padded lengths). Lowered for sm_80 and sm_90 (jax 0.11+; jax 0.10 lowers for sm_90 only without a
GPU): tests/cuda_lowering.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._platform as platform_facts
from jattn import masks, score_mods
from jattn._gpu import tuning
from tests.cuda_lowering import ARCHS, ARCHS_CHOSEN, cuda_text

ROOT = Path(__file__).resolve().parents[1]

TPU_CASES = {
    # name: (mask, score_mod, q lead, kv lead): grouped heads B=2, K=3, G=4 (q_offset 6: T=131, S=97)
    "causal-gqa": (masks.causal(), None, (2, 3, 4), (2, 3, 1)),
    "window-softcap-gqa": (masks.sliding_window(40), jattn.score_mods.softcap(3.0), (2, 3, 4), (2, 3, 1)),
    "causal-segments-softcap": (
        masks.causal()
        & masks.segment_ids(np.arange(2 * 131).reshape(2, 131) // 50, np.arange(2 * 97).reshape(2, 97) // 50),
        jattn.score_mods.softcap(3.0),
        (2, 3),
        (2, 1),
    ),
}

B, K, G, T, S, D = 2, 2, 2, 40, 72, 64


def _padded(arch: str) -> tuple[int, int]:
    """T and S padded to the blocks the tuning table gives bfloat16 at D on ``arch`` (``"sm_90"``)."""
    bq, bk = tuning.choose(int(arch.removeprefix("sm_")), jnp.bfloat16, D).blocks
    return -(-T // bq) * bq, -(-S // bk) * bk


CASES = {
    "causal": dict(mask=masks.causal()),
    "sliding-window": dict(mask=masks.sliding_window(16)),
    "segment-ids": dict(
        mask=masks.segment_ids(np.arange(B * T).reshape(B, T) // 9, np.arange(B * S).reshape(B, S) // 16)
    ),
    "softcap-causal": dict(mask=masks.causal(), score_mod=score_mods.softcap(30.0)),
    "dropout-causal-window": dict(
        mask=masks.causal() & masks.sliding_window(16), dropout_rate=0.1, dropout_rng=jax.random.key(0)
    ),
    "alibi-padding": dict(
        mask=masks.padding(kv_lengths=np.array([30, 72])), score_mod=score_mods.alibi(jnp.ones((K * G,)))
    ),
}


def _programs(case):
    """``(forward, grad)`` of implementation='pallas' for the case, with their arguments."""
    mask, mod, lq, lkv = TPU_CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.normal(size=(*lead, n, 8)), jnp.float32) for lead, n in ((lq, 131), (lkv, 97), (lkv, 97))
    )

    def forward(q, k, v):
        return jattn.attention(q, k, v, mask=mask, score_mod=mod, q_offset=6, implementation="pallas")

    grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)), argnums=(0, 1, 2))
    return forward, grad, (q, k, v)


@pytest.mark.parametrize("case", list(TPU_CASES))
def test_splash_lowers_to_mosaic_for_tpu_and_to_interpret_mode_for_cpu(monkeypatch, case):
    monkeypatch.setattr(platform_facts, "platform", lambda: "tpu")
    forward, grad, args = _programs(case)
    for fn, kernels in ((forward, 1), (grad, 3)):
        traced = jax.jit(fn).trace(*args)
        tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
        assert tpu.count("@tpu_custom_call") == kernels, (fn, tpu.count("@tpu_custom_call"))
        assert "@tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel is lowered, not interpreted


@pytest.fixture
def triton(on_gpu, monkeypatch):
    """jattn's Triton kernel: the one the automatic choice takes on sm_80-89 (lowered here for the test's arch)."""
    monkeypatch.setattr(platform_facts, "compute_capability", lambda: 80)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("implementation", ["pallas", None])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_grad_and_jvp_lower_to_triton_without_a_score_matrix(triton, case, implementation, arch):
    """Named, and by the automatic choice: on a GPU these calls reach jattn's kernel by default (sm_80 and sm_90)."""
    kw = CASES[case]
    q = jnp.zeros((B, K, G, T, D), jnp.bfloat16)
    k, v = jnp.zeros((B, K, 1, S, D), jnp.bfloat16), jnp.zeros((B, K, 1, S, D), jnp.bfloat16)

    def f(q, k, v):
        return jattn.attention(q, k, v, implementation=implementation, **kw)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    def jvp(q, k, v):
        return jax.jvp(f, (q, k, v), (q, k, v))

    def linearized(q, k, v):
        return jax.linearize(f, q, k, v)[1](q, k, v)

    for fn, calls in ((f, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3), (jvp, 1), (linearized, 2)):
        text = cuda_text(fn, q, k, v, arch=arch)
        assert text.count("__gpu$xla.gpu.triton") == calls, (case, fn)
        assert (fn is jvp) == ("jattn_gpu_forward_tangent" in text)
        for t, s in ((T, S), _padded(arch)):
            assert not re.search(rf"\b{t}x{s}x", text), f"a ({t}, {s}) array in the {case} program"


def test_a_score_mod_triton_cannot_lower_is_refused_and_the_automatic_choice_passes_it_on(triton):
    """T5's bias reads a table per score (a gather): the kernel refuses it by name, and None lowers without it."""
    q = jnp.zeros((B, K * G, T, D), jnp.float32)
    k = jnp.zeros((B, K * G, S, D), jnp.float32)
    mod = score_mods.relative_position_bias(jnp.ones((32, K * G)))
    with pytest.raises(ValueError, match=r"score_mod: per score it reads gather.*Triton cannot lower") as e:
        cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=mod, implementation="pallas"), q, k)
    assert type(e.value).__name__ == "KernelRefusalError"
    text = cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=mod), q, k)
    assert "__gpu$xla.gpu.triton" not in text
    alibi = score_mods.alibi(jnp.ones((K * G,)))  # a function of the row and the positions: still the kernel
    assert cuda_text(lambda q, k: jattn.attention(q, k, k, score_mod=alibi), q, k).count("__gpu$xla.gpu.triton") == 1


def test_second_order_keeps_the_first_order_kernels_and_no_score_matrix(triton):
    """grad of grad in (q, learned ALiBi slopes) with documents: the first-order terms in Triton (the forward,
    dq and dk/dv kernels), the second-order terms on the blockwise path (XLA tiles): O(T) memory, no (T, S)
    array, which the dense path would hold."""
    T2, S2, N = 1031, 1153, 3
    q = jnp.zeros((1, N, T2, D), jnp.float32)
    k = jnp.zeros((1, N, S2, D), jnp.float32)
    ids = (np.arange(T2)[None] // 300, np.arange(S2)[None] // 300)
    mask = masks.causal() & masks.segment_ids(*ids)

    def loss(q, slopes):
        return jnp.sum(jattn.attention(q, k, k, mask=mask, score_mod=score_mods.alibi(slopes)) ** 2)

    def norm(q, slopes):
        dq, ds = jax.grad(loss, argnums=(0, 1))(q, slopes)
        return jnp.sum(dq**2) + jnp.sum(ds**2)

    text = cuda_text(jax.grad(norm, argnums=(0, 1)), q, jnp.ones((N,), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") >= 3
    assert not re.search(rf"\b{T2}x{S2}x", text), "a (T, S) array in the second-order program"


_NOTICE_SCRIPT = """
import logging, jax, jax.numpy as jnp, jattn, jattn._platform as facts
from tests.cuda_lowering import ARCHS, ARCHS_CHOSEN, cuda_text
facts.platform = lambda: "gpu"; jax.default_backend = lambda: "gpu"
logging.basicConfig(format="NOTICE %(name)s %(message)s")
q = jnp.zeros((2, 6, 21, 16), jnp.bfloat16)
for arch in ARCHS * 2:
    text = cuda_text(lambda q: jattn.attention(q, q, q, implementation="pallas"), q, arch=arch)
    assert ("triton" in text) == (arch == "sm_80") and ("@mosaic_gpu" in text) == (arch == "sm_90")
"""


def test_the_triton_deprecation_reaches_the_user_as_one_notice():
    """jax 0.11+ deprecates Pallas' Triton backend. A user running with DeprecationWarnings as errors lowers jattn's
    kernel twice for each arch without one, and sees one notice on the ``jattn`` logger (in a fresh process, as a
    user does), for sm_80's Triton kernel (sm_90 takes the Mosaic GPU one); jax 0.10 has nothing to answer."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", _NOTICE_SCRIPT],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    notices = [line for line in run.stderr.splitlines() if line.startswith("NOTICE jattn")]
    if jax.__version_info__ < (0, 11):
        assert notices == []
    else:  # sm_90 takes the Mosaic GPU kernel: nothing to answer there
        assert len(notices) == 1 and "compute capability 8.0" in notices[0] and "deprecates" in notices[0], notices


def test_a_jax_without_pallas_triton_refuses_the_kernel_by_name(triton, monkeypatch):
    """Where JAX has dropped Pallas' Triton backend, implementation='pallas' raises a refusal naming it, and the
    automatic choice lowers without the kernel."""
    monkeypatch.setattr(platform_facts, "has_pallas_triton", lambda: False)  # on sm_80-89 (the fixture)
    q = jnp.zeros((B, K * G, T, D), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"lowers on Pallas' Triton backend, which jax .* no longer has") as e:
        cuda_text(lambda q: jattn.attention(q, q, q, implementation="pallas"), q)
    assert type(e.value).__name__ == "KernelRefusalError"
    assert "__gpu$xla.gpu.triton" not in cuda_text(lambda q: jattn.attention(q, q, q), q)


@pytest.mark.parametrize("arch", ARCHS_CHOSEN)
def test_the_automatic_choice_takes_the_kernel_of_the_compute_capability(on_gpu, arch):
    """implementation=None on a GPU: sm_90 and sm_100 take the Mosaic GPU kernel (sm_100's tcgen05 one from jax
    0.12, Triton before), sm_80 the Triton one; float32, which the Mosaic GPU kernel refuses (tf32), Triton on
    every arch. The compute capability is the abstract device's (jax 0.11+), or 90 without one (jax 0.10)."""
    mosaic = arch == "sm_90" or (arch == "sm_100" and jax.__version_info__ >= (0, 12))
    for dtype, want in ((jnp.bfloat16, "@mosaic_gpu" if mosaic else "__gpu$xla.gpu.triton"),
                        (jnp.float32, "__gpu$xla.gpu.triton")):  # fmt: skip
        q = jnp.zeros((B, K * G, T, D), dtype)
        text = cuda_text(lambda q: jattn.attention(q, q, q, mask=masks.causal()), q, arch=arch)
        other = "__gpu$xla.gpu.triton" if want == "@mosaic_gpu" else "@mosaic_gpu"
        assert text.count(want) == 1 and other not in text, (arch, dtype)


@pytest.mark.skipif(jax.__version_info__ < (0, 12), reason="the Mosaic GPU compile check lowers with jax 0.12+")
def test_the_mosaic_extract_finds_each_kernel_by_name_and_lists_what_jattn_refuses():
    """Lowered for an H100, the gradient, jvp and linearize programs hold jattn's five Mosaic GPU kernels, each once
    (no Triton kernel); for a B200 at D=256 each program is refused by name (its tiles pass shared memory)."""
    from bench.mosaic_extract import extract

    kernels, refused = extract("plain", 64, "bfloat16", 90)
    assert sorted(kernels) == ["dkdv", "dq", "forward", "forward_tangent", "tangent"] and not refused
    assert all(k["module"].startswith(b"ML\xefR") for k in kernels.values())  # MLIR bytecode
    kernels, refused = extract("plain", 256, "bfloat16", 100)
    assert not kernels and len(refused) == 3 and all("227 KiB of shared memory" in r for r in refused)
