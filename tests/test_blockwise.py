"""The blockwise path against the dense core: forward, log-sum-exp and gradients, for every mask
predicate, odd lengths, offsets, GQA broadcasting, fully masked rows and blocks, all dtypes; its
memory asserted structurally; the hand-over to jax.nn and its clear errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jattn
from jattn import masks
from tests import reference as ref


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _both(q, k, v, **kw):
    """The dense and the blockwise path's ``(out, lse)`` of one call, compiled as one program."""
    bs = kw.pop("block_size", (4, 3))

    def both(q, k, v):
        dense = jattn.attention(q, k, v, return_lse=True, implementation="dense", **kw)
        block = jattn.attention(q, k, v, return_lse=True, implementation="blockwise", block_size=bs, **kw)
        return dense, block

    return jax.jit(both)(q, k, v)


def _close_lse(a, b, dtype):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    np.testing.assert_allclose(np.where(np.isneginf(a), 0, a), np.where(np.isneginf(b), 0, b), **ref.tol(dtype))


def test_a_traced_scale_is_folded_into_q():
    """A scale that is a jit argument, or differentiated, runs blockwise: values and d/dscale against float64."""
    q, k, v = _rand((2, 3, 9, 4), 0), _rand((2, 3, 11, 4), 1), _rand((2, 3, 11, 5), 2)
    mask = masks.causal()
    dense = np.asarray(mask.dense(9, 11))

    def call(scale):
        return jattn.attention(q, k, v, scale=scale, mask=mask, implementation="blockwise", block_size=(4, 3))

    want, _, _ = ref.attention(q, k, v, dense, scale=0.7)
    np.testing.assert_allclose(jax.jit(call)(0.7), want, **ref.tol(jnp.float32))
    cot = np.asarray(_rand(want.shape, 3), np.float64)
    got = jax.jit(jax.grad(lambda s: jnp.sum(call(s) * cot)))(jnp.float32(0.7))

    def ref_loss(scale):
        return np.sum(ref.attention(q, k, v, dense, scale=scale)[0] * cot)

    h = 1e-5  # central difference in float64
    np.testing.assert_allclose(got, (ref_loss(0.7 + h) - ref_loss(0.7 - h)) / (2 * h), rtol=1e-4)


@settings(max_examples=10)
@given(
    ref.static_masks(),
    st.integers(1, 13),
    st.integers(1, 13),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(-3, 3),
    st.booleans(),
)
def test_blockwise_equals_dense_forward_and_lse(mask, T, S, bq, bk, shift, gqa):
    q = _rand((2, 3, T, 5), 0)
    kv_heads = 1 if gqa else 3
    k, v = _rand((2, kv_heads, S, 5), 1), _rand((2, kv_heads, S, 4), 2)
    kw = dict(mask=mask, q_offset=S - T + shift, scale=0.7, block_size=(bq, bk))
    (out_d, lse_d), (out_b, lse_b) = _both(q, k, v, **kw)
    np.testing.assert_allclose(out_b, out_d, **ref.tol(jnp.float32))
    _close_lse(lse_b, lse_d, jnp.float32)


@pytest.mark.parametrize(
    "mask",
    [
        None,
        masks.causal(),
        masks.sliding_window(2, 1),
        masks.sliding_window(2) | masks.global_tokens([0, 5]),
        masks.prefix_lm(4),
        masks.chunked(3),
        masks.causal() & ~masks.chunked(4),  # fully masked rows and blocks
    ],
)
def test_blockwise_gradients_equal_dense(mask):
    q, k, v = _rand((2, 2, 11, 5), 0), _rand((2, 1, 11, 5), 1), _rand((2, 1, 11, 3), 2)

    def loss(impl):
        def f(q, k, v):
            blocks = {"block_size": (4, 3)} if impl == "blockwise" else {}
            out = jattn.attention(q, k, v, mask=mask, implementation=impl, **blocks)
            return jnp.sum(jnp.sin(out) * jnp.arange(3.0)[None, None, None])

        return jax.grad(f, argnums=(0, 1, 2))

    block, dense = jax.jit(lambda *a: (loss("blockwise")(*a), loss("dense")(*a)))(q, k, v)  # one program
    for a, b in zip(block, dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
        assert np.all(np.isfinite(a))


def test_fully_masked_rows_and_blocks_give_zero_and_zero_gradient():
    q, k, v = _rand((1, 8, 4), 0), _rand((1, 8, 4), 1), _rand((1, 8, 4), 2)
    mask = masks.causal() & ~masks.chunked(4)  # rows 0..3 see nothing: whole blocks are empty
    out, lse = jax.jit(
        lambda q: jattn.attention(q, k, v, mask=mask, return_lse=True, implementation="blockwise", block_size=4)
    )(q)
    assert np.all(np.asarray(out[0, :4]) == 0) and np.all(np.isneginf(lse[0, :4]))
    dq = jax.jit(
        jax.grad(lambda q: jnp.sum(jattn.attention(q, k, v, mask=mask, implementation="blockwise", block_size=4)))
    )(q)
    assert np.all(np.asarray(dq[0, :4]) == 0)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16])
def test_blockwise_dtypes(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v = _rand((2, 9, 6), 0, dtype), _rand((2, 14, 6), 1, dtype), _rand((2, 14, 6), 2, dtype)
        (out_d, _), (out_b, lse_b) = _both(q, k, v, mask=masks.causal())
        assert out_b.dtype == dtype and lse_b.dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32)
        want, _, want_lse = ref.attention(q, k, v, mask=np.asarray(masks.causal().dense(9, 14)))
        np.testing.assert_allclose(ref.f64(out_b), want, **ref.tol(dtype))
        np.testing.assert_allclose(ref.f64(out_b), ref.f64(out_d), **ref.tol(dtype))
        _close_lse(lse_b, want_lse, jnp.float64 if dtype == jnp.float64 else jnp.float32)


def test_blockwise_weights_are_within_float32_rounding_over_the_whole_exponent_range():
    # One query row whose scores are exactly the chosen logits (q = 1, k = x, scale 1) and v the
    # identity, so the output row is the softmax weights themselves: 4 key tiles of 512, each with
    # the maximum (0), so a tile's x - m is x itself. The tiles' exponential
    # (jattn._softmax.exp_below_one) is its own polynomial times 2^n, n the nearest integer to
    # x log2(e): the logits include those where x log2(e) rounds to a half-integer (and their
    # neighbours), where the two roundings of n must agree. Every weight within 4 ulp of the largest
    # weight of the float64 softmax, those of logits within 1 of the maximum within 4 ulp, relative,
    # and the log-sum-exp within float32's tolerance (measured: 1.5 and 2.0 ulp; with XLA's exp 1.5
    # and 1.8; with a degree-4 Taylor polynomial 313 and 443; with n rounded away from zero at ties
    # the weights there are off by 2x; with 2^(n+1) the weights are right and the lse is off by
    # log 2); a NaN logit makes the row NaN.
    rng = np.random.default_rng(7)
    log2e = np.float32(1.4426950408889634)
    lo = hi = np.float32((np.arange(-127, 0) + 0.5) / log2e)  # x log2(e) = k + 1/2, k = -127 .. -1
    ties = [lo]
    for _ in range(2):  # and 2 ulp either side
        lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
        ties += [lo, hi]
    ties = np.concatenate(ties)
    rest = 2048 - 4 - 511 - ties.size
    x = np.concatenate([rng.uniform(-104, 0, rest), ties, rng.uniform(-1, 0, 511)]).astype(np.float32)
    x = np.insert(x, [0, 511, 1022, 1533], np.float32(0))  # a 0 in each tile: x - m is x exactly
    q = jnp.ones((1, 1), jnp.float32)
    k, v = jnp.asarray(x)[:, None], jnp.eye(x.size, dtype=jnp.float32)

    @jax.jit
    def weights(k):
        out, lse = jattn.attention(q, k, v, scale=1.0, implementation="blockwise", block_size=512, return_lse=True)
        return out[0], lse[0]

    got, lse = weights(k)
    got = ref.f64(got)
    want, want_lse, _ = ref.softmax(x[None])
    want = want[0]
    ulp = np.finfo(np.float32).eps  # float32's ulp at 1, 2^-23
    np.testing.assert_array_less(np.abs(got - want), 4 * ulp * want.max())
    near = x >= -1
    np.testing.assert_array_less(np.abs(got - want)[near] / want[near], 4 * ulp)
    np.testing.assert_allclose(ref.f64(lse), want_lse[0], **ref.tol(jnp.float32))
    assert np.isnan(ref.f64(weights(k.at[5, 0].set(jnp.nan))[0])).all()


def test_no_scores_buffer_in_the_compiled_blockwise_path():
    # Structural memory check on the compiled forward + backward: no (T, S) buffer, and the
    # scratch memory grows linearly in T for blockwise (on fixed 512² tiles: the automatic ones
    # grow with T up to 2048², a constant) but quadratically for dense.
    def temp(impl, T):
        spec = jax.ShapeDtypeStruct((1, 2, T, 64), jnp.float32)
        block = 512 if impl == "blockwise" else None

        def loss(q, k, v):
            return jnp.sum(jattn.attention(q, k, v, mask=masks.causal(), implementation=impl, block_size=block))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
        return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()

    (small, _), (big, text) = temp("blockwise", 2048), temp("blockwise", 4096)
    assert "4096,4096]" not in text and big < 2 * 4096 * 4096 * 4 / 4
    assert big / small < 2.5
    dense_small, _ = temp("dense", 2048)
    dense_big, dense_text = temp("dense", 4096)
    assert "4096,4096]" in dense_text and dense_big / dense_small > 3.5  # the check can fail


def test_blockwise_scratch_holds_no_copies_of_the_inputs():
    # Blocks are sliced from q, k, v (and out, d_out) inside the loops: the scratch of causal
    # forward + backward at T=16384 (512 x 512 tiles: two CPU groups of four heads; the automatic
    # tiles depend on the threads) is the saved output, lse and
    # the group's dq, dk, dv accumulators, not blocked or per-group copies of the inputs (which
    # measured 5.5 arrays of (B, T, D) for fwd + bwd and 3.5 for fwd alone).
    spec = jax.ShapeDtypeStruct((1, 8, 16384, 64), jnp.float32)
    one = 8 * 16384 * 64 * 4  # bytes of one (B, T, D) float32 array

    def loss(q, k, v):
        return jnp.sum(jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise", block_size=512))

    def scratch(f):
        return jax.jit(f).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes / one

    assert scratch(jax.grad(loss, argnums=(0, 1, 2))) < 4.5
    assert scratch(loss) < 2.5


def test_auto_chooses_blockwise_for_long_sequences():
    side = math.isqrt(jattn.AUTO_BLOCKWISE_MIN)  # T = S = side: T·S reaches the threshold exactly
    assert side * side == jattn.AUTO_BLOCKWISE_MIN
    small, big = jnp.zeros((1, 64, 8)), jnp.zeros((1, side, 8))
    assert jattn.choose_implementation(small, small, small) == "dense"
    short = jnp.zeros((1, side - 1, 8))  # T·S one row short of the threshold
    assert jattn.choose_implementation(short, big, big) == "dense"
    assert jattn.choose_implementation(big, big, big) == "blockwise"
    assert jattn.choose_implementation(big, big, big, mask=masks.causal()) == "blockwise"
    assert jattn.choose_implementation(big, big, big, mask=jnp.ones((1, 1), bool)) == "blockwise"  # arrays are tiled
    assert jattn.choose_implementation(big, big, big, bias=jnp.ones((1, 1))) == "blockwise"  # bias is tiled
    assert jattn.choose_implementation(small, small, small, block_size=16) == "blockwise"  # blocks asked for


def test_xla_handover_matches_and_keeps_the_contract():
    q, k, v = _rand((2, 3, 9, 8), 0), _rand((2, 3, 9, 8), 1), _rand((2, 3, 9, 8), 2)
    dense_mask = np.ones((9, 9), bool)
    dense_mask[4] = False  # a fully masked row: 0, not the mean of v

    @jax.jit  # one program
    def calls(q, k, v):
        pairs = [
            [jattn.attention(q, k, v, mask=m, implementation=i) for i in ("xla", "dense")]
            for m in (None, masks.causal(), masks.sliding_window(2, 1))
        ]
        return (
            pairs,
            jattn.attention(q, k, v, mask=dense_mask, implementation="xla"),
            jattn.attention(q, k, v, mask=dense_mask),
        )

    pairs, out, auto = calls(q, k, v)
    for xla, dense in pairs:
        np.testing.assert_allclose(xla, dense, **ref.tol(jnp.float32))
    assert np.all(np.asarray(out[:, :, 4]) == 0)
    np.testing.assert_allclose(out, auto, **ref.tol(jnp.float32))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(implementation="blockwise", mask=masks.causal(), q_offset=np.array([0, 1])),
            "'blockwise' cannot take q_off",
        ),
        (dict(implementation="dense", block_size=4), "'dense' cannot take block_size"),
        (dict(implementation="xla", dropout_rate=0.5, dropout_rng=jax.random.key(0)), "'xla' cannot take dropout_rate"),
        (dict(implementation="xla", precision="highest"), "'xla' cannot take precision"),
        (dict(implementation="cudnn", mask=masks.prefix_lm(2)), "'cudnn' expresses causal"),
        (dict(implementation="cudnn", mask=masks.causal(), q_offset=1), "'cudnn' expresses causal.*q_offset=1"),
        (dict(implementation="flash"), "implementation must be one of"),
    ],
)
def test_paths_refuse_what_they_cannot_express(kwargs, match):
    q = _rand((2, 9, 8), 0)
    with pytest.raises(ValueError, match=match):
        jattn.attention(q, q, q, **kwargs)


#: The platform and CPU threads of each of ``jattn._platform.TILINGS``'s tilings.
_TILING_WHERE = {"cpu": ("cpu", 2), "cpu, 1 thread": ("cpu", 1), "other": ("gpu", 2)}


def _auto_tile(monkeypatch, mask, T: int, platform: str, threads: int) -> tuple[int, int]:
    """The forward tile ``(bq, bk)`` blockwise attention takes with ``block_size=None`` at T = S on ``platform``, ``threads``.

    Read from the traced forward on XLA's tiles (the fused CPU forward off): its largest score
    matmul ``(1, bq, bk)``, where some tile is computed whole (the parts of a split tile, on the
    causal diagonal, are smaller). The patches hold for the trace only.
    """
    import jattn._platform as platform_facts

    with monkeypatch.context() as patch:
        patch.setattr(platform_facts, "platform", lambda: platform)
        patch.setattr(platform_facts, "cpu_threads", lambda: threads)
        patch.setenv("JATTN_FUSED_CPU", "0")
        q = jax.ShapeDtypeStruct((1, 1, T, 8), jnp.float32)
        shapes = _dot_shapes(lambda q: jattn.attention(q, q, q, mask=mask, implementation="blockwise"), q)
    dims = [tuple(int(n) for n in x[x.index("[") + 1 : -1].split(",")) for x in shapes]
    return max((d[1:] for d in dims if d[-1] != 8), key=lambda t: t[0] * t[1])  # not the (1, bq, 8) products with v


def test_automatic_tiles_shrink_for_narrow_windows_and_keep_the_result(monkeypatch):
    """block_size=None: the largest tile of each tiling for full attention; smaller ones where a window leaves most of a big tile masked."""

    def auto(mask, tiling, T=8192):
        return _auto_tile(monkeypatch, mask, T, *_TILING_WHERE[tiling])

    assert auto(None, "other") == auto(masks.causal(), "other") == (512, 512)
    assert auto(None, "cpu") == auto(masks.causal(), "cpu", T=16384) == (2048, 2048)
    # causal on several threads: the STAIRS diagonal of big tiles keeps their masked share small
    assert auto(masks.causal(), "cpu", T=2048) == (1024, 1024)
    assert auto(masks.causal(), "cpu", T=4096) == auto(masks.causal(), "cpu") == (2048, 2048)
    assert auto(None, "cpu, 1 thread") == (1024, 128)  # one head's 512 KiB tile in L2
    # causal on one thread: 1024 x 128, its diagonal tiles TOP_EMPTY (only their last quarters computed)
    assert auto(masks.causal(), "cpu, 1 thread") == (1024, 128)
    assert auto(masks.causal(), "cpu, 1 thread", T=2048) == (1024, 128)
    assert auto(None, "other", T=1100) == (256, 256)  # 512 tiles would pad 1100 to 1536
    # a mask of arrays (documents, padding, a boolean array) is classified on device: tiles of 512 and less
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 1024)[None]
    assert auto(masks.segment_ids(ids, ids) & masks.causal(), "cpu") == (512, 512)
    assert auto(masks.padding(kv_lengths=jnp.array([8000])) & masks.causal(), "cpu") == (512, 512)
    for tiling in ("other", "cpu", "cpu, 1 thread"):
        assert max(auto(masks.sliding_window(64), tiling)) <= (128 if tiling != "cpu" else 256)
        assert max(auto(masks.sliding_window(256), tiling)) < 512
    mask = masks.sliding_window(40)
    q, k, v = _rand((1, 2, 1031, 8), 0), _rand((1, 2, 1031, 8), 1), _rand((1, 2, 1031, 8), 2)

    @jax.jit
    def both(q, k, v):
        dense = jattn.attention(q, k, v, mask=mask, implementation="dense")
        return dense, jattn.attention(q, k, v, mask=mask, implementation="blockwise")  # 128² tiles, a ragged last one

    dense, block = both(q, k, v)
    np.testing.assert_allclose(block, dense, **ref.tol(jnp.float32))


@pytest.mark.parametrize("threads, want", [(1, (1024, 128)), (2, (2048, 2048)), (16, (2048, 2048))])
def test_cpu_tiles_follow_the_threads(monkeypatch, threads, want):
    """On CPU the automatic tile depends on the cores the process may use; each choice gives the reference's result."""
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "platform", lambda: "cpu")
    monkeypatch.setattr(platform_facts, "cpu_threads", lambda: threads)
    assert _auto_tile(monkeypatch, None, 4096, "cpu", threads) == want
    q, k, v = _threads_case()
    mask_list = (None, masks.causal())
    calls = jax.jit(lambda q, k, v: [jattn.attention(q, k, v, mask=m, implementation="blockwise") for m in mask_list])
    for got, want_out in zip(calls(q, k, v), _threads_reference(), strict=True):  # traced here: under the patches
        np.testing.assert_allclose(ref.f64(got), want_out, **ref.tol(jnp.float32))


def _threads_case():
    return _rand((1, 3, 1100, 8), 0), _rand((1, 3, 1100, 8), 1), _rand((1, 3, 1100, 8), 2)


@functools.cache
def _threads_reference():
    """The float64 outputs of :func:`_threads_case` without a mask and causal (an explicit mask), computed once."""
    q, k, v = _threads_case()
    return [ref.attention(q, k, v, mask=m)[0] for m in (None, np.tril(np.ones((1100, 1100), bool)))]


@pytest.mark.parametrize("case", ["causal", "window&padding", "bias&sinks", "dropout", "score_mod", "none"])
def test_the_backward_takes_its_own_tiles_on_several_threads(monkeypatch, case):
    """Automatic tiles on several CPU threads: a masked backward's sides are capped (``BACKWARD_SIDE``).

    Forward tiles of 16² (``TILINGS`` patched), backward ones of 8²: gradients against float64
    with the explicit mask (dropout: against the forward's own tiles, whose bits are the same),
    and both tile sizes among the matmuls of the gradient's jaxpr. A score modification is
    converted for the forward's tiles, and tiles all FULL (no mask, T and S multiples of 16) are
    best big: the backward keeps them. T=29, S=37 pad to 32 and 48.
    """
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "platform", lambda: "cpu")
    monkeypatch.setattr(platform_facts, "cpu_threads", lambda: 2)
    monkeypatch.setitem(platform_facts.TILINGS, "cpu", {(16, 16): 1.0})
    monkeypatch.setitem(platform_facts.BACKWARD_SIDE, "cpu", 8)
    monkeypatch.setenv("JATTN_FUSED_CPU", "0")  # the forward's tiles are XLA's (the fused CPU forward has its own)
    B, N, T, S = (2, 3, 29, 37) if case != "none" else (2, 3, 32, 48)
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    causal = s <= t + (S - T)
    lengths = np.array([37, 20])
    bias = _rand((1, N, T, S), 5) if case == "bias&sinks" else None
    sinks = jnp.asarray([0.3, -0.5, 1.0]) if case == "bias&sinks" else None
    mask, dense = {
        "causal": (masks.causal(), causal),
        "window&padding": (
            masks.sliding_window(11) & masks.padding(kv_lengths=lengths),
            causal & (s >= t + (S - T) - 11) & (s < lengths[:, None, None, None]),
        ),
        "bias&sinks": (masks.causal(), causal),
        "dropout": (masks.causal(), causal),
        "score_mod": (masks.causal(), causal),
        "none": (None, np.ones((T, S), bool)),
    }[case]
    kw = dict(mask=mask, bias=bias, sinks=sinks)
    if case == "dropout":
        kw.update(dropout_rate=0.3, dropout_rng=jax.random.key(7))
    if case == "score_mod":
        kw.update(score_mod=jattn.score_mods.softcap(2.0))
    q, k, v, g = _rand((B, N, T, 5), 0), _rand((B, N, S, 5), 1), _rand((B, N, S, 4), 2), _rand((B, N, T, 4), 3)

    def loss(q, k, v, bias=bias, block_size=None):
        out = jattn.attention(q, k, v, **{**kw, "bias": bias}, implementation="blockwise", block_size=block_size)
        return jnp.sum(out * g)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if bias is not None else (0, 1, 2)))(q, k, v, bias)
    if case == "dropout":  # the same bits on the forward's tiles
        want = jax.jit(jax.grad(functools.partial(loss, block_size=(16, 16)), argnums=(0, 1, 2)))(q, k, v)
        for got, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(got, w, **ref.tol(jnp.float32))
    else:
        softcap = 2.0 if case == "score_mod" else None
        want = ref.attention_grads(q, k, v, g, dense, bias=bias, sinks=sinks, softcap=softcap)
        for got, w in zip(grads, want[: len(grads)], strict=True):
            ref.assert_grad_close(got, w, jnp.float32)
    shapes = {x.rsplit("[", 1)[1].split(",", 1)[1] for x in _dot_shapes(jax.grad(loss), q, k, v)}
    assert "16,16]" in shapes
    assert ("8,8]" in shapes) == (case not in ("score_mod", "none")), shapes


@pytest.mark.parametrize("block", [(1024, 128), (512, 256), (128, 1024)])
@pytest.mark.parametrize("mask", ["causal", "window", "causal-q_offset"])
def test_the_automatic_tile_shapes_equal_the_reference(block, mask):
    """The CPU tilings' tall, narrow and wide tiles at their real sizes (LOWER diagonal tiles included), T != S."""
    m, kw = {
        "causal": (masks.causal(), {}),
        "window": (masks.sliding_window(300, 20), {}),
        "causal-q_offset": (masks.causal(), {"q_offset": 40}),
    }[mask]
    q, k, v, g, dense = _tile_shape_case(mask)
    _match_reference(q, k, v, g, dense, reference=_tile_shape_reference(mask), mask=m, block_size=block, **kw)


def _tile_shape_case(mask: str):
    """q, k, v, the cotangent and the explicit mask of :func:`test_the_automatic_tile_shapes_equal_the_reference`."""
    T, S = 1100, 1037
    t, s = np.arange(T)[:, None] + (40 if mask == "causal-q_offset" else S - T), np.arange(S)[None, :]
    dense = (s >= t - 300) & (s <= t + 20) if mask == "window" else s <= t
    q, k, v, g = _rand((1, 1, T, 8), 0), _rand((1, 1, S, 8), 1), _rand((1, 1, S, 4), 2), _rand((1, 1, T, 4), 3)
    return q, k, v, g, dense


@functools.cache
def _tile_shape_reference(mask: str):
    """The float64 output and gradients of a :func:`_tile_shape_case`, once a mask (its three tilings share them)."""
    q, k, v, g, dense = _tile_shape_case(mask)
    return ref.attention(q, k, v, dense)[0], ref.attention_grads(q, k, v, g, dense)[:3]


@pytest.mark.parametrize(
    "platform, threads, tile_bytes, group",
    [("cpu", 2, 4 * 3 * 4, 1), ("cpu", 2, 2 * 4 * 3 * 4, 2), ("cpu", 1, 16 * 4 * 3 * 4, 2), ("gpu", 2, 4 * 3 * 4, 6)],
)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mask", ["causal-window", "array", "empty-rows"])
def test_both_platform_tilings_equal_the_reference(monkeypatch, platform, threads, tile_bytes, group, dtype, mask):
    """CPU tiles by groups of B (here 1 and 2 rows of B = 6; a budget of TILE_BYTES / 8 on one thread), GPU/TPU by all of B: same results and gradients."""
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "platform", lambda: platform)
    monkeypatch.setattr(platform_facts, "cpu_threads", lambda: threads)
    monkeypatch.setattr(platform_facts, "TILE_BYTES", tile_bytes)
    assert platform_facts.group_size(6, 4, 3, 4, platform, threads) == group
    with jax.enable_x64(dtype == jnp.float64):
        out_b, grads_b = _tiling_run("blockwise", dtype, mask)  # traced here: under the patches
        want, out_d, grads_d = _tiling_references(dtype, mask)
        np.testing.assert_allclose(ref.f64(out_b), want, **ref.tol(dtype))
        np.testing.assert_allclose(ref.f64(out_b), out_d, **ref.tol(dtype))
        for a, b in zip(grads_b, grads_d, strict=True):
            assert a.dtype == dtype and np.all(np.isfinite(ref.f64(a)))
            np.testing.assert_allclose(ref.f64(a), b, **ref.tol(dtype))


def _tiling_case(dtype, mask: str):
    """q, k, v and the mask of :func:`test_both_platform_tilings_equal_the_reference`."""
    q, k, v = _rand((2, 3, 11, 5), 0, dtype), _rand((2, 3, 7, 5), 1, dtype), _rand((2, 1, 7, 4), 2, dtype)
    m = {
        "causal-window": masks.causal() & masks.sliding_window(3),
        "array": jnp.asarray(np.random.default_rng(0).random((2, 3, 11, 7)) > 0.4),
        "empty-rows": masks.causal() & ~masks.chunked(4),
    }[mask]
    return q, k, v, m


def _tiling_run(impl: str, dtype, mask: str):
    """``impl``'s output and the gradients of ``sum(out · [0, 1, 2, 3])`` on the tiling case, one program."""
    q, k, v, m = _tiling_case(dtype, mask)

    def f(q, k, v):
        kw = {"block_size": (4, 3)} if impl == "blockwise" else {}
        out = jattn.attention(q, k, v, mask=m, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.arange(4, dtype=jnp.float32)[None, None, None]), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@functools.cache
def _tiling_references(dtype, mask: str):
    """The float64 output and the dense path's output and gradients, as float64 NumPy: the same for every tiling
    (the dense path reads no platform fact), computed once a dtype and mask."""
    q, k, v, m = _tiling_case(dtype, mask)
    out, grads = _tiling_run("dense", dtype, mask)
    dense_mask = m if not isinstance(m, masks.Mask) else np.asarray(m.dense(11, 7))
    want, _, _ = ref.attention(q, k, v, mask=dense_mask)
    return want, ref.f64(out), [ref.f64(g) for g in grads]


def test_cpu_tiles_are_fitted_to_tile_bytes():
    from jattn._platform import TILE_BYTES, group_size

    assert group_size(32, 512, 512, 4, "cpu", 2) * 512 * 512 * 4 <= TILE_BYTES
    assert group_size(32, 512, 512, 4, "gpu", 2) == 32
    assert group_size(7, 512, 512, 4, "cpu", 2) == 1  # the largest divisor of B that fits
    assert group_size(32, 128, 128, 4, "cpu", 2) == min(32, TILE_BYTES // (128 * 128 * 4))  # all 32 at 4 MiB
    assert group_size(32, 1024, 128, 4, "cpu", 1) == 1  # one thread: a budget of TILE_BYTES / 8, one head
    assert group_size(32, 128, 128, 4, "cpu", 1) == TILE_BYTES // 8 // (128 * 128 * 4)


def _match_reference(q, k, v, g, dense, reference=None, **kw):
    """Blockwise ``attention(q, k, v, **kw)`` and the gradients of ``sum(out * g)`` against float64
    with the explicit mask ``dense`` (float32 tolerances); returns that loss of (q, k, v). ``reference``: that
    float64 output and gradients where already computed."""

    def loss(q, k, v):
        out = jattn.attention(q, k, v, implementation="blockwise", **kw)
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, want_grads = reference or (ref.attention(q, k, v, dense)[0], ref.attention_grads(q, k, v, g, dense)[:3])
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    for got, w in zip(grads, want_grads, strict=True):
        ref.assert_grad_close(got, w, jnp.float32)
    return lambda q, k, v: loss(q, k, v)[0]


def _dot_shapes(fn, *args) -> set[str]:
    """The result types of the matmuls in ``fn``'s jaxpr (the tile shapes)."""
    import re

    return set(re.findall(r"(\w+\[[\d,]*\]) = dot_general", ref.program_text(fn, *args)))


@pytest.mark.parametrize("mapped", ["qkv", "q", "kv", "array-mask"])
def test_vmap_equals_a_loop_and_tiles_like_an_explicit_batch(monkeypatch, mapped):
    """vmap folds the mapped axis into the tiled batch: the loop's values and gradients, the batch's tiles."""
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "TILE_BYTES", 2 * 4 * 3 * 4)  # CPU groups of 2 rows of B
    q, k, v = _rand((3, 2, 2, 11, 5), 0), _rand((3, 2, 1, 7, 5), 1), _rand((3, 2, 1, 7, 4), 2)
    arr = jnp.asarray(np.random.default_rng(0).random((3, 2, 2, 11, 7)) > 0.4)
    axes = {"qkv": (0, 0, 0, None), "q": (0, None, None, None), "kv": (None, 0, 0, None), "array-mask": (0, 0, 0, 0)}
    in_axes = axes[mapped]
    args = tuple(x if a == 0 else x[0] for x, a in zip((q, k, v, arr), in_axes, strict=True))

    array_mask = mapped == "array-mask"

    def f(q, k, v, m):
        mask = m if array_mask else masks.causal()
        return jattn.attention(q, k, v, mask=mask, implementation="blockwise", block_size=(4, 3))

    def loss(*a):
        return jnp.sum(jnp.sin(jax.vmap(f, in_axes=in_axes)(*a)))

    def one_loss(*a):
        return jnp.sum(jnp.sin(f(*a)))

    # the loop: one call a mapped index (one program for the three); its loss is their sum, its gradient in a
    # mapped argument their stack, in a shared one their sum
    one = jax.jit(jax.value_and_grad(one_loss, (0, 1, 2)))
    steps = [one(*(x[i] if ax == 0 else x for x, ax in zip(args, in_axes, strict=True))) for i in range(3)]
    looped_grads = [
        jnp.stack([s[1][j] for s in steps]) if in_axes[j] == 0 else sum(s[1][j] for s in steps) for j in range(3)
    ]
    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*args)
    np.testing.assert_allclose(value, sum(s[0] for s in steps), rtol=1e-5)
    for a, b in zip(grads, looped_grads, strict=True):
        np.testing.assert_allclose(a, b, **ref.tol(jnp.float32))
    per_example = jax.jit(jax.vmap(jax.grad(one_loss, (0, 1, 2)), in_axes=in_axes))(*args)
    assert [g.shape[0] for g in per_example] == [3, 3, 3]
    for i, s in enumerate(steps):  # each index's gradients are its own call's
        for a, b in zip(per_example, s[1], strict=True):
            np.testing.assert_allclose(a[i], b, **ref.tol(jnp.float32))
    # A mapped array mask keeps its per-row tile kinds: it folds into the batch too.
    batch = (q.reshape(6, 2, 11, 5), k.reshape(6, 1, 7, 5), v.reshape(6, 1, 7, 4), arr.reshape(6, 2, 11, 7))
    assert _dot_shapes(jax.vmap(f, in_axes=in_axes), *args) == _dot_shapes(f, *batch)


# -- per-example masks: padding and segment ids, tiled per row (issue 13) ---------------------------


def _segments(rng, B, L, n):
    """Random (unsorted) segment ids ``(B, L)``, each of ``0..n-1`` at least once: runs of packed documents, shuffled."""
    return np.stack([np.repeat(rng.permutation(n), 1 + rng.multinomial(L - n, np.ones(n) / n)) for _ in range(B)])


def _per_example_cases(rng, B, T, S):
    """``name -> (mask, explicit (B, 1, T, S) boolean)``, built from the ids and lengths themselves."""
    q_ids, kv_ids = _segments(rng, B, T, 4), _segments(rng, B, S, 3)  # id 3 only among queries: its rows see none
    q_len, kv_len = np.array([0, 4, T + 5])[:B], np.array([S, 1, 6])[:B]
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    causal = s <= t + (S - T)
    seg = q_ids[:, :, None] == kv_ids[:, None, :]
    pad = (t < q_len[:, None, None]) & (s < kv_len[:, None, None])
    cases = {
        "segments": (masks.segment_ids(q_ids, kv_ids), seg),
        "segments&causal": (masks.segment_ids(q_ids, kv_ids) & masks.causal(), seg & causal),
        "padding": (masks.padding(q_lengths=q_len, kv_lengths=kv_len), pad),
        "keys|causal": (masks.padding(kv_lengths=kv_len) | masks.causal(), (s < kv_len[:, None, None]) | causal),
        "~segments&padding": (
            ~masks.segment_ids(q_ids, kv_ids) & masks.padding(q_lengths=q_len, kv_lengths=kv_len),
            ~seg & pad,
        ),
    }
    return {n: (m, d[:, None]) for n, (m, d) in cases.items()}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "case", ["none", "causal", "causal-offset", "window", "causal&padding", "segments&causal", "sinks"]
)
@pytest.mark.parametrize("block", [(6, 4), (16, 4), (8, 8)])
def test_tiles_computed_in_parts_equal_the_reference(monkeypatch, dtype, case, block):
    """Partial tiles with empty corners (the causal diagonal) are computed as their non-empty parts.

    6 x 4 tiles with an empty top-right quarter (LOWER): top rows against the first half of the
    keys, bottom rows against all keys. Tall 16 x 4 tiles whose first quarters of rows are empty
    (TOP_EMPTY): their last 12, 8 or 4 rows only. Square 8 x 8 tiles on the causal diagonal
    (STAIRS): each quarter of rows against the first 2, 4, 6 or 8 keys. The part matmuls are in
    the jaxpr; values, lse and gradients against float64 with the explicit mask. ``SPLIT_MIN`` and
    ``STAIRS_MIN`` lowered so these tiles split; T and S odd so the diagonal cuts tiles unevenly.
    Without a mask the last key block (one key of 4, the rest padding) is a LOWER tile too.
    """
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "SPLIT_MIN", 4)
    monkeypatch.setattr(platform_facts, "STAIRS_MIN", 8)
    rng = np.random.default_rng(3)
    B, N, T = 3, 2, 29 if block == (16, 4) else 13  # 16-row tiles: two query blocks, the last ragged
    S = T if case != "causal-offset" else T + 4
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    causal = s <= t + (S - T)
    q_len, kv_len = np.array([13, 5, 9]), np.array([13, 8, 2])
    ids = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    cases = {
        "none": lambda: (None, np.ones((T, S), bool)),
        "causal": lambda: (masks.causal(), causal),
        "causal-offset": lambda: (masks.causal(), causal),
        "window": lambda: (masks.sliding_window(5), causal & (s >= t - 5)),
        "causal&padding": lambda: (
            masks.causal() & masks.padding(q_lengths=q_len, kv_lengths=kv_len),
            causal & (t < q_len[:, None, None]) & (s < kv_len[:, None, None]),
        ),
        "segments&causal": lambda: (
            masks.segment_ids(ids, ids) & masks.causal(),
            causal & (ids[:, :, None] == ids[:, None, :]),
        ),
        "sinks": lambda: (masks.causal(), causal),
    }
    mask, dense = cases[case]()
    dense = dense[:, None] if dense.ndim == 3 else dense
    sinks = jnp.asarray([0.5, -1.0], dtype) if case == "sinks" else None
    q, k, v = _rand((B, N, T, 5), 0, dtype), _rand((B, N, S, 5), 1, dtype), _rand((B, N, S, 4), 2, dtype)
    g = _rand((B, N, T, 4), 3, dtype)

    def loss(q, k, v):
        kw = dict(implementation="blockwise", block_size=block, return_lse=True, sinks=sinks)
        out, lse = jattn.attention(q, k, v, mask=mask, **kw)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, _, want_lse = ref.attention(q, k, v, dense, sinks=sinks)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
    _close_lse(lse, want_lse, dtype)
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense, sinks=sinks)[:3], strict=True):
        ref.assert_grad_close(got, w, dtype)
    shapes = {s.rsplit("[", 1)[1].split(",", 1)[1] for s in _dot_shapes(lambda q, k, v: loss(q, k, v)[0], q, k, v)}
    if block == (8, 8):  # STAIRS: the diagonal's quarters of rows (an offset diagonal: no stairs)
        stairs = {"2,2]", "2,4]", "2,6]", "2,8]"}
        assert (shapes >= stairs) == (case not in ("none", "causal-offset")), shapes
    elif block == (6, 4) or case == "none":  # LOWER's two parts
        assert shapes >= {f"{block[0] // 2},2]", f"{block[0] // 2},4]"}, shapes
    else:  # TOP_EMPTY tiles: the last 12 and the last 4 rows
        assert shapes >= {"12,4]", "4,4]"}, shapes


def _loops_with_bare_dots(jaxpr) -> list[bool]:
    """For each while loop in ``jaxpr`` (nested ones too): does its body run a matmul outside any ``cond``?"""
    found = []

    def subs(eqn):
        if (inner := ref.kernel_jaxpr(eqn)) is not None:  # a derivative primitive's program
            yield inner
        for p in eqn.params.values():
            for x in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(x, "eqns") or hasattr(x, "jaxpr"):
                    yield getattr(x, "jaxpr", x)

    def bare_dot(jx) -> bool:  # a dot_general reached without passing a cond or another loop
        return any(
            e.primitive.name == "dot_general"
            or (e.primitive.name not in ("cond", "while", "scan") and any(bare_dot(j) for j in subs(e)))
            for e in jx.eqns
        )

    def walk(jx):
        for e in jx.eqns:
            if e.primitive.name == "while":
                found.append(bare_dot(e.params["body_jaxpr"].jaxpr))
            for j in subs(e):
                walk(j)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("case", ["causal-offset", "window", "padding"])
def test_full_tiles_run_in_a_loop_without_a_branch(case):
    """With static kinds each query block takes its FULL tiles first, in a loop of their own.

    A branch's result is copied into the loop's state every step, so the FULL tiles (most of a
    causal mask's) skip the ``lax.switch``; a window's FULL tiles come before its partial edges,
    an order the values must not depend on. A mask read from arrays keeps one branched loop.
    Values and gradients against float64 with the explicit mask; T, S odd and unequal.
    """
    B, N, T, S = 2, 3, 29, 33
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    causal = s <= t + (S - T)
    lengths = np.array([33, 19])
    mask, dense = {
        "causal-offset": (masks.causal(), causal),
        "window": (masks.sliding_window(17), causal & (s >= t + (S - T) - 17)),
        "padding": (masks.causal() & masks.padding(kv_lengths=lengths), causal & (s < lengths[:, None, None, None])),
    }[case]
    q, k, v, g = _rand((B, N, T, 5), 0), _rand((B, N, S, 5), 1), _rand((B, N, S, 4), 2), _rand((B, N, T, 4), 3)
    loss = _match_reference(q, k, v, g, dense, mask=mask, block_size=(8, 4))
    loops = _loops_with_bare_dots(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v))
    assert loops.count(True) == (0 if case == "padding" else 2), loops  # forward and backward: one each


@pytest.mark.parametrize("extra", ["bias", "score_mod"])
def test_lower_tiles_stay_whole_where_a_tile_carries_more_than_the_mask(monkeypatch, extra):
    """A bias or score modification acts on whole tiles: such calls keep them whole and stay exact."""
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "SPLIT_MIN", 4)
    q, k, v = _rand((2, 3, 13, 5), 0), _rand((2, 3, 13, 5), 1), _rand((2, 3, 13, 4), 2)
    bias = _rand((1, 3, 13, 13), 4)
    kw = {"bias": dict(bias=bias), "score_mod": dict(score_mod=jattn.score_mods.softcap(2.0))}[extra]
    got, want = jax.jit(  # one program, traced here: under the patch
        lambda q, k, v: [
            jattn.attention(q, k, v, mask=masks.causal(), implementation=i, block_size=b, **kw)
            for i, b in (("blockwise", (6, 4)), ("dense", None))
        ]
    )(q, k, v)
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    if extra == "bias":
        causal = np.tril(np.ones((13, 13), bool))
        np.testing.assert_allclose(ref.f64(got), ref.attention(q, k, v, causal, bias=bias)[0], **ref.tol(jnp.float32))


def test_lower_tiles_split_at_the_default_threshold():
    """At the default tiles (128 and up) the causal diagonal's tiles are computed as two parts of 64 rows."""
    from jattn._platform import SPLIT_MIN

    q = _rand((1, 2, 333, 8), 0)
    fn = functools.partial(jattn.attention, mask=masks.causal(), implementation="blockwise", block_size=SPLIT_MIN)
    half = SPLIT_MIN // 2
    assert {f"f32[2,{half},{half}]", f"f32[2,{half},{SPLIT_MIN}]"} <= _dot_shapes(fn, q, q, q)
    want = ref.attention(q, q, q, np.tril(np.ones((333, 333), bool)))[0]
    np.testing.assert_allclose(ref.f64(jax.jit(fn)(q, q, q)), want, **ref.tol(jnp.float32))
    k = _rand((1, 2, 300, 8), 1)  # no mask: the last key block holds 44 keys of 128, then padding
    fn = functools.partial(jattn.attention, implementation="blockwise", block_size=SPLIT_MIN)
    assert f"f32[2,{half},{half}]" in _dot_shapes(fn, q, k, k)
    np.testing.assert_allclose(ref.f64(jax.jit(fn)(q, k, k)), ref.attention(q, k, k)[0], **ref.tol(jnp.float32))


@pytest.mark.parametrize("platform, tile_bytes", [("cpu", 4 * 3 * 4), ("cpu", 10**9), ("gpu", 4 * 3 * 4)])
@pytest.mark.parametrize("name", ["segments", "segments&causal", "padding", "keys|causal", "~segments&padding"])
def test_per_example_masks_on_the_blockwise_path_equal_the_reference(monkeypatch, platform, tile_bytes, name):
    """Values, log-sum-exp and gradients against float64 with the explicit mask; rows seeing no key give 0.

    Tiles are classified per row of B·N on device (CPU groups of one row, or of all rows, and GPU tiling).
    """
    import jattn._platform as platform_facts

    monkeypatch.setattr(platform_facts, "platform", lambda: platform)
    monkeypatch.setattr(platform_facts, "TILE_BYTES", tile_bytes)
    rng = np.random.default_rng(7)
    B, N, T, S = 3, 2, 11, 13
    mask, dense = _per_example_cases(rng, B, T, S)[name]
    q, k, v = _rand((B, N, T, 5), 0), _rand((B, 1, S, 5), 1), _rand((B, 1, S, 4), 2)
    g = _rand((B, N, T, 4), 3)

    def loss(q, k, v):
        out, lse = jattn.attention(q, k, v, mask=mask, implementation="blockwise", block_size=(4, 3), return_lse=True)
        return jnp.sum(out * g), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, _, want_lse = ref.attention(q, k, v, dense)
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(jnp.float32))
    _close_lse(lse, want_lse, jnp.float32)
    for got, w in zip(grads, ref.attention_grads(q, k, v, g, dense)[:3], strict=True):
        ref.assert_grad_close(got, w, jnp.float32)
    empty = ~np.broadcast_to(dense, (B, N, T, S)).any(-1)  # rows that see no key: exactly 0, and no gradient
    assert empty.any() or name == "keys|causal"  # every other case has such rows
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(grads[0])[empty] == 0)


def test_per_example_tile_kinds_are_read_per_example_on_device():
    """Packed documents: each example's tiles from its own ids; a tile is empty for all only if for each."""
    ids = np.array([[0] * 4 + [1] * 4 + [2] * 4, [0] * 8 + [1] * 4])  # (2, 12): documents of 4 and of 8 tokens
    mask = masks.segment_ids(ids) & masks.causal()
    kinds = jax.jit(
        lambda a: masks.tile_kinds(masks.segment_ids(a) & masks.causal(), 12, 12, 4, 4, q_offset=0, kv_offset=0)
    )(ids)
    dense = np.asarray(mask.dense(12, 12))[:, 0]  # (2, 12, 12)
    for i in range(3):
        for j in range(3):
            tiles = [d[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] for d in dense]
            each = [masks.EMPTY if not t.any() else masks.FULL if t.all() else masks.PARTIAL for t in tiles]
            want = each[0] if each[0] == each[1] else masks.PARTIAL
            assert kinds[i, j] == want, (i, j, each)
    assert (
        jattn.choose_implementation(
            jnp.zeros((2, 1024, 8)),
            jnp.zeros((2, 1024, 8)),
            jnp.zeros((2, 1024, 8)),
            mask=masks.padding(q_lengths=[3, 1024]),
        )
        == "blockwise"
    )


def test_vmap_over_per_example_masks_equals_a_loop():
    rng = np.random.default_rng(8)
    ids = jnp.asarray(np.stack([_segments(rng, 2, 11, 3) for _ in range(3)]))  # (3, B=2, T)
    q, k, v = _rand((3, 2, 2, 11, 5), 0), _rand((3, 2, 2, 11, 5), 1), _rand((3, 2, 2, 11, 4), 2)

    def f(q, k, v, ids):
        mask = masks.segment_ids(ids) & masks.causal()
        return jattn.attention(q, k, v, mask=mask, implementation="blockwise", block_size=(4, 3))

    mapped = jax.jit(jax.vmap(f))(q, k, v, ids)
    for n in range(3):  # the explicit mask from the ids themselves: (B, 1, T, S)
        same = np.asarray(ids)[n][:, :, None] == np.asarray(ids)[n][:, None, :]
        dense = same[:, None] & np.tril(np.ones((11, 11), bool))
        np.testing.assert_allclose(
            ref.f64(mapped[n]), ref.attention(q[n], k[n], v[n], dense)[0], **ref.tol(jnp.float32)
        )


@pytest.mark.parametrize(
    ("q_shape", "mask", "match"),
    [
        ((11, 5), masks.padding(q_lengths=[3, 4]), "per-example mask needs a batch axis in q"),
        ((2, 11, 5), masks.padding(q_lengths=[3, 4]) & masks.segment_ids(np.zeros((3, 11), int)), "share the batch B"),
        ((2, 11, 5), masks.segment_ids(np.zeros((2, 9), int)), r"must have shapes \(B, T=11\)"),
    ],
)
def test_per_example_masks_refuse_what_does_not_fit_on_the_blockwise_path(q_shape, mask, match):
    q = jnp.zeros(q_shape)
    with pytest.raises(ValueError, match=match):
        jattn.attention(q, q, q, mask=mask, implementation="blockwise")


def test_per_example_batch_is_qs_first_axis_when_k_has_more_leading_axes():
    """q (B, T, D) against k, v (1, 1, S, D): the mask's batch lands where q's does (found by the fuzz)."""
    q, k, v = _rand((2, 5, 3), 0), _rand((1, 1, 7, 3), 1), _rand((1, 1, 7, 3), 2)
    for mask in (
        masks.padding(q_lengths=[1, 4], kv_lengths=[2, 7]),
        masks.segment_ids(np.array([[0, 0, 1, 1, 1]] * 2), np.eye(2, 7, 3, int)),
    ):
        dense = np.asarray(mask.dense(5, 7))[:, 0]  # (B, T, S): batch on q's first axis
        got = jax.jit(
            lambda q, k, v, m=mask: jattn.attention(q, k, v, mask=m, implementation="blockwise", block_size=(2, 3))
        )(q, k, v)
        np.testing.assert_allclose(ref.f64(got), ref.attention(q, k, v, dense)[0], **ref.tol(jnp.float32))


# -- masks.predicate: a function of (batch, head, q_pos, kv_pos) (issue 13) ---------------------------


def _explicit_predicate(fn, shape, q0):
    """The mask ``(B, N, T, S)`` of ``fn`` evaluated entry by entry in Python (the independent reference)."""
    B, N, T, S = shape
    return np.array(
        [[[[bool(fn(b, h, q0 + t, s)) for s in range(S)] for t in range(T)] for h in range(N)] for b in range(B)]
    )


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla"])
def test_predicate_of_batch_and_head_equals_the_reference_with_traced_closures(impl):
    """Per-head windows and per-example document ids, closed over as traced arguments; values and gradients."""
    rng = np.random.default_rng(9)
    B, N, T, S = 3, 2, 7, 10
    windows, docs = np.array([1, 4]), rng.integers(0, 3, size=(B, S))
    q, k, v = _rand((B, N, T, 5), 0), _rand((B, 1, S, 5), 1), _rand((B, 1, S, 5), 2)  # E == D for jax.nn
    g = _rand((B, N, T, 5), 3)

    def rule(windows, docs):
        return lambda b, h, i, j: (i - j <= windows[h]) & (docs[b, j] != b)

    def loss(q, k, v, windows, docs):
        mask = masks.predicate(rule(windows, docs)) & masks.causal()
        kw = {"block_size": (4, 3)} if impl == "blockwise" else {}
        out = jattn.attention(q, k, v, mask=mask, implementation=impl, **kw)
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, jnp.asarray(windows), jnp.asarray(docs)
    )
    dense = _explicit_predicate(rule(windows, docs), (B, N, T, S), S - T) & np.asarray(masks.causal().dense(T, S))
    assert (~dense.any(-1)).any()  # some rows see no key: exactly 0
    np.testing.assert_allclose(ref.f64(out), ref.attention(q, k, v, dense)[0], **ref.tol(jnp.float32))
    for got, want in zip(grads, ref.attention_grads(q, k, v, g, dense)[:3], strict=True):
        ref.assert_grad_close(got, want, jnp.float32)


def test_predicate_under_vmap_of_its_closed_over_array_equals_a_loop():
    q, k, v = _rand((2, 2, 7, 5), 0), _rand((2, 2, 7, 5), 1), _rand((2, 2, 7, 5), 2)
    windows = jnp.array([[0, 3], [2, 2], [5, 1]])

    def f(w, impl):
        kw = {"block_size": (4, 3)} if impl == "blockwise" else {}
        mask = masks.predicate(lambda b, h, i, j: (i - j <= w[h]) & (j <= i))
        return jattn.attention(q, k, v, mask=mask, implementation=impl, **kw)

    mapped = jax.jit(jax.vmap(lambda w: f(w, "blockwise")))(windows)
    dense = jax.jit(lambda w: f(w, "dense"))  # one program for the loop's three calls
    for n in range(3):
        np.testing.assert_allclose(mapped[n], dense(windows[n]), **ref.tol(jnp.float32))


def test_predicate_refuses_bad_input():
    q = jnp.zeros((2, 2, 5, 3))
    with pytest.raises(TypeError, match="predicate needs a callable"):
        masks.predicate(3)
    with pytest.raises(ValueError, match="predicate takes static int offsets"):
        jattn.attention(q, q, q, mask=masks.predicate(lambda b, h, i, j: i >= j), q_offset=jnp.array([0, 1]))
    with pytest.raises(ValueError, match="evaluated inside attention calls"):
        masks.predicate(lambda b, h, i, j: i >= j).dense(5, 5)


def test_fuzz_finds_on_the_blockwise_path():
    """Sinks against a mask array's leading dims (q 2-D); padding under float64 (int32 tile bounds)."""
    q, k, v = _rand((5, 3), 0), _rand((7, 3), 1), _rand((7, 3), 2)
    arr = np.random.default_rng(10).random((1, 5, 7)) < 0.6
    sinks = jnp.array([0.5])
    want, got = jax.jit(
        lambda q, k, v: [
            jattn.attention(q, k, v, mask=arr, sinks=sinks, implementation=i, block_size=b)
            for i, b in (("dense", None), ("blockwise", (2, 3)))
        ]
    )(q, k, v)
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    with jax.enable_x64(True):
        q, k = _rand((2, 5, 3), 0, jnp.float64), _rand((2, 7, 3), 1, jnp.float64)
        mask = masks.padding(q_lengths=np.array([2, 5]), kv_lengths=np.array([0, 6]))
        want = ref.attention(q, k, k, np.asarray(mask.dense(5, 7))[:, 0])[0]
        got = jax.jit(lambda q, k: jattn.attention(q, k, k, mask=mask, implementation="blockwise", block_size=(2, 3)))(
            q, k
        )
        np.testing.assert_allclose(ref.f64(got), want, **ref.tol(jnp.float64))
