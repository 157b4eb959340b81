"""``implementation='pallas'``: jattn's arguments handed to a fused Pallas kernel of the platform.

On GPU it is jattn's own kernel (:mod:`jattn._gpu`: forward, dq and dk/dv kernels in Pallas,
lowered by Triton): any position predicate, padding() and segment_ids() as per-tile kinds
computed outside the kernel, ``score_mod`` in the kernel, sinks, dropout (the blockwise path's
bits) and a differentiable log-sum-exp,
grouped heads without repeating k and v, any T and S, head depths up to 256. On CPU the same
kernel runs in Pallas *interpret* mode: exact, slow, and how jattn tests it (there is no GPU in
CI). On TPU it is splash attention (:func:`jattn._paths.splash.splash_attention`), also tested in
interpret mode on CPU; of the score mods it takes :func:`jattn.score_mods.softcap` (splash's soft-cap),
no sinks and no log-sum-exp. Which kernel:
:func:`kernel_platform`. What a kernel cannot take raises
:class:`jattn._checks.KernelRefusalError` (a ``ValueError``) naming the argument.
"""

from __future__ import annotations

import functools

import jax
from jax import Array

from jattn import _platform
from jattn._blockwise import blockwise_path
from jattn._checks import KernelRefusalError, Operands, Options, Result
from jattn._gpu import backend_for, gpu_attention
from jattn._paths.choice import kernel_refusal
from jattn._paths.splash import splash_attention

__all__ = ["gpu_backends", "kernel_platform", "pallas_path"]


def kernel_platform() -> tuple[str, bool]:
    """The kernel for this platform and whether it runs in interpret mode.

    ``'tpu'`` (splash attention) where :func:`jattn._platform.platform` says TPU, ``'gpu'``
    otherwise; interpreted unless JAX's backend is that platform (so on CPU; tests switch the
    platform to run the TPU translation on CPU).
    """
    kernel = "tpu" if _platform.platform() == "tpu" else "gpu"
    return kernel, jax.default_backend() != kernel


def _splash_refusals(sinks, dropout_rate: float, return_lse: bool, return_max_logit: bool) -> None:
    """Raises :class:`jattn._checks.KernelRefusalError` for what splash attention (TPU) does not take here."""
    for used, name in (
        (sinks is not None, "sinks"),
        (dropout_rate != 0, "dropout_rate"),
        (return_lse, "return_lse"),
        (return_max_logit, "return_max_logit"),
    ):
        if used:
            raise kernel_refusal("pallas", name, "on TPU splash attention takes none")


def pallas_path(ops: Operands, opts: Options) -> Result:
    """``implementation='pallas'``: the platform's Pallas kernel (TPU: ``lse`` and ``max_logit`` None).

    ``out (..., T, E)`` in the dtype of v; on GPU ``lse`` (float32, differentiable) and the max logit (float32, each
    row's largest kept logit, a monitor whose derivative is 0). On TPU ``score_mod`` is :func:`jattn.score_mods.softcap`
    only. What the kernel cannot take raises :class:`jattn._checks.KernelRefusalError` before anything is built.
    The GPU kernel's backward is differentiated through the blockwise path (second order; :func:`_second_order`).
    """
    kernel, interpret = kernel_platform()
    if kernel == "tpu":
        _splash_refusals(opts.sinks, opts.dropout_rate, opts.return_lse, opts.return_max_logit)
        q, k, v, mask, _, scale, q_offset, kv_offset, lead, axis = ops
        out = splash_attention(q, k, v, mask, scale, q_offset, kv_offset, opts.blocks, interpret, lead, axis,
                               opts.score_mod)  # fmt: skip
        return Result(out, None, None)
    reference = functools.partial(_second_order, ops, opts)
    if interpret:  # on CPU: the Triton kernel's bodies, interpreted (tests choose the Mosaic GPU ones)
        return Result(*gpu_attention(ops, opts, interpret=True, reference=reference))
    return Result(*_on_a_gpu(ops, opts, reference))


def gpu_backends(compute_capability: int) -> tuple[str, ...]:
    """The backends jattn's GPU kernel tries on a GPU of ``compute_capability`` (90 for sm_90), in order.

    Hopper (sm_90): the Mosaic GPU kernel (``wgmma``), then the Triton one; datacenter Blackwell (sm_100,
    sm_103): the Mosaic GPU kernel on ``tcgen05``, then Triton; the rest (Ampere and Ada, sm_80-89; consumer
    Blackwell, sm_120) Triton alone, while JAX has it. The first that takes the call runs it; after them,
    ``implementation=None`` tries 'cudnn', then the blockwise path (:data:`jattn._paths.choice.AUTO_ORDER`).
    """
    first = backend_for(compute_capability)
    return (first,) if first == "triton" else (first, "triton")


def _on_a_gpu(ops: Operands, opts: Options, reference) -> tuple:
    """The first of :func:`gpu_backends` that takes the call, lowered; one refusal naming each reason if none does."""
    backends = gpu_backends(_platform.compute_capability())
    reasons = []
    for backend in backends:
        try:
            return gpu_attention(ops, opts, interpret=False, reference=reference, backend=backend)
        except KernelRefusalError as err:
            if len(backends) == 1:
                raise
            reasons.append(f"{backend}: {err}")
    raise KernelRefusalError(
        "implementation='pallas' (jattn's GPU kernel): no backend takes this call; " + "; ".join(reasons)
    )


def _second_order(ops: Operands, opts: Options, q, k, v, sinks, seeds, scale, score_mod, rows) -> tuple[Array, Array]:
    """``(out, lse)`` of the GPU kernel's padded call on the blockwise path (its reference, O(T) memory at any order).

    The kernel's operands in place of the call's: q, k, v, ``sinks``, the rows' dropout ``seeds (*lead)``, the
    traced scale folded into q (``scale``), the score mod reading the kernel's row values and the mask in row form.
    """
    ops = Operands(q, k, v, rows, None, scale, ops.q_offset, ops.kv_offset, ops.lead, ops.axis)
    opts = Options(None, None, score_mod, sinks, opts.dropout_rate, None, True, False, dropout_seeds=seeds)
    return blockwise_path(ops, opts)[:2]
