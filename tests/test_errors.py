"""Nothing silent (issue #11, library half): every bad input is named, valid edge values work.

Each bad-input class raises a TypeError (wrong kind of value) or ValueError (wrong value or
shape) whose message names the argument. Values that cannot be read under ``jit`` get the
documented defined behaviour instead, tested here too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
import jattn.flax
import jattn.linen
import jattn.nnx
from jattn import masks
from tests import reference as ref

D = 12  # d_model of the modules below


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _nnx(**options):
    return jattn.nnx.SelfAttention(D, num_heads=2, rngs=nnx.Rngs(0), **options)


def _cross(**options):
    return jattn.nnx.CrossAttention(D, 5, num_heads=2, rngs=nnx.Rngs(0), **options)


def _linen(**options):
    return jattn.linen.SelfAttention(D, **({"num_heads": 2} | options)).init(jax.random.key(0), _rand((2, 3, D), 0))


def _cached(max_length=4, **cache):
    m = _nnx()
    m.init_cache(2, max_length, **cache)
    return m


def _linear(**kwargs):
    q, k, v = _rand((2, 3, 4), 0), _rand((2, 3, 4), 1), _rand((2, 3, 5), 2)
    return jattn.linear_attention(q, k, v, **kwargs)


X = _rand((2, 3, D), 1)

# (id naming the class, call, exception type, regex the message must match: it names the argument)
BAD = [
    # -- mask constructors
    ("sliding_window_bool", lambda: masks.sliding_window(True), TypeError, "sliding_window left must be an int"),
    ("sliding_window_float", lambda: masks.sliding_window(1.7), TypeError, "sliding_window left must be an int"),
    ("sliding_window_negative_right", lambda: masks.sliding_window(1, -1), ValueError, "sliding_window right"),
    ("chunked_bool", lambda: masks.chunked(True), TypeError, "chunked size must be an int, got True"),
    ("chunked_zero", lambda: masks.chunked(0), ValueError, "chunked size must be a positive int, got 0"),
    ("prefix_lm_negative", lambda: masks.prefix_lm(-3), ValueError, "prefix_length must be a non-negative int"),
    ("global_tokens_float", lambda: masks.global_tokens([1.7]), TypeError, r"global_tokens indices\[0\].*1\.7"),
    ("global_tokens_negative", lambda: masks.global_tokens([0, -1]), ValueError, r"global_tokens indices\[1\]"),
    ("global_tokens_not_a_sequence", lambda: masks.global_tokens(3), TypeError, "global_tokens indices"),
    ("global_tokens_empty", lambda: masks.global_tokens([]), ValueError, "global_tokens needs at least one"),
    ("padding_negative", lambda: masks.padding(kv_lengths=[-1]), ValueError, r"kv_lengths must be non-negative"),
    ("padding_float", lambda: masks.padding(q_lengths=[1.5]), TypeError, "padding q_lengths must be an integer"),
    (
        "padding_batch_mismatch",
        lambda: masks.padding(q_lengths=[1, 2], kv_lengths=[1, 2, 3]),
        ValueError,
        "share the batch",
    ),
    (
        "segment_ids_wrong_length",
        lambda: jattn.attention(X, X, X, mask=masks.segment_ids(jnp.zeros((2, 4), jnp.int32))),
        ValueError,
        r"q_segments \(2, 4\) and kv_segments \(2, 4\) must have shapes \(B, T=3\) and \(B, S=3\)",
    ),
    (
        "segment_ids_batch_mismatch",
        lambda: masks.segment_ids(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32)),
        ValueError,
        r"kv_segments.*\(2, 3\) and \(3, 3\)",
    ),
    ("segment_ids_float", lambda: masks.segment_ids(jnp.zeros((2, 3))), TypeError, "q_segments must be an integer"),
    ("dense_negative_T", lambda: masks.causal().dense(-1, 3), ValueError, "T must be a non-negative int, got -1"),
    ("dense_float_S", lambda: masks.causal().dense(2, 2.5), TypeError, "S must be an int, got 2.5"),
    ("block_kinds_negative_block", lambda: masks.causal().block_kinds(4, 4, -1, 2), ValueError, "block_q"),
    ("block_kinds_bool_block", lambda: masks.causal().block_kinds(4, 4, 2, True), TypeError, "block_kv"),
    # -- linear attention
    ("linear_eps_negative", lambda: _linear(eps=-1), ValueError, r"eps must be a finite number in \(0.0, inf\)"),
    ("linear_eps_zero", lambda: _linear(eps=0.0, feature_map="relu"), ValueError, "eps must be"),
    ("linear_eps_nan", lambda: _linear(eps=float("nan")), ValueError, "eps must be"),
    ("linear_causal_not_bool", lambda: _linear(causal="yes"), TypeError, "causal must be a bool"),
    ("linear_return_state_not_bool", lambda: _linear(return_state=1), TypeError, "return_state must be a bool"),
    ("linear_chunk_size_bool", lambda: _linear(causal=True, chunk_size=True), TypeError, "chunk_size must be an int"),
    ("linear_feature_map_name", lambda: _linear(feature_map="softplus2"), ValueError, "feature_map must be one of"),
    ("linear_feature_map_type", lambda: _linear(feature_map=3), TypeError, "feature_map must be a name"),
    ("linear_feature_map_negative", lambda: _linear(feature_map=lambda x: x), ValueError, "non-negative features"),
    ("linear_feature_map_shape", lambda: _linear(feature_map=jnp.sum), ValueError, r"feature_map .* \(..., L, F\)"),
    (
        "linear_kv_mask_shape",
        lambda: _linear(kv_mask=jnp.ones((2, 4), bool)),
        ValueError,
        r"kv_mask must have shape \(..., S=3\).* got \(2, 4\)",
    ),
    ("linear_kv_mask_dtype", lambda: _linear(kv_mask=jnp.ones((2, 3))), TypeError, "kv_mask must be boolean"),
    (
        "linear_initial_state_shape",
        lambda: _linear(initial_state=jattn.LinearState(jnp.zeros((2, 3, 3)), jnp.zeros((2, 3)))),
        ValueError,
        r"initial_state must be a LinearState with kv \(..., F=4, E=5\) and z \(..., F=4\).*got kv \(2, 3, 3\)",
    ),
    ("linear_initial_state_type", lambda: _linear(initial_state=jnp.zeros(3)), TypeError, "initial_state must be"),
    (
        "linear_leading_mismatch",
        lambda: jattn.linear_attention(_rand((2, 3, 4), 0), _rand((3, 3, 4), 1), _rand((3, 3, 4), 2)),
        ValueError,
        r"leading dimensions of q, k, v do not broadcast: q \(2, 3, 4\), k \(3, 3, 4\)",
    ),
    # -- module configuration (NNX; the Linen twin is in test_linen_configuration_is_checked_too)
    ("module_dropout_negative", lambda: _nnx(dropout_rate=-0.5), ValueError, r"dropout_rate must be .* \[0.0, 1.0\)"),
    ("module_dropout_one", lambda: _nnx(dropout_rate=1.0), ValueError, "dropout_rate"),
    ("module_dropout_bool", lambda: _nnx(dropout_rate=True), TypeError, "dropout_rate must be a real number"),
    (
        "module_num_heads_bool",
        lambda: jattn.nnx.SelfAttention(D, num_heads=True, rngs=nnx.Rngs(0)),
        TypeError,
        "num_heads",
    ),
    ("module_num_kv_heads_float", lambda: _nnx(num_kv_heads=1.0), TypeError, "num_kv_heads must be an int"),
    (
        "module_d_model_zero",
        lambda: jattn.nnx.SelfAttention(0, rngs=nnx.Rngs(0)),
        ValueError,
        "d_model must be a positive",
    ),
    *(
        (f"linen_{name}_d_model_{d!r}", call, error, match)
        for d, error, match in [
            (0, ValueError, "d_model must be a positive int, got 0"),
            ("8", TypeError, "d_model must be an int"),
        ]
        for name, call in [
            ("self", lambda d=d: jattn.linen.SelfAttention(d).init(jax.random.key(0), jnp.ones((2, 5, 8)))),
            (
                "cross",
                lambda d=d: jattn.linen.CrossAttention(d, context_features=4).init(
                    jax.random.key(0), jnp.ones((2, 5, 8)), jnp.ones((2, 3, 4))
                ),
            ),
        ]
    ),
    ("module_qkv_features_zero", lambda: _nnx(qkv_features=0), ValueError, "qkv_features must be a positive int"),
    ("module_out_features_zero", lambda: _nnx(out_features=0), ValueError, "out_features must be a positive int"),
    ("module_out_proj_not_bool", lambda: _nnx(out_proj="yes"), TypeError, "out_proj must be a bool"),
    ("module_use_bias_not_bool", lambda: _nnx(use_bias=None), TypeError, "use_bias must be a bool"),
    ("module_dtype", lambda: _nnx(dtype="foo"), TypeError, "dtype must be a floating dtype or None"),
    ("module_param_dtype_int", lambda: _nnx(param_dtype=jnp.int32), TypeError, "param_dtype must be a floating"),
    ("module_kind", lambda: _nnx(kind="sparse"), ValueError, "kind must be one of"),
    ("module_feature_map", lambda: _nnx(kind="linear", feature_map="nope"), ValueError, "feature_map must be one of"),
    ("module_sequence_axis", lambda: _nnx(sequence_axis=0), TypeError, "sequence_axis must be a mesh axis name"),
    (
        "cross_context_features_zero",
        lambda: jattn.nnx.CrossAttention(D, 0, rngs=nnx.Rngs(0)),
        ValueError,
        "context_features",
    ),
    # -- module calls
    (
        "call_x_features",
        lambda: _nnx()(_rand((2, 3, 11), 0)),
        ValueError,
        r"x must have shape .* 12\), got \(2, 3, 11\)",
    ),
    ("call_x_empty_T", lambda: _nnx()(jnp.ones((2, 0, D))), ValueError, r"x must have shape \(\.\.\., length >= 1"),
    ("call_x_empty_B", lambda: _nnx()(jnp.ones((0, 3, D))), ValueError, r"x must have shape .*got \(0, 3, 12\)"),
    ("call_x_integer", lambda: _nnx()(jnp.ones((2, 3, D), jnp.int32)), TypeError, "x must be floating point"),
    ("call_context_empty_S", lambda: _cross()(X, jnp.ones((2, 0, 5))), ValueError, r"context must have shape"),
    ("call_context_batch", lambda: _cross()(X, jnp.ones((3, 4, 5))), ValueError, "x and context must share the batch"),
    (
        "call_context_mask_dtype",
        lambda: _cross()(X, jnp.ones((2, 4, 5)), context_mask=jnp.ones((2, 4))),
        TypeError,
        "context_mask must be boolean",
    ),
    (
        "call_context_mask_shape",
        lambda: _cross()(X, jnp.ones((2, 4, 5)), context_mask=jnp.ones((2, 3), bool)),
        ValueError,
        r"context_mask must have shape \(\.\.\., S\) = \(2, 4\)",
    ),
    (
        "call_mask_wrong_batch",
        lambda: _nnx()(X, jnp.ones((3, 3, 3), bool)),
        ValueError,
        r"mask must have shape .*\(B, T, S\) = \(2, 3, 3\).* got shape \(3, 3, 3\)",
    ),
    ("call_mask_1d", lambda: _nnx()(X, jnp.ones((3,), bool)), ValueError, r"mask must have shape .* got shape \(3,\)"),
    (
        "call_mask_heads",
        lambda: _nnx()(X, jnp.ones((2, 3, 3, 3), bool)),
        ValueError,
        r"\(B, N, T, S\) = \(2, 2, 3, 3\)",
    ),
    ("call_mask_not_bool", lambda: _nnx()(X, jnp.ones((3, 3))), TypeError, "mask must be boolean"),
    (
        "call_per_example_mask_batch",
        lambda: _nnx()(X, masks.padding(kv_lengths=[1, 2, 3])),
        ValueError,
        r"mask must have shape .* got shape \(3, 1, 3, 3\)",
    ),
    (
        "call_return_weights_not_bool",
        lambda: _nnx()(X, return_weights=None),
        TypeError,
        "return_weights must be a bool",
    ),
    ("call_deterministic_not_bool", lambda: _nnx()(X, deterministic=0), TypeError, "deterministic must be a bool"),
    ("call_lengths_without_decode", lambda: _nnx()(X, lengths=jnp.array([1, 2])), ValueError, "lengths applies to"),
    # -- the NNX cache
    ("cache_max_length_zero", lambda: _cached(max_length=0), ValueError, "max_length must be a positive int, got 0"),
    ("cache_batch_size_bool", lambda: _nnx().init_cache(True, 4), TypeError, "batch_size must be an int"),
    ("cache_window_negative", lambda: _cached(window=-1), ValueError, "window must be a positive int, got -1"),
    (
        "cache_pinned_negative",
        lambda: _cached(window=2, pinned=(-1,)),
        ValueError,
        r"pinned\[0\] must be a non-negative",
    ),
    (
        "cache_pinned_duplicate",
        lambda: _cached(window=2, pinned=(0, 0)),
        ValueError,
        "pinned positions must be distinct",
    ),
    ("cache_pinned_without_window", lambda: _cached(pinned=(0,)), ValueError, r"pinned=\(0,\) needs a window"),
    ("cache_pinned_not_sequence", lambda: _cached(window=2, pinned=0), TypeError, "pinned must be a sequence"),
    ("cache_dtype", lambda: _cached(dtype=jnp.int8), TypeError, "dtype must be a floating dtype"),
    (
        "cache_window_linear",
        lambda: _nnx(kind="linear").init_cache(2, 4, window=2),
        ValueError,
        "window=2 applies to the softmax kind",
    ),
    (
        "decode_past_max_length",
        lambda: _cached(max_length=4)(_rand((2, 5, D), 0), decode=True),
        ValueError,
        "max_length=4",
    ),
    (
        "decode_lengths_out_of_range",
        lambda: _cached(max_length=20)(X, decode=True, lengths=jnp.array([10, -2])),
        ValueError,
        r"lengths must be in \[0, T=3\], got \[10, -2\]",
    ),
    (
        "decode_lengths_shape",
        lambda: _cached()(X, decode=True, lengths=jnp.array([1, 2, 3])),
        ValueError,
        r"lengths must have shape \(B,\) = \(2,\), got \(3,\)",
    ),
    (
        "decode_lengths_float",
        lambda: _cached()(X, decode=True, lengths=jnp.array([1.0, 2.0])),
        TypeError,
        "lengths must be an integer",
    ),
    (
        "decode_batch",
        lambda: _cached()(_rand((3, 1, D), 0), decode=True),
        ValueError,
        "cache was made for batch_size=2",
    ),
    ("decode_before_init_cache", lambda: _nnx()(X, decode=True), ValueError, r"needs init_cache"),
    (
        "decode_array_mask",
        lambda: _cached()(X, jnp.ones((3, 3), bool), decode=True),
        TypeError,
        "mask must be a jattn.masks.Mask",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(dropout_rate=-0.5), ValueError, "dropout_rate"),
        (dict(num_heads=True), TypeError, "num_heads must be an int"),
        (dict(dtype="foo"), TypeError, "dtype must be a floating dtype"),
        (dict(out_features=0), ValueError, "out_features must be a positive int"),
    ],
    ids=["dropout_rate", "num_heads_bool", "dtype", "out_features"],
)
def test_linen_configuration_is_checked_too(options, error, match):
    with pytest.raises(error, match=match):
        _linen(**options)


def test_linen_cross_attention_context_features():
    lin = jattn.linen.CrossAttention(D, context_features=True)
    with pytest.raises(TypeError, match="context_features must be an int"):
        lin.init(jax.random.key(0), X, jnp.ones((2, 4, 5)))


# -- valid edge values ------------------------------------------------------------------------


def test_numpy_integers_are_integers():
    q, k, v = _rand((2, 6, 4), 0), _rand((2, 6, 4), 1), _rand((2, 6, 4), 2)
    for np_mask, int_mask in [
        (masks.sliding_window(np.int64(2), np.int32(1)), masks.sliding_window(2, 1)),
        (masks.chunked(np.int64(3)), masks.chunked(3)),
        (masks.prefix_lm(np.int16(2)), masks.prefix_lm(2)),
        (masks.global_tokens(np.array([0, 4])), masks.global_tokens([0, 4])),
    ]:
        assert np_mask == int_mask
        got, same = jax.jit(
            lambda q, k, v, np_mask=np_mask, int_mask=int_mask: (
                jattn.attention(q, k, v, mask=np_mask),
                jattn.attention(q, k, v, mask=int_mask),
            )
        )(q, k, v)
        np.testing.assert_array_equal(got, same)
        want, _, _ = ref.attention(q, k, v, mask=np.asarray(int_mask.dense(6, 6)))
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    a = jattn.nnx.SelfAttention(np.int64(D), num_heads=np.int64(2), rngs=nnx.Rngs(0))
    b = jattn.nnx.SelfAttention(D, num_heads=2, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(*nnx.jit(lambda a, b, x: (a(x), b(x)))(a, b, X))
    a.init_cache(np.int64(2), np.int64(4), window=np.int64(2), pinned=np.array([0]))
    assert a.cache["k"].shape == (2, 3, 2, 6)


def test_3d_module_mask_is_per_example_even_when_batch_equals_heads():
    B = N = 2
    T = 5
    m = jattn.nnx.SelfAttention(D, num_heads=N, rngs=nnx.Rngs(3))
    x = _rand((B, T, D), 4)
    mask = jnp.stack([jnp.tril(jnp.ones((T, T), bool)), jnp.triu(jnp.ones((T, T), bool))])  # (B, T, S)
    lin = jattn.linen.SelfAttention(D, num_heads=N)
    params = {n: {"kernel": getattr(m, n).kernel[...]} for n in ("wq", "wk", "wv", "wo")}

    @nnx.jit
    def run(m, params, x, mask):  # an explicit loop: example b with its own (T, S) mask
        alone = [m(x[b : b + 1], mask[b])[0] for b in range(B)]
        return m(x, mask), alone, lin.apply({"params": params}, x, mask)

    out, alone, out_linen = run(m, params, x, mask)
    for b in range(B):
        np.testing.assert_allclose(out[b], alone[b], **ref.tol(jnp.float32))
    # the float64 reference: heads of the projections, mask broadcast over heads, then wo
    w = {n: ref.f64(getattr(m, n).kernel[...]) for n in ("wq", "wk", "wv", "wo")}
    heads = [(ref.f64(x) @ w[n]).reshape(B, T, N, D // N).transpose(0, 2, 1, 3) for n in ("wq", "wk", "wv")]
    o, _, _ = ref.attention(*heads, mask=np.asarray(mask)[:, None])
    want = o.transpose(0, 2, 1, 3).reshape(B, T, D) @ w["wo"]
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(out_linen, out, **ref.tol(jnp.float32))


def test_decoding_to_exact_capacity_equals_full_pass_and_one_more_raises():
    """The steps under nnx.jit fill the cache exactly; the next call, eager, raises and leaves the cache as it was."""
    T = 6
    m = _nnx()
    x = _rand((2, T, D), 5)
    full = nnx.jit(lambda m, x: m(x, masks.causal()))(m, x)
    m.init_cache(2, T)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [step(m, x[:, :4]), step(m, x[:, 4:5]), step(m, x[:, 5:])]
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **ref.tol(jnp.float32))
    before = {n: v[...] for n, v in m.cache.items()}
    with pytest.raises(ValueError, match=r"decoding past init_cache\(max_length=6\)"):
        m(x[:, :1], decode=True)
    for n, v in m.cache.items():  # the refused call left the cache as it was
        np.testing.assert_array_equal(v[...], before[n])


@nnx.jit
def _decode_step(m, x, lengths):
    return m(x, decode=True, lengths=lengths)


def test_traced_faults_in_decoding_give_nan():
    """Under jit, past-capacity positions and out-of-range lengths cannot raise: they give NaN.

    The valid outputs are the full causal pass's (every module here has the same weights, ``nnx.Rngs(0)``).
    """
    m = _cached(max_length=4)
    x = _rand((2, 3, D), 6)
    full = nnx.jit(lambda m, x: m(x, masks.causal()))(_nnx(), x)
    got = _decode_step(m, x, jnp.array([3, 3]))
    np.testing.assert_allclose(got, full, **ref.tol(jnp.float32))
    got = _decode_step(m, x, jnp.array([3, 1]))  # positions 3..5 of example 0, position 3 of example 1
    assert np.all(np.isfinite(got[0, :1])) and np.all(np.isnan(got[0, 1:]))  # position 3 fits, 4 and 5 do not
    assert np.all(np.isfinite(got[1]))
    bad = _cached(max_length=20)
    got = _decode_step(bad, x, jnp.array([2, -2]))  # example 1 has a negative length
    np.testing.assert_allclose(got[0, :2], full[0, :2], **ref.tol(jnp.float32))
    assert np.all(np.isnan(got[1])) and int(bad.cache["next"][1]) == 0  # clipped to 0: nothing cached


def test_traced_negative_features_give_nan_and_nonnegative_maps_match_eager():
    q, k, v = _rand((2, 3, 4), 0), _rand((2, 3, 4), 1), _rand((2, 3, 5), 2)
    identity = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, feature_map=lambda x: x))
    out = identity(q, k, v)
    assert out.shape == (2, 3, 5) and np.all(np.isnan(out))
    square = jax.jit(lambda q, k, v: jattn.linear_attention(q, k, v, feature_map=jnp.square, causal=True))
    np.testing.assert_allclose(
        square(q, k, v), jattn.linear_attention(q, k, v, feature_map=jnp.square, causal=True), **ref.tol(jnp.float32)
    )


def test_traced_negative_padding_length_masks_the_example():
    q, k, v = _rand((2, 3, 4), 0), _rand((2, 3, 4), 1), _rand((2, 3, 4), 2)
    f = jax.jit(lambda n: jattn.attention(q, k, v, mask=masks.padding(kv_lengths=n)))
    out = f(jnp.array([-1, 2]))
    np.testing.assert_array_equal(out[0], np.zeros((3, 4)))  # nothing to attend to: rows of 0
    want, _, _ = ref.attention(q[1], k[1, :2], v[1, :2])
    np.testing.assert_allclose(out[1], want, **ref.tol(jnp.float32))


def test_linear_attention_empty_causal_sequence():
    e = jnp.zeros((2, 0, 4))
    out, state = jattn.linear_attention(e, e, jnp.zeros((2, 0, 5)), causal=True, return_state=True)
    assert out.shape == (2, 0, 5) and state.kv.shape == (2, 4, 5)
    np.testing.assert_array_equal(state.kv, np.zeros((2, 4, 5)))


# -- the core: jattn.attention --------------------------------------------------------------------

_Q = jnp.ones((2, 5, 4))


def _attend(**kw):
    args = {"q": _Q, "k": _Q, "v": _Q} | {n: kw.pop(n) for n in ("q", "k", "v") if n in kw}
    return lambda: jattn.attention(args["q"], args["k"], args["v"], **kw)


CORE_BAD = [
    ("block_size zero", _attend(block_size=0, implementation="blockwise"), ValueError, "block_size"),
    ("block_size negative", _attend(block_size=(4, -1), implementation="blockwise"), ValueError, "block_size"),
    ("block_size float", _attend(block_size=2.5, implementation="blockwise"), TypeError, "block_size"),
    ("block_size bool", _attend(block_size=True, implementation="blockwise"), TypeError, "block_size"),
    ("block_size triple", _attend(block_size=(1, 2, 3), implementation="blockwise"), ValueError, "block_size"),
    ("scale string", _attend(scale="a"), TypeError, "scale"),
    ("scale vector", _attend(scale=jnp.ones(2)), ValueError, "scale"),
    ("depth zero", _attend(q=jnp.ones((2, 5, 0)), k=jnp.ones((2, 5, 0))), ValueError, "depth D"),
    ("dropout_rate negative", _attend(dropout_rate=-0.5, dropout_rng=jax.random.key(0)), ValueError, "dropout_rate"),
    ("dropout_rate one", _attend(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, "dropout_rate"),
    ("dropout_rate bool", _attend(dropout_rate=True, dropout_rng=jax.random.key(0)), TypeError, "dropout_rate"),
    ("dropout without key", _attend(dropout_rate=0.5), ValueError, "dropout_rng"),
    ("mask float", _attend(mask=jnp.ones((5, 5))), TypeError, "mask must be boolean"),
    ("mask shape", _attend(mask=jnp.ones((4, 5), bool)), ValueError, "mask of shape"),
    ("bias integer", _attend(bias=jnp.ones((5, 5), jnp.int32)), TypeError, "bias"),
    ("bias shape", _attend(bias=jnp.ones((3,))), ValueError, "bias of shape"),
    ("implementation unknown", _attend(implementation="flash"), ValueError, "implementation"),
    ("q integer", _attend(q=jnp.ones((2, 5, 4), jnp.int32)), TypeError, "q must be"),
    ("q rank one", _attend(q=jnp.ones((4,))), ValueError, "q must have at least 2"),
    ("offsets without predicate", _attend(q_offset=1), ValueError, "q_offset"),
    ("q_offset float", _attend(mask=masks.causal(), q_offset=1.9), TypeError, "q_offset must be an int or an integer"),
    ("q_offset bool", _attend(mask=masks.causal(), q_offset=True), TypeError, "q_offset must be an int or an integer"),
    *(
        (f"kv_offset float array on {impl}", call, TypeError, r"kv_offset must be .* dtype float32 with shape \(2,\)")
        for impl in ("dense", "blockwise", "xla")
        for call in [_attend(mask=masks.causal(), kv_offset=jnp.array([1.0, 2.0]), implementation=impl)]
    ),
    *(
        (f"per-example mask of another batch on {impl}", call, ValueError, r"do not broadcast: q \(2, 3, 5, 4\)")
        for impl in ("dense", "blockwise", "xla")
        for m in (masks.padding(kv_lengths=jnp.array([1, 2, 3])), masks.segment_ids(jnp.zeros((3, 5), jnp.int32)))
        for call in [
            _attend(
                q=jnp.ones((2, 3, 5, 4)),
                k=jnp.ones((2, 3, 5, 4)),
                v=jnp.ones((2, 3, 5, 4)),
                mask=m,
                implementation=impl,
            )
        ]
    ),
    ("combine with a number", lambda: masks.causal() & 1.5, TypeError, "masks combine only"),
]


@pytest.mark.parametrize(("call", "error", "match"), [b[1:] for b in CORE_BAD], ids=[b[0] for b in CORE_BAD])
def test_bad_core_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla"])
def test_empty_sequences_are_defined(impl):
    """T = 0 gives an empty output; S = 0 leaves every row without keys: 0, log-sum-exp -inf, zero gradient."""
    q, k = _rand((2, 3, 4), 0), _rand((2, 0, 4), 1)

    @jax.jit
    def run(q, k):
        return (
            jattn.attention(q, k, k, return_lse=True, implementation=impl),
            jax.grad(lambda q: jnp.sum(jattn.attention(q, k, k, implementation=impl)))(q),
            jattn.attention(k, q, q, implementation=impl),
        )

    (out, lse), dq, empty = run(q, k)
    assert out.shape == (2, 3, 4) and np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))
    assert np.all(np.asarray(dq) == 0)
    assert empty.shape == (2, 0, 4)


# -- what a newcomer brings (issue #31): another layout, a mask constructor uncalled, torch's masks -----

# jax.nn's (B, T, N, H) with T=6 != S=5, and torch's (B, N, T, D) with N=4 query heads against K=2
_JAX_NN = tuple(_rand(shape, seed) for shape, seed in [((2, 6, 4, 8), 30), ((2, 5, 2, 8), 31), ((2, 5, 2, 8), 32)])
_TORCH = tuple(_rand(shape, seed) for shape, seed in [((2, 4, 6, 8), 33), ((2, 2, 5, 8), 34), ((2, 2, 5, 8), 35)])
_Q4, _K4 = _rand((2, 4, 6, 8), 36), _rand((2, 4, 5, 8), 37)  # jattn's (B, N, T, D), (B, N, S, D)
_QG, _KG = _TORCH[0].reshape(2, 2, 2, 6, 8), _TORCH[1][:, :, None]  # the grouped form (B, K, G, T, D), (B, K, 1, S, D)
_LAYOUTS = (
    r"jattn\.attention reads q \(\.\.\., T, D\).*q \(B, K, G, T, D\) against k, v \(B, K, 1, S, D\).*"
    r"jax\.nn's layout q \(B, T, N, H\).*jattn\.dot_product_attention\(q, k, v\)"
)
_TORCH_GROUPED = r"q\.reshape\(2, 2, 2, 6, 8\) with k\[:, :, None\] and v\[:, :, None\]"
_UNCALLED = (
    r"mask must be a boolean array or a jattn\.masks\.Mask, got the function masks\.causal: .*mask=masks\.causal\(\)"
)
_ARRAYS_ONLY = r"mask must be a boolean array broadcastable to \(B, N, T, S\).*pass is_causal=True"
_KEY_PADDING = r"mask of shape \(2, 5\) does not broadcast.*masks\.padding\(kv_lengths=lengths\).*"

NEWCOMER = [
    # 1 and 4: another layout's q, k, v (the same shapes run: attention's docstring, "Layout")
    *(
        (
            f"jax.nn layout on {impl}",
            lambda impl=impl: jattn.attention(*_JAX_NN, implementation=impl),
            ValueError,
            r"leading dimensions of q, k, v do not broadcast: q \(2, 6, 4, 8\), k \(2, 5, 2, 8\).*" + _LAYOUTS,
        )
        for impl in ("dense", "blockwise", "xla", "pallas")
    ),
    *(
        (
            f"torch grouped heads on {impl}",
            lambda impl=impl: jattn.attention(*_TORCH, implementation=impl),
            ValueError,
            r"leading dimensions of q, k, v do not broadcast: q \(2, 4, 6, 8\).*q \(B, K, G, T, D\).*"
            + _TORCH_GROUPED
            + r".*jattn\.dot_product_attention\(q, k, v\)",
        )
        for impl in ("dense", "blockwise", "xla", "pallas")
    ),
    (
        "torch grouped heads, weights",
        lambda: jattn.attention_weights(*_TORCH[:2]),
        ValueError,
        r"leading dimensions of q, k do not broadcast.*" + _TORCH_GROUPED,
    ),
    (
        "torch grouped heads, predicate",
        lambda: jattn.attention(*_TORCH, mask=masks.causal()),
        ValueError,
        _TORCH_GROUPED,
    ),
    (
        "jax.nn layout with its mask",
        lambda: jattn.attention(_JAX_NN[0], _JAX_NN[0], _JAX_NN[0], mask=jnp.tril(jnp.ones((6, 6), bool))),
        ValueError,
        r"mask of shape \(6, 6\) does not broadcast to \(\.\.\., T, S\) = \(\.\.\., 4, 4\).*fits \(T, S\) = \(6, 6\) "
        r"as if q and k were jax\.nn's \(B, T, N, H\).*jattn\.dot_product_attention",
    ),
    (
        "torch's (B, N, T, S) bias with grouped heads",
        lambda: jattn.attention(_QG, _KG, _KG, bias=jnp.zeros((2, 4, 6, 5))),
        ValueError,
        r"bias \(2, 4, 6, 5\).*bias\.reshape\(2, 2, 2, 6, 5\) \(B, K, G, T, S\)",
    ),
    (
        "torch layout in dot_product_attention",
        lambda: jattn.dot_product_attention(*_TORCH),
        ValueError,
        r"dot_product_attention takes jax\.nn's layout.*for torch's \(B, N, T, D\) call jattn\.attention",
    ),
    # 2: a mask constructor passed uncalled, or a plain function
    *(
        (
            f"uncalled on {impl}",
            lambda impl=impl: jattn.attention(_Q4, _K4, _K4, mask=masks.causal, implementation=impl),
            TypeError,
            _UNCALLED,
        )
        for impl in ("dense", "blockwise")
    ),
    ("uncalled, weights", lambda: jattn.attention_weights(_Q4, _K4, mask=masks.causal), TypeError, _UNCALLED),
    ("uncalled, choose", lambda: jattn.choose_implementation(_Q4, _K4, _K4, mask=masks.causal), TypeError, _UNCALLED),
    ("uncalled, flax", lambda: jattn.flax.attention_fn(*_JAX_NN, mask=masks.causal), TypeError, _UNCALLED),
    ("uncalled, module", lambda: _nnx()(X, masks.causal), TypeError, _UNCALLED),
    ("uncalled, decoding", lambda: _cached()(X, masks.causal, decode=True), TypeError, _UNCALLED),
    (
        "uncalled, linen",
        lambda: jattn.linen.SelfAttention(D).init(jax.random.key(0), X, masks.causal),
        TypeError,
        _UNCALLED,
    ),
    (
        "uncalled, ring",
        lambda: jattn.ring_attention(_Q4, _Q4, _Q4, axis_name="x", mask=masks.causal),
        TypeError,
        _UNCALLED,
    ),
    (
        "uncalled, sequence parallel",
        lambda: jattn.sequence_parallel_attention(_Q4, _Q4, _Q4, axis_name="x", mask=masks.causal),
        TypeError,
        _UNCALLED,
    ),
    (
        "uncalled with arguments",
        lambda: jattn.attention(_Q4, _K4, _K4, mask=masks.sliding_window),
        TypeError,
        r"got the function masks\.sliding_window: .*mask=masks\.sliding_window\(left\)",
    ),
    (
        "a plain function",
        lambda: jattn.attention(_Q4, _K4, _K4, mask=lambda b, h, i, j: i >= j),
        TypeError,
        r"mask must be .*got <function .*masks\.causal\(\).*mask=masks\.predicate\(fn\)",
    ),
    (
        "uncalled, jax.nn's signature",
        lambda: jattn.dot_product_attention(*_JAX_NN, mask=masks.causal),
        TypeError,
        _ARRAYS_ONLY,
    ),
    (
        "a predicate, jax.nn's signature",
        lambda: jattn.dot_product_attention(*_JAX_NN, mask=masks.causal()),
        TypeError,
        _ARRAYS_ONLY,
    ),
    # 3: torch's key padding (B, S), and 1-D masks reported as given
    (
        "key padding",
        lambda: jattn.attention(_Q4, _K4, _K4, mask=jnp.ones((2, 5), bool)),
        ValueError,
        _KEY_PADDING + r"mask\[:, None, None, :\] \(True = attend.*~mask",
    ),
    (
        "key padding, grouped",
        lambda: jattn.attention(_QG, _KG, _KG, mask=jnp.ones((2, 5), bool)),
        ValueError,
        _KEY_PADDING + r"mask\[:, None, None, None, :\]",
    ),
    (
        "key padding, jax.nn's signature",
        lambda: jattn.dot_product_attention(*_JAX_NN, mask=jnp.ones((2, 5), bool)),
        ValueError,
        r"mask of shape \(2, 5\) does not broadcast to \(B, N, T, S\).*mask\[:, None, None, :\].*"
        r"key_value_seq_lengths=lengths",
    ),
    (
        "key padding, module",
        lambda: _nnx()(X, jnp.ones((2, 3), bool)),
        ValueError,
        r"got shape \(2, 3\); a \(B, S\) key-padding mask goes as mask\[:, None, :\] \(B, 1, S\) or masks\.padding",
    ),
    *(
        (
            f"1-D mask on {impl}",
            lambda impl=impl: jattn.attention(_Q4, _K4, _K4, mask=jnp.ones(9, bool), implementation=impl),
            ValueError,
            r"mask of shape \(9,\) does not broadcast to \(\.\.\., T, S\) = \(\.\.\., 6, 5\)",
        )
        for impl in ("dense", "blockwise", "xla")
    ),
    ("1-D bias", lambda: jattn.attention(_Q4, _K4, _K4, bias=jnp.zeros(9)), ValueError, r"bias of shape \(9,\) does"),
    (
        "1-D mask, jax.nn's signature",
        lambda: jattn.dot_product_attention(*_JAX_NN, mask=jnp.ones(9, bool)),
        ValueError,
        r"mask of shape \(9,\) does not broadcast to \(B, N, T, S\)",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [b[1:] for b in NEWCOMER], ids=[b[0] for b in NEWCOMER])
def test_newcomer_mistakes_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_layouts_are_not_guessed_from_shapes():
    """Shapes cannot tell (B, N, T, D) from jax.nn's (B, T, N, H) (attention's docstring, "Layout"): none is refused.

    One token of 32 heads (decoding) and a 4-token prompt of 8 heads would be flagged by a rule "axis -3 larger
    than axis -2"; both are jattn's layout. jax.nn's arrays of the same shape go to dot_product_attention.
    """
    for q_shape, kv_shape in [((1, 32, 1, 16), (1, 32, 7, 16)), ((2, 8, 4, 16), (2, 8, 4, 16))]:
        q, k, v = _rand(q_shape, 40), _rand(kv_shape, 41), _rand(kv_shape, 42)
        want, _, _ = ref.attention(q, k, v)
        np.testing.assert_allclose(jax.jit(jattn.attention)(q, k, v), want, **ref.tol(jnp.float32))
    # the same (2, 8, 4, 16) as jax.nn's (B, T=8, N=4, H): the reference runs on it swapped to (B, N, T, H)
    want, _, _ = ref.attention(*(np.swapaxes(ref.f64(x), 1, 2) for x in (q, k, v)))
    got = jax.jit(jattn.dot_product_attention)(q, k, v)
    np.testing.assert_allclose(got, np.swapaxes(want, 1, 2), **ref.tol(jnp.float32))


def test_the_fixes_the_messages_name_are_right():
    """The grouped form, the key-padding expands and dot_product_attention compute what the caller meant."""
    q, k, v = _TORCH  # torch's grouped heads: query head n reads kv head n // G
    kr, vr = (np.repeat(ref.f64(x), 2, axis=1) for x in (k, v))
    keep = jnp.arange(5)[None] < jnp.array([[3], [5]])  # torch's key padding (B, S), True = attend here
    jax_nn = tuple(x.swapaxes(1, 2) for x in _TORCH)  # the same heads in jax.nn's (B, T, N, H)
    grouped = (None, keep[:, None, None, None, :], masks.padding(kv_lengths=jnp.array([3, 5])))
    expanded = (dict(mask=keep[:, None, None, :]), dict(key_value_seq_lengths=jnp.array([3, 5])))

    @jax.jit
    def run(q, k, v, jq, jk, jv):
        return (
            [
                jattn.attention(q.reshape(2, 2, 2, 6, 8), k[:, :, None], v[:, :, None], mask=m).reshape(q.shape)
                for m in grouped
            ],
            [jattn.dot_product_attention(jq, jk, jv, **kwargs) for kwargs in expanded],
        )

    got_grouped, got_expanded = run(q, k, v, *jax_nn)
    for mask, got in zip(grouped, got_grouped, strict=True):
        want, _, _ = ref.attention(q, kr, vr, mask=None if mask is None else np.asarray(keep)[:, None, None, :])
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
    want = np.swapaxes(ref.attention(q, kr, vr, mask=np.asarray(keep)[:, None, None, :])[0], 1, 2)
    for got in got_expanded:
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))


# -- options a kind cannot honour (issue #43 item 4): refused when the module is built -----------------

_OTHER_KINDS = ("linear", *jattn.RECURRENT_KINDS)  # the kinds that form no attention scores
REFUSED = [  # (kind, option, value, the kind the message names as taking it)
    ("linear", "dropout_rate", 0.5, "softmax"),
    ("linear", "sequence_axis", "seq", "softmax"),  # ring attention is softmax's
    *((kind, "implementation", "dense", "softmax") for kind in _OTHER_KINDS),
    *((kind, "block_size", 8, "softmax") for kind in _OTHER_KINDS),
    ("softmax", "feature_map", "relu", "linear"),
    ("gla", "feature_map", "relu", "linear"),
]


@pytest.mark.parametrize(("kind", "option", "value", "taker"), REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_options_a_kind_cannot_honour_are_refused_when_built(kind, option, value, taker):
    """Accepted and then ignored before: linear attention trained with dropout_rate=0.5 without dropout."""
    named = rf"(?=.*kind='{kind}')(?=.*kind='{taker}')(?=.*{re.escape(f'{option}={value!r}')})"  # kind, option, path
    with pytest.raises(ValueError, match=named):
        _nnx(kind=kind, **{option: value})
    with pytest.raises(ValueError, match=named):
        _linen(kind=kind, **{option: value})


@pytest.mark.parametrize("kind", _OTHER_KINDS)
def test_a_call_choosing_a_path_for_a_kind_without_one_is_refused(kind):
    """The public call refuses before any computing; the Linen weights are the NNX module's (no init pass needed)."""
    m = _nnx(kind=kind)
    params = {"params": ref.linen_params(m)}
    lin = jattn.linen.SelfAttention(D, num_heads=2, kind=kind)
    for option, value in (("implementation", "blockwise"), ("block_size", (4, 4))):
        named = rf"(?=.*kind='{kind}')(?=.*kind='softmax')(?=.*{re.escape(f'{option}={value!r}')})"
        with pytest.raises(ValueError, match=named):
            m(X, **{option: value})
        with pytest.raises(ValueError, match=named):
            lin.apply(params, X, **{option: value})


@pytest.mark.parametrize("kind", jattn.RECURRENT_KINDS)
def test_cross_attention_refuses_a_recurrent_kind_when_built(kind):
    """Before, CrossAttention(kind='gla') built its gate parameters and failed only when called."""
    named = rf"kind='{kind}' is causal self-attention.*CrossAttention takes kind 'softmax' or 'linear'"
    with pytest.raises(ValueError, match=named):
        _cross(kind=kind)
    lin = jattn.linen.CrossAttention(D, num_heads=2, kind=kind, context_features=5)
    with pytest.raises(ValueError, match=named):
        lin.init(jax.random.key(0), X, jnp.ones((2, 4, 5)))


def test_positional_padding_lengths_are_refused_by_name():
    """``masks.padding(lengths)`` positionally meant query lengths; the common call is key padding."""
    with pytest.raises(TypeError, match=r"pass kv_lengths=\.\.\. \(key padding.* or q_lengths=\.\.\. \(query padding"):
        masks.padding(jnp.array([2, 3]))
    with pytest.raises(TypeError, match=r"kv_lengths=\.\.\..*got 2 positional"):
        masks.padding([2, 3], [1, 1])
