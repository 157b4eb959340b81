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

from collections.abc import Callable

import jax
from jax import Array

from jattn import _platform
from jattn._checks import Operands
from jattn._gpu import gpu_attention
from jattn._masks import Mask
from jattn._paths.choice import kernel_refusal
from jattn._paths.splash import splash_attention

__all__ = ["kernel_platform", "pallas_attention"]


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


def pallas_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Mask | None,
    scale,
    q_offset: int | None,
    kv_offset: int,
    blocks: tuple[int, int] | None,
    lead: tuple[int, ...],
    axis: int,
    score_mod=None,
    sinks: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
    second_order: Callable | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """``(out (..., T, E), lse (..., T), max logit (..., T))`` through the platform's Pallas kernel (TPU: ``lse``, ``max logit`` None).

    q ``(..., T, D)``, k ``(..., S, D)``, v ``(..., S, E)``.

    ``scale`` is a value, ``lead`` the call's leading shape and ``axis`` the axis of it where q's
    first axis (a per-example mask's batch) lands (:class:`jattn._checks.Operands`); offsets are
    static ints; ``blocks`` the kernel's ``(block_q, block_kv)``. Out is in the dtype of v; lse
    (float32, differentiable) and the max logit (float32, each row's largest kept logit, a monitor
    whose derivative is 0) only on GPU, None on TPU. ``score_mod``: on GPU any (in the kernel), on TPU
    :func:`jattn.score_mods.softcap` only. What the kernel cannot take raises
    :class:`jattn._checks.KernelRefusalError` before anything is built. ``second_order(ops, score_mod, sinks,
    dropout_rate, seeds) -> (out, lse)``: the path the GPU kernel's backward is differentiated through
    (second order; None refuses it), on operands whose mask is in row form.
    """
    kernel, interpret = kernel_platform()
    if kernel == "tpu":
        _splash_refusals(sinks, dropout_rate, return_lse, return_max_logit)
        out = splash_attention(q, k, v, mask, scale, q_offset, kv_offset, blocks, interpret, lead, axis, score_mod)
        return out, None, None

    def reference(q, k, v, sinks, seeds, scale, mod, rows):  # the GPU kernel's backward is differentiated through this
        ops = Operands(q, k, v, rows, None, scale, q_offset, kv_offset, lead, axis)
        return second_order(ops, mod, sinks, dropout_rate, seeds)

    return gpu_attention(
        q, k, v, mask=mask, scale=scale, q_offset=q_offset, kv_offset=kv_offset, blocks=blocks, lead=lead, axis=axis,
        score_mod=score_mod, sinks=sinks, dropout_rate=dropout_rate, dropout_rng=dropout_rng, interpret=interpret,
        reference=None if second_order is None else reference,
    )  # fmt: skip
