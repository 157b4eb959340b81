"""The 'xla' and 'cudnn' paths: a call of :func:`jattn.attention` handed to :func:`jax.nn.dot_product_attention`.

:func:`jax_nn_attention` translates jattn's arguments into jax.nn's (``is_causal``,
``local_window_size``, sequence lengths, a ``(B, 1, T, S)`` mask, q, k, v as ``(B, T|S, 1, D|E)``),
refuses what cuDNN cannot take (a :class:`jattn._checks.KernelRefusalError`, before anything is
built: the automatic choice then tries its next path), zeroes the rows with no key (jax.nn averages
v there) and gives jax.nn's log-sum-exp residual the dense path's gradient (jax.nn stops it). What each path
takes is :data:`jattn._paths.choice.SUPPORT`. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax import Array

from jattn._checks import KernelRefusalError, Operands, Options, Result
from jattn._masks import Causal, Mask, Padding, SlidingWindow, conjuncts, on_batch_axis, query_offset
from jattn._paths.dense import dense_lse, dense_mask
from jattn._softmax import zero_empty_rows

__all__ = ["cudnn_path", "jax_nn_attention", "xla_path"]


def _band(mask: Mask | None, d: int) -> tuple[int | None, int | None, Mask | None, list[Padding]]:
    """The band ``s - t in [-left, right]`` (None: unbounded) of the causal and window terms of ``mask``.

    ``d = q_offset - kv_offset`` moves jattn's band into jax.nn's top-left frame. Also returns the
    padding terms and the rest of the mask (the terms jax.nn has no argument for), or None.
    """
    left = right = None
    paddings: list[Padding] = []
    rest: Mask | None = None
    for term in [] if mask is None else conjuncts(mask):
        if isinstance(term, Causal | SlidingWindow):
            tl, tr = (None, d) if isinstance(term, Causal) else (term.left - d, term.right + d)
            left = tl if left is None else (left if tl is None else min(left, tl))
            right = tr if right is None else min(right, tr)
        elif isinstance(term, Padding):
            paddings.append(term)
        else:
            rest = term if rest is None else rest & term
    return left, right, rest, paddings


def _lengths(paddings: list[Padding], T: int, S: int, lead: tuple[int, ...], batch_axis: int) -> dict:
    """jax.nn's ``query_seq_lengths`` / ``key_value_seq_lengths`` ``(B,)`` of the padding terms (the least of each)."""
    kwargs: dict = {}
    for term in paddings:
        for name, x in (("query_seq_lengths", term.q_lengths), ("key_value_seq_lengths", term.kv_lengths)):
            if x is not None:
                x = jnp.minimum(jnp.asarray(x, jnp.int32), T if name[0] == "q" else S)
                x = on_batch_axis(x, lead, batch_axis).reshape(-1)
                kwargs[name] = x if name not in kwargs else jnp.minimum(kwargs[name], x)
    return kwargs


def _refuse_cudnn_mask(mask: Mask | None, band: tuple, T: int, S: int, q_offset: int, kv_offset: int) -> None:
    """Raises :class:`jattn._checks.KernelRefusalError` for mask terms cuDNN has no argument for.

    ``band`` is :func:`_band`'s ``(left, right, rest, paddings)``; ``q_offset`` is resolved.
    """
    _, right, rest, _ = band
    if right is not None and right != 0:
        raise KernelRefusalError(
            f"implementation='cudnn' expresses causal() and sliding_window(l, 0) only with queries aligned to the "
            f"keys' end (q_offset - kv_offset == S - T == 0), got {mask!r} with T={T}, S={S}, q_offset={q_offset}, "
            f"kv_offset={kv_offset}; use 'xla', 'dense' or 'blockwise'"
        )
    if rest is not None and not rest.has_arrays:
        raise KernelRefusalError(
            f"implementation='cudnn' expresses causal(), sliding_window(l, 0), padding() and arrays only, got "
            f"{rest!r}; use 'xla', 'dense' or 'blockwise'"
        )


def _refuse_cudnn_inputs(ops: Operands) -> None:
    """Raises :class:`jattn._checks.KernelRefusalError` where cuDNN has no kernel for q ``(..., T, D)``, k, bias.

    What :func:`jax.nn.dot_product_attention` checks while tracing (its ``NotImplementedError`` or
    ``RuntimeError``), checked before anything is built: bf16/f16 inputs, a head dim that is a
    multiple of 8 and at most 128 (256 from Hopper on), even lengths with a bias, a CUDA GPU.
    """
    q, T, S, D = ops.q, ops.q.shape[-2], ops.k.shape[-2], ops.q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        why = f"bfloat16 or float16 inputs only, got {q.dtype}"
    elif ops.bias is not None and (T % 2 or S % 2):
        why = f"a bias with even T and S only, got T={T}, S={S}"
    elif jax.default_backend() != "gpu" or "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
        why = f"a CUDA GPU only; JAX's backend is {jax.default_backend()!r}"
    else:
        capability = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
        top = 256 if capability >= (9, 0) else 128
        why = None if D % 8 == 0 and top >= D else f"a head dim D that is a multiple of 8 up to {top} only, got D={D}"
    if why:
        raise KernelRefusalError(f"implementation='cudnn' takes {why}; use 'pallas', 'xla', 'dense' or 'blockwise'")


def _jax_nn_args(band: tuple, T: int, S: int, lead: tuple[int, ...], batch_axis: int, path: str) -> dict:
    """jax.nn's own arguments for a jattn mask: ``is_causal``, ``local_window_size``, sequence lengths, ``mask``.

    jax.nn aligns queries top-left (query t sees key s <= t); jattn places query t at position
    ``q_offset + t`` and key s at ``kv_offset + s``, so a band ``i - L <= j <= i + R`` becomes
    ``local_window_size = (L - d, R + d)`` with ``d = q_offset - kv_offset`` (``band`` is
    :func:`_band`'s, in jax.nn's frame already). Terms jax.nn has no argument for are materialised
    into its ``mask`` (cudnn refuses those first: :func:`_refuse_cudnn_mask`). Padding lengths
    ``(B,)`` lie along ``lead``'s axis ``batch_axis``, where q's first axis lands (as for every path).
    """
    left, right, rest, paddings = band
    kwargs = _lengths(paddings, T, S, lead, batch_axis)
    if right is not None or left is not None:
        if right == 0 and (path == "cudnn" or left is None):
            kwargs["is_causal"] = True
        if left is not None or right != 0:
            kwargs["local_window_size"] = (T + S if left is None else left, T + S if right is None else right)
    if rest is not None:
        kwargs["mask"] = rest
    return kwargs


def _flat_lse(q: Array, k: Array, bias: Array | None = None, *, ops: Operands) -> Array:
    """The dense logits' log-sum-exp of all B·T rows of ``ops`` at these q, k, bias, flattened (what :func:`_lse_grad` differentiates)."""
    return dense_lse(ops._replace(q=q, k=k, bias=bias)).reshape(-1)


def _lse_grad(value: Array, ops: Operands) -> Array:
    """jax.nn's log-sum-exp ``value`` (any shape of B·T entries), differentiated as the dense path's.

    jax.nn stops its residual's gradient. Here it gets the derivative of the dense logits'
    log-sum-exp with respect to q, k and bias (:func:`_grad_from`). Everything traced that the
    dense one reads (mask arrays, v, offsets, scale) becomes an argument (the constants of its
    jaxpr), so it also holds where the backward runs outside the forward's ``jit``
    (``grad(jit(f))``).
    """
    diff = (ops.q, ops.k) if ops.bias is None else (ops.q, ops.k, ops.bias)
    closed = jax.make_jaxpr(functools.partial(_flat_lse, ops=ops))(*diff)
    return _grad_from(_Jaxpr(closed.jaxpr), value, diff, tuple(closed.consts))


class _Jaxpr:
    """A jaxpr as a function of its inputs and then its constants (for :func:`_grad_from`)."""

    def __init__(self, jaxpr) -> None:
        """Holds ``jaxpr`` (an open jaxpr whose constants become trailing arguments)."""
        self.jaxpr = jaxpr

    def __call__(self, *args: Array) -> Array:
        """The jaxpr's first output at ``(*inputs, *constants)``."""
        n = len(self.jaxpr.constvars)
        args, consts = args[: len(args) - n], args[len(args) - n :]
        return jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(self.jaxpr, consts))(*args)[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _grad_from(fn: _Jaxpr, value: Array, diff: tuple, rest: tuple) -> Array:
    """``value`` (no derivative of its own), differentiated as ``fn(*diff, *rest)`` (whose value it equals) in ``diff``.

    A custom JVP: its tangent is ``fn``'s, so reverse mode (JAX's transpose of it) and every higher
    order hold too; ``rest`` (mask arrays, v, offsets) has no derivative here.
    """
    return value


@_grad_from.defjvp
def _grad_from_jvp(fn: _Jaxpr, primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    value, diff, rest = primals
    _, d_diff, _ = tangents
    _, tangent = jax.jvp(lambda *d: fn(*d, *rest), diff, d_diff)
    return _grad_from(fn, value, diff, rest), tangent.reshape(value.shape).astype(value.dtype)


def _flat(x: Array, lead: tuple[int, ...]) -> Array:
    """``(..., L, D)`` (L: T or S; D or E) broadcast to ``(*lead, L, D)`` as jax.nn's ``(B, L, 1, D)``."""
    x = jnp.broadcast_to(x, (*lead, *x.shape[-2:]))
    return x.reshape(-1, x.shape[-2], 1, x.shape[-1])


def _flat_grid(x: Array, lead: tuple[int, ...], T: int, S: int) -> Array:
    """``(..., T, S)`` broadcast to ``(*lead, T, S)`` as jax.nn's ``(B, 1, T, S)``."""
    return jnp.broadcast_to(x, (*lead, T, S)).reshape(-1, 1, T, S)


def jax_nn_attention(ops: Operands, path: str, return_lse: bool) -> Array | tuple[Array, Array]:
    """Hands the call to ``jax.nn.dot_product_attention`` with its own arguments (see :data:`jattn._paths.choice.SUPPORT`).

    ``out (..., T, E)``, with ``lse (..., T)`` when ``return_lse``.
    """
    q, k, v, mask, bias, scale, q_offset, kv_offset, lead, axis = ops
    T, S = q.shape[-2], k.shape[-2]
    if T == 0 or S == 0:  # no key (or no query): every row is empty, 0 with lse -inf; jax.nn cannot reshape it
        out = jnp.zeros((*lead, T, v.shape[-1]), v.dtype)
        return (out, jnp.full((*lead, T), -jnp.inf, jnp.float32)) if return_lse else out
    q0 = query_offset(q_offset, kv_offset, T, S)
    band = _band(mask, q0 - kv_offset)
    if path == "cudnn":  # what cuDNN cannot take, refused before anything is built
        _refuse_cudnn_mask(mask, band, T, S, q0, kv_offset)
        _refuse_cudnn_inputs(ops)
    kwargs = _jax_nn_args(band, T, S, lead or (1,), axis, path)  # jax.nn needs a batch axis
    dense = dense_mask(kwargs.pop("mask", None), q, k, q_offset, kv_offset, lead, axis)
    with jax.numpy_dtype_promotion("standard"):  # jax.nn promotes bf16/f16 internally; callers may run strict
        out = jax.nn.dot_product_attention(
            _flat(q, lead),
            _flat(k, lead),
            _flat(v, lead),
            bias=None if bias is None else _flat_grid(bias, lead, T, S).astype(q.dtype),
            mask=None if dense is None else _flat_grid(dense, lead, T, S),
            scale=scale,
            implementation=path,
            return_residual=return_lse,
            **kwargs,
        )
    out, lse = out if return_lse else (out, None)
    if lse is not None:  # jax.nn stops the residual's gradient: take it from the dense logits'
        lse = _lse_grad(lse, ops)
    out = out.reshape(*lead, T, v.shape[-1])
    if mask is not None:  # jax.nn averages v over a fully masked row; the contract is 0 (and lse -inf)
        dense = dense_mask(mask, q, k, q_offset, kv_offset, lead, axis)  # (..., T, S): reduced before it is broadcast
        seen = jnp.broadcast_to(jnp.any(jnp.broadcast_to(dense, (*dense.shape[:-2], T, S)), axis=-1), (*lead, T))
        out, lse = zero_empty_rows(out, seen, None if lse is None else lse.reshape(*lead, T))
    elif lse is not None:
        lse = lse.reshape(*lead, T).astype(jnp.float32)
    return (out, lse) if return_lse else out


def xla_path(ops: Operands, opts: Options) -> Result:
    """``implementation='xla'`` as :func:`jattn.attention` runs it: jax.nn's XLA path, no max logit."""
    return _jax_nn_path(ops, opts, "xla")


def cudnn_path(ops: Operands, opts: Options) -> Result:
    """``implementation='cudnn'`` as :func:`jattn.attention` runs it: jax.nn's cuDNN path, no max logit."""
    return _jax_nn_path(ops, opts, "cudnn")


def _jax_nn_path(ops: Operands, opts: Options, path: str) -> Result:
    out = jax_nn_attention(ops, path, opts.return_lse)
    return Result(*out, None) if opts.return_lse else Result(out, None, None)
