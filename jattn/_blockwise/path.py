"""The blockwise path as :func:`jattn.attention` runs it: checked operands and options in, a :class:`Result` out.

Dimension key as in :mod:`jattn._core`.
"""

from __future__ import annotations

from jattn._blockwise.attention import blockwise_attention
from jattn._blockwise.tiles import choose_tiles
from jattn._checks import Operands, Options, Result

__all__ = ["blockwise_path"]


def blockwise_path(ops: Operands, opts: Options) -> Result:
    """``implementation='blockwise'`` at the tiles :func:`jattn._blockwise.tiles.choose_tiles` picks.

    ``out (..., T, E)``, ``lse (..., T)`` and ``max_logit (..., T)``; ``opts.dropout_seeds`` (the GPU kernel's
    second order) replaces the seeds drawn from ``dropout_rng``.
    """
    split = ops.bias is None and opts.score_mod is None and not opts.dropout_rate
    T, S = ops.q.shape[-2], ops.k.shape[-2]
    (bq, bk), back = choose_tiles(ops.mask, T, S, ops.q_offset, ops.kv_offset, opts.blocks, split)
    return Result(
        *blockwise_attention(
            ops.q,
            ops.k,
            ops.v,
            mask=ops.mask,
            scale=ops.scale,
            q_offset=ops.q_offset,
            kv_offset=ops.kv_offset,
            block_q=bq,
            block_kv=bk,
            precision=opts.precision,
            score_mod=opts.score_mod,
            sinks=opts.sinks,  # checked against the call's leading dims, mask arrays included, there
            bias=ops.bias,
            dropout_rate=opts.dropout_rate,
            dropout_rng=opts.dropout_rng,
            backward_block=back,
            fused=opts.blocks is None,
            lead=ops.lead,
            axis=ops.axis,
            dropout_seeds=opts.dropout_seeds,
        )
    )
