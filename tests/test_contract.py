"""One contract on every path (issue #10) and low precision under jit (issue #11).

Regression tests for four defects found with peers' test cases, the argument x implementation
table (``jattn.SUPPORT``) cell by cell, and a differential fuzz: every implementation that takes a
random case agrees with the float64 reference (values and gradients), every one that refuses it
raises the documented ``ValueError``. ``pytest --slow`` runs the fuzz with 5,000 cases.
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

import jattn
from jattn import masks
from jattn._checks import KernelRefusalError
from tests import reference as ref

FUZZ_EXAMPLES = int(os.environ.get("JATTN_FUZZ_EXAMPLES", 5000 if os.environ.get("JATTN_SLOW") else 200))
FUZZ_SHARDS = 4  # separate test items: make fuzz runs them on both cores
FUZZ_SEED = int(os.environ.get("JATTN_FUZZ_SEED", 0))  # shard i uses seed i + this: a long run goes in chunks


def _loss(impl, g, **kw):
    def f(*args):
        out = jattn.attention(*args[:3], bias=args[3] if len(args) > 3 else None, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * g)

    return f


def _jax_nn(q, k, v, bias=None):  # (B, N, T, D) -> jax.nn's (B, T, N, D) and back
    def tr(x):
        return jnp.swapaxes(x, 1, 2)

    with jax.numpy_dtype_promotion("standard"):
        return tr(jax.nn.dot_product_attention(tr(q), tr(k), tr(v), bias=bias))


# -- (1) bfloat16 gradients ---------------------------------------------------------------------


def test_bf16_gradients_no_worse_than_jax_nn():
    """q = k = v = x (1, 4, 128, 32) with a bias, bfloat16, against float64: dense, blockwise and jax.nn."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 4, 128, 32)), jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=(1, 4, 128, 128)), jnp.bfloat16)
    g = jnp.ones((1, 4, 128, 32), jnp.float32)
    want_dx = sum(ref.attention_grads(x, x, x, g, bias=ref.f64(bias))[:3])
    want_db = ref.attention_grads(x, x, x, g, bias=ref.f64(bias))[3]
    want_dx_nobias = sum(ref.attention_grads(x, x, x, g)[:3])

    def err(a, b):
        return float(np.max(np.abs(ref.f64(a) - b)))

    def grads(f, *args):
        return jax.jit(jax.grad(lambda x, *b: jnp.sum(f(x, x, x, *b).astype(jnp.float32) * g), argnums=(0, 1)))(*args)

    def ours(impl):
        return lambda q, k, v, b=None: jattn.attention(q, k, v, bias=b, implementation=impl)

    with jax.numpy_dtype_promotion("standard"):  # jax.nn's own backward promotes bf16 with f32 implicitly
        nn_dx, nn_db = grads(_jax_nn, x, bias)
        nn_dx_nobias = jax.jit(jax.grad(lambda x: jnp.sum(_jax_nn(x, x, x).astype(jnp.float32) * g)))(x)
    dx, db = grads(ours("dense"), x, bias)
    assert err(dx, want_dx) <= err(nn_dx, want_dx) and err(db, want_db) <= err(nn_db, want_db)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(ours("blockwise")(x, x, x).astype(jnp.float32) * g)))(x)
    assert err(dx, want_dx_nobias) <= err(nn_dx_nobias, want_dx_nobias)


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_a_row_that_sees_one_key_has_zero_query_gradient(impl):
    """Its softmax is exactly one-hot: p (dp - rowsum(p dp)) = 0, whatever the rounding of dp."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.bfloat16) for _ in range(3))
    mask = np.ones((9, 9), bool)
    mask[3] = False
    mask[3, 5] = True
    g = jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.float32)
    dq = jax.jit(jax.grad(_loss(impl, g, mask=mask)))(q, k, v)
    assert np.all(np.asarray(dq[:, 3], np.float32) == 0)


# -- (2) the jax.nn hand-over honours or refuses ------------------------------------------------


@pytest.mark.parametrize("q_offset", [-2, 0, 3, None])
@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(2, 1), masks.causal() & masks.sliding_window(3)])
def test_xla_takes_offsets_through_jax_nn_arguments(mask, q_offset):
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(2, n, 6)), jnp.float32) for n in (7, 11, 11))
    got = jax.jit(lambda q, k, v: jattn.attention(q, k, v, mask=mask, q_offset=q_offset, implementation="xla"))(q, k, v)
    dense = np.asarray(mask.dense(7, 11, q_offset=q_offset))
    np.testing.assert_allclose(got, ref.attention(q, k, v, dense)[0], **ref.tol(jnp.float32))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_padding_lengths_lie_on_the_batch_axis_of_q(impl):
    # q (3, T, D) against k, v (1, 3, S, D): the call's leading shape is (1, 3) and the per-example
    # batch is q's first axis, the last leading one (found by the slow fuzz: xla and pallas put it first).
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 5, 4)), rng.normal(size=(1, 3, 7, 4)), rng.normal(size=(1, 3, 7, 4))
    pad = masks.padding(q_lengths=jnp.array([1, 5, 3]), kv_lengths=jnp.array([7, 2, 4]))
    dense = np.asarray(pad.dense(5, 7)).reshape(3, 5, 7)  # batch first, broadcasting like q
    want = ref.attention(q, k, v, dense)[0]
    got = jax.jit(lambda *a: jattn.attention(*a, mask=pad, implementation=impl))(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v))
    )
    np.testing.assert_allclose(ref.f64(got), want, **ref.tol(jnp.float32))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_padding_batch_broadcasts_against_a_unit_batch(impl):
    # q, k, v (1, 3, T, D) with lengths (2,): the call's leading shape is (2, 3), as on the dense path
    # (xla flattened q to 3 rows and the lengths to 6).
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 3, 5, 4)), rng.normal(size=(1, 3, 7, 4)), rng.normal(size=(1, 3, 7, 4))
    pad = masks.padding(q_lengths=jnp.array([2, 5]), kv_lengths=jnp.array([7, 3]))
    dense = np.asarray(pad.dense(5, 7)).reshape(2, 1, 5, 7)
    want = ref.attention(q, k, v, dense)[0]
    got = jax.jit(lambda *a: jattn.attention(*a, mask=pad, implementation=impl))(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v))
    )
    assert got.shape == want.shape == (2, 3, 5, 4)
    np.testing.assert_allclose(ref.f64(got), want, **ref.tol(jnp.float32))


def test_xla_refuses_what_jax_nn_cannot_do():
    q = jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match="'xla' cannot take dropout_rate"):
        jattn.attention(q, q, q, dropout_rate=0.5, dropout_rng=jax.random.key(0), implementation="xla")
    with jax.enable_x64(True), pytest.raises(ValueError, match="'xla' cannot take float64"):
        jattn.attention(*(jnp.ones((2, 5, 4), jnp.float64),) * 3, implementation="xla")


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla", None])
def test_an_array_mask_with_offsets_is_refused_on_every_path(impl):
    q = jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match="q_offset and kv_offset place"):
        jattn.attention(q, q, q, mask=np.ones((5, 5), bool), q_offset=1, implementation=impl)


# -- (3) 1-D masks and biases broadcast like NumPy -----------------------------------------------


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla"])
def test_one_dimensional_mask_and_bias_broadcast_like_numpy(impl):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(3, n, 5)), jnp.float32) for n in (4, 7, 7))
    keys = np.array([True, False, True, True, False, True, True])
    bias = rng.normal(size=(7,)).astype(np.float32)
    kw = {} if impl == "blockwise" else {"bias": bias}
    got = jax.jit(lambda q, k, v: jattn.attention(q, k, v, mask=keys, implementation=impl, **kw))(q, k, v)
    want = ref.attention(q, k, v, np.broadcast_to(keys, (4, 7)), None if impl == "blockwise" else bias)[0]
    np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))


# -- (4) array masks are masks ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["dense", "blockwise", "xla"])
@pytest.mark.parametrize("op", ["and", "or", "not"])
def test_array_masks_combine_with_predicates(impl, op):
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, n, 5)), jnp.float32) for n in (9, 13, 13))
    arr = rng.random((2, 1, 9, 13)) < 0.5
    arr[:, :, 4] = False  # rows masked by the array
    pred = masks.causal()
    mask = {"and": arr & pred, "or": pred | arr, "not": ~masks.array(arr) & pred}[op]
    dense_pred = np.asarray(pred.dense(9, 13))
    want_mask = {"and": arr & dense_pred, "or": arr | dense_pred, "not": ~arr & dense_pred}[op]
    kw = {"block_size": (4, 3)} if impl == "blockwise" else {}
    g = jnp.asarray(rng.normal(size=(2, 3, 9, 5)), jnp.float32)

    @jax.jit  # one program: the values and the gradients
    def call(q, k, v):
        out = jattn.attention(q, k, v, mask=mask, implementation=impl, **kw)
        return out, jax.grad(_loss(impl, g, mask=mask, **kw), argnums=(0, 1, 2))(q, k, v)

    got, grads = call(q, k, v)
    np.testing.assert_allclose(got, ref.attention(q, k, v, want_mask)[0], **ref.tol(jnp.float32))
    for a, b in zip(grads, ref.attention_grads(q, k, v, g, want_mask)[:3], strict=True):
        ref.assert_grad_close(a, b, jnp.float32)


def test_array_masks_keep_the_blockwise_path_and_their_tiles_are_classified_on_device():
    big = jnp.zeros((1, 1024, 8))
    arr = np.zeros((1024, 1024), bool)
    arr[:, :100] = True
    assert jattn.choose_implementation(big, big, big, mask=arr & masks.causal()) == "blockwise"
    rng = np.random.default_rng(5)
    arr = rng.random((2, 11, 13)) < 0.3
    arr[:, :4, :6] = False  # an all-False tile of both examples
    arr[:, 4:8, 6:9] = True  # an all-True one
    mask = masks.sliding_window(6, 6) & arr
    kinds = jax.jit(lambda a: masks.tile_kinds(mask & a, 11, 13, 4, 3, q_offset=2, kv_offset=0))(arr)
    dense = np.asarray((masks.sliding_window(6, 6) & arr).dense(11, 13)).reshape(-1, 11, 13)
    for i in range(3):
        for j in range(5):
            tile = dense[:, 4 * i : 4 * i + 4, 3 * j : 3 * j + 3]
            want = masks.EMPTY if not tile.any() else masks.FULL if tile.all() else masks.PARTIAL
            assert kinds[i, j] == want, (i, j)


# -- the argument x implementation table -----------------------------------------------------------


def _row_call(row):
    """Arguments that use one row of jattn.SUPPORT, and the explicit mask they mean."""
    rng = np.random.default_rng(6)
    lengths = np.array([3, 6])
    causal = np.asarray(masks.causal().dense(6, 6))
    calls = {
        "mask (array, any leading dims, 1-D)": (dict(mask=rng.random((2, 1, 6, 6)) < 0.6), None),
        "mask (position predicate)": (dict(mask=masks.causal()), causal),
        "mask (per-example predicate: padding, segment_ids)": (
            dict(mask=masks.padding(kv_lengths=lengths)),
            (np.arange(6) < lengths[:, None])[:, None, None, :],
        ),
        "mask (predicate of batch and head: masks.predicate)": (
            dict(mask=masks.predicate(lambda b, h, i, j: (i + b + h) % 3 != j % 3)),
            (np.arange(6)[:, None] + np.arange(2)[:, None, None, None] + np.arange(3)[:, None, None]) % 3
            != np.arange(6) % 3,
        ),
        "q_offset / kv_offset (static ints)": (
            dict(mask=masks.causal(), q_offset=2),
            masks.causal().dense(6, 6, q_offset=2),
        ),
        "q_offset / kv_offset (arrays, per example)": (
            dict(mask=masks.causal(), q_offset=jnp.array([0, 2])),
            masks.causal().dense(6, 6, q_offset=jnp.array([0, 2])).reshape(2, 1, 6, 6),
        ),
        "bias": (dict(bias=rng.normal(size=(6, 6)).astype(np.float32)), None),
        "dropout_rate": (dict(dropout_rate=0.3, dropout_rng=jax.random.key(1)), None),
        "precision": (dict(precision="highest"), None),
        "return_lse": (dict(return_lse=True), None),
        "return_max_logit": (dict(return_max_logit=True), None),
        "score_mod": (dict(score_mod=jattn.score_mods.softcap(0.5)), None),
        "sinks": (dict(sinks=np.array([0.5, -1.0, 2.0], np.float32)), None),
        "block_size": (dict(block_size=(4, 3)), None),
        "float64 inputs": ({}, None),
        "value depth E != D": ({}, None),
    }
    kw, dense = calls[row]
    if "mask" in kw and dense is None:
        dense = kw["mask"]
    return kw, dense


@pytest.mark.parametrize("row", list(jattn.SUPPORT))
@pytest.mark.parametrize("impl", jattn.IMPLEMENTATIONS)
def test_every_cell_of_the_support_table(row, impl):
    """A "yes" cell matches the float64 reference; a "no" cell raises naming the argument and the path."""
    cell = jattn.SUPPORT[row][impl]
    x64 = row == "float64 inputs"
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        rng = np.random.default_rng(7)
        q, k = (jnp.asarray(rng.normal(size=(2, 3, 6, 5)), dtype) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(2, 3, 6, 4 if row == "value depth E != D" else 5)), dtype)
        kw, dense = _row_call(row)
        if cell.startswith("no"):
            with pytest.raises(ValueError, match=f"implementation='{impl}' cannot take {row.split(' (')[0]}"):
                jattn.attention(q, k, v, implementation=impl, **kw)
            return
        if impl == "cudnn":
            pytest.skip("cuDNN needs an NVIDIA GPU; its translations are tested by their refusals and on 'xla'")
        try:  # one program (a refusal is raised while tracing)
            got = jax.jit(lambda q, k, v: jattn.attention(q, k, v, implementation=impl, **kw))(q, k, v)
        except KernelRefusalError as err:  # "partly": this platform's kernel refuses this call, naming the row
            assert cell.startswith("partly") and f"implementation='{impl}' cannot take {row.split(' (')[0]}" in str(err)
            return
        out = got[0] if kw.get("return_lse") or kw.get("return_max_logit") else got
        bias = kw.get("bias")
        extra = dict(  # the reference's own softcap and sinks
            score_mod=(lambda s, *_: 0.5 * np.tanh(s / 0.5)) if "score_mod" in kw else None, sinks=kw.get("sinks")
        )
        want, _, want_lse, want_top = ref.attention(
            q, k, v, None if dense is None else np.asarray(dense), bias, stats=True, **extra
        )
        if row == "dropout_rate":  # unbiased: dropout averages out over many draws
            draws = jax.jit(
                jax.vmap(lambda key: jattn.attention(q, k, v, implementation=impl, dropout_rate=0.3, dropout_rng=key))
            )(jax.random.split(jax.random.key(2), 2000))
            np.testing.assert_allclose(np.mean(np.asarray(draws), 0), want, atol=0.08)
            return
        np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
        if kw.get("return_lse"):
            np.testing.assert_allclose(ref.f64(got[1]), want_lse, **ref.tol(dtype))
        if kw.get("return_max_logit"):
            np.testing.assert_allclose(ref.f64(got[1]), want_top, **ref.tol(dtype))


def test_automatic_choice_honours_everything():
    """implementation=None never refuses: for every row, the chosen path's cell is "yes"."""
    q = jnp.zeros((2, 3, 6, 5))
    for row in jattn.SUPPORT:
        if row in ("float64 inputs", "value depth E != D"):
            continue
        kw, _ = _row_call(row)
        kw = {n: a for n, a in kw.items() if n != "dropout_rng"}
        chosen = jattn.choose_implementation(q, q, q, **kw)
        assert jattn.SUPPORT[row][chosen] == "yes", (row, chosen)


# -- differential fuzz -------------------------------------------------------------------------------

PREDICATES = [
    masks.causal(),
    masks.sliding_window(2, 1),
    masks.sliding_window(3) | masks.global_tokens([0]),
    masks.chunked(3),
    masks.prefix_lm(2),
    masks.causal() & ~masks.chunked(4),  # fully masked rows
]


@st.composite
def fuzz_cases(draw):
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64]))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    t, s, d = (draw(st.integers(1, 9)) for _ in range(3))
    e = d if draw(st.booleans()) else draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def dims():  # each operand keeps a leading dim or broadcasts it from 1, or drops leading dims
        kept = [n if draw(st.booleans()) else 1 for n in lead]
        return kept[draw(st.integers(0, len(kept))) :]

    q, k, v = rng.normal(size=(*dims(), t, d)), rng.normal(size=(*dims(), s, d)), rng.normal(size=(*dims(), s, e))
    kind = draw(st.sampled_from(["none", "array", "1d", "predicate", "predicate&array", "per-example"]))
    pred = draw(st.sampled_from(PREDICATES))
    arr = rng.random((*dims(), t, s)) < draw(st.sampled_from([0.3, 0.7]))
    if arr.ndim and draw(st.booleans()):
        arr[..., rng.integers(t), :] = False  # a row the array masks entirely
    if kind == "per-example" and q.ndim < 3:
        kind = "predicate"  # a per-example mask reads q's first axis as the batch
    mask = {
        "none": None,
        "array": arr,
        "1d": rng.random(s) < 0.7,
        "predicate": pred,
        "predicate&array": pred & arr,
        "per-example": None,
    }[kind]
    if kind == "per-example":  # packed documents (unsorted ids: some rows see no key) or padding, per example
        b = draw(st.sampled_from([q.shape[0], lead[len(lead) - (q.ndim - 2)]]))  # q's batch, or broadcast from 1
        if draw(st.booleans()):
            per = masks.segment_ids(rng.integers(0, 3, size=(b, t)), rng.integers(0, 3, size=(b, s)))
        else:
            per = masks.padding(q_lengths=rng.integers(0, t + 2, size=b), kv_lengths=rng.integers(0, s + 2, size=b))
        mask = per & pred if draw(st.booleans()) else per
    q_offset = None
    if kind.startswith("predicate") and kind == "predicate" and draw(st.booleans()):
        q_offset = s - t + draw(st.integers(-3, 3))
    bias = None
    if draw(st.booleans()):
        bias = rng.normal(size=(s,) if draw(st.booleans()) else (*dims(), t, s))
    scale = draw(st.sampled_from([None, 0.3]))
    blocks = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    shaped = (q, k, v, bias, arr if kind in ("array", "predicate&array") else None)
    full = np.broadcast_shapes(*(x.shape[:-2] for x in shaped if x is not None))  # the call's leading dims
    sinks = (
        rng.normal(size=tuple(n if draw(st.booleans()) else 1 for n in full)) if draw(st.integers(0, 2)) == 0 else None
    )
    softcap = draw(st.sampled_from([None, None, 1.5]))
    return dtype, q, k, v, mask, q_offset, bias, scale, blocks, sinks, softcap


def _explicit_mask(mask, t, s, q_offset, ndim):
    """The mask as a boolean array broadcasting against q of rank ``ndim`` (a per-example one: batch first)."""
    if mask is None or isinstance(mask, np.ndarray):
        return mask
    dense = np.asarray(mask.dense(t, s, q_offset=q_offset))
    return dense.reshape(dense.shape[0], *(1,) * (ndim - 3), t, s) if mask.per_example else dense


def _expect_refusal(impl, dtype, mask, bias, q_offset, d, e, sinks=None, softcap=None):
    """Whether the table says ``impl`` refuses this case ("partly" cells may go either way)."""
    rows = []
    if mask is not None and not isinstance(mask, np.ndarray):
        rows.append(
            "mask (per-example predicate: padding, segment_ids)" if mask.per_example else "mask (position predicate)"
        )
    if isinstance(mask, np.ndarray) or (mask is not None and mask.has_arrays):
        rows.append("mask (array, any leading dims, 1-D)")
    if bias is not None:
        rows.append("bias")
    if sinks is not None:
        rows.append("sinks")
    if softcap is not None:
        rows.append("score_mod")
    if q_offset is not None:
        rows.append("q_offset / kv_offset (static ints)")
    if dtype == jnp.float64:
        rows.append("float64 inputs")
    if d != e:
        rows.append("value depth E != D")
    cells = [jattn.SUPPORT[r][impl] for r in rows]
    return any(c.startswith("no") for c in cells), any(c.startswith("partly") for c in cells)


@pytest.mark.heavy
@pytest.mark.long
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_differential_fuzz(shard):
    """FUZZ_EXAMPLES cases in all (200; 5,000 with ``--slow``), each shard its own fixed seed.

    Each path is compiled once a case, values and gradients together (an eager call compiles
    every operation on its own: 4x slower). JATTN_FUZZ_LOG=file appends progress counts;
    JATTN_FUZZ_EXAMPLES=n with JATTN_FUZZ_SEED=4, 8, ... runs a long search in chunks of new cases.
    """
    counts = collections.Counter()
    log = os.environ.get("JATTN_FUZZ_LOG")

    phases = [Phase.explicit, Phase.generate] + ([] if os.environ.get("JATTN_SLOW") else [Phase.shrink])

    @seed(shard + FUZZ_SEED)  # derandomised: a fixed seed per shard (the profile's own seed is one per function)
    @settings(max_examples=FUZZ_EXAMPLES // FUZZ_SHARDS, phases=phases)  # a slow run reports, not shrinks
    @given(fuzz_cases())
    def run(case):
        dtype, q, k, v, mask, q_offset, bias, scale, blocks, sinks, softcap = case
        with jax.enable_x64(dtype == jnp.float64):
            operands = dict(q=q, k=k, v=v, bias=bias, sinks=sinks)
            args = {name: jnp.asarray(x, dtype) for name, x in operands.items() if x is not None}
            q, k, v = args["q"], args["k"], args["v"]
            t, s = q.shape[-2], k.shape[-2]
            dense = _explicit_mask(mask, t, s, q_offset, q.ndim)
            f64 = {name: ref.f64(x) for name, x in args.items()}
            cap = None if softcap is None else (lambda x, *_: softcap * np.tanh(x / softcap))
            want, _, _ = ref.attention(
                q, k, v, dense, f64.get("bias"), scale, score_mod=cap, sinks=f64.get("sinks"), q_offset=q_offset
            )
            g = np.random.default_rng(0).normal(size=want.shape)
            dq, dk, dv, dbias, *dsinks = ref.attention_grads(
                q, k, v, g, dense, f64.get("bias"), scale, sinks=f64.get("sinks"), softcap=softcap
            )
            want_grads = dict(q=dq, k=dk, v=dv, bias=dbias, sinks=dsinks[0] if dsinks else None)
            counts["cases"] += 1
            for impl in jattn.IMPLEMENTATIONS:
                if impl == "xla" and dtype == jnp.float16:
                    continue  # XLA:CPU has no float16 dot with float32 results (jax.nn's own limit on CPU)
                if impl == "xla" and dtype == jnp.bfloat16 and sorted((t, s, q.shape[-1]))[1] == 1:
                    continue  # jax.nn under jit on XLA:CPU: "Algorithm not supported ...: ALG_DOT_BF16_BF16_F32"
                kw = dict(mask=mask, q_offset=q_offset, scale=scale, implementation=impl)
                if softcap is not None:
                    kw["score_mod"] = jattn.score_mods.softcap(softcap)
                if impl == "blockwise":
                    kw["block_size"] = blocks
                refuse, partly = _expect_refusal(
                    impl, dtype, mask, bias, q_offset, q.shape[-1], v.shape[-1], sinks, softcap
                )
                if refuse or partly or impl == "cudnn":
                    if impl == "cudnn" and not (refuse or partly):
                        continue  # cuDNN would take it, but needs a GPU
                    try:  # refusals happen while tracing: no compile needed to see one
                        jax.eval_shape(lambda a, kw=kw: jattn.attention(**a, **kw), args)
                    except ValueError as err:
                        assert f"implementation='{impl}'" in str(err)
                        counts["refused"] += 1
                        continue
                    except RuntimeError as err:  # jattn took it: jax.nn looks for cuDNN while tracing
                        assert impl == "cudnn" and "cuDNN" in str(err), err
                    assert not refuse, f"{impl} took a case the table says it refuses"
                    if impl == "cudnn":
                        continue
                if impl == "pallas" and not os.environ.get("JATTN_SLOW"):
                    counts["taken by pallas"] += 1  # it traced; interpret mode is too slow to run in CI
                    continue

                def loss(a, kw=kw):
                    out = jattn.attention(**a, **kw)
                    return jnp.sum(out.astype(jnp.float32 if dtype != jnp.float64 else dtype) * g), out

                # jax.nn's own backward promotes bf16/f16 with f32 implicitly: it needs standard promotion.
                promotion = "standard" if impl == "xla" and dtype in (jnp.bfloat16, jnp.float16) else "strict"
                with jax.numpy_dtype_promotion(promotion):  # one compile a path: values and gradients together
                    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(args)
                counts["nan"] += int(np.isnan(ref.f64(out)).any() != np.isnan(want).any())
                np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))
                for name, got in grads.items():
                    counts["nan"] += int(np.isnan(ref.f64(got)).any())
                    ref.assert_grad_close(got, want_grads[name], dtype)
                counts[f"compared {impl}"] += 1
        if log and counts["cases"] % 100 == 0:
            with open(log, "a") as f:
                print(f"shard {shard}: {dict(counts)}", file=f)

    run()
    print(f"shard {shard}: {dict(counts)}")
    if log:
        with open(log, "a") as f:
            print(f"shard {shard} done: {dict(counts)}", file=f)
    assert counts["nan"] == 0
    assert counts["compared dense"] == counts["cases"] and counts["refused"] > 0
    if counts["cases"] >= 40:  # enough cases that every path meets some it takes
        assert counts["compared blockwise"] > 0 and counts["compared xla"] > 0  # pallas takes few: tests/test_pallas.py


# -- low precision under jit (issue #11) ---------------------------------------------------------------


@pytest.mark.long
@settings(max_examples=12)
@given(
    st.sampled_from([jnp.float16, jnp.bfloat16]),
    st.sampled_from(["dense", "blockwise"]),
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(0, 2**32 - 1),
)
def test_low_precision_under_jit_matches_eager_and_float32(dtype, impl, t, s, d, seed):
    """N(0,1) clipped to ±3, times a large share of the dtype's range: jit == eager == float32 of the rounded inputs."""
    rng = np.random.default_rng(seed)
    big = 1e4 if dtype == jnp.float16 else 1e17  # logits stay inside the float32 range
    q, k, v = (jnp.asarray(np.clip(rng.normal(size=(2, n, d)), -3, 3) * big, dtype) for n in (t, s, s))
    g = jnp.asarray(rng.normal(size=(2, t, d)), jnp.float32)

    def f(q, k, v):
        return jattn.attention(q, k, v, implementation=impl)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * g)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = f(*f32)
    for out in (f(q, k, v), jax.jit(f)(q, k, v)):
        np.testing.assert_allclose(
            ref.f64(out), ref.f64(want), rtol=ref.tol(dtype)["rtol"], atol=ref.tol(dtype)["atol"] * big
        )
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*f32)
    noise = float(np.max(np.abs(g)) * 3 * big * 3 * big * s / np.sqrt(d))  # |dO|·|v|·|k|·scale·S
    for grads in (jax.grad(loss, argnums=(0, 1, 2))(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)):
        for got, exp in zip(grads, want_grads, strict=True):
            if np.max(np.abs(exp)) < float(jnp.finfo(dtype).max):
                assert np.all(np.isfinite(ref.f64(got)))
                ref.assert_grad_close(got, exp, dtype, scale=noise)


def test_readme_table_is_the_support_table():
    from pathlib import Path

    head = "| argument | " + " | ".join(f"`{p}`" for p in jattn.IMPLEMENTATIONS) + " |"
    rows = [head, "|---|" + "---|" * len(jattn.IMPLEMENTATIONS)]
    rows += [f"| {r} | " + " | ".join(c[p] for p in jattn.IMPLEMENTATIONS) + " |" for r, c in jattn.SUPPORT.items()]
    assert "\n".join(rows) in (Path(__file__).parent.parent / "README.md").read_text()
