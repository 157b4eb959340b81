"""Ring attention on 2, 4 and 8 simulated devices against the float64 reference and the dense core."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import jattn
from jattn import masks
from tests import reference as ref

POSITION_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(5, 2),
    "global_window": masks.causal() & (masks.sliding_window(3) | masks.global_tokens([1, 13])),
}


def _mesh(p: int) -> jax.sharding.Mesh:
    return jax.make_mesh((p,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])


def _ring_fn(p: int, layout: str, **options):
    """Global ``(q, k, v[, q_seg, kv_seg]) -> out`` through ring attention on p devices."""
    mesh = _mesh(p)

    def lay(x, axis=-2):
        return jattn.zigzag(x, p, axis) if layout == "zigzag" else x

    def unlay(x):
        return jattn.unzigzag(x, p) if layout == "zigzag" else x

    def fn(q, k, v, segments=None):
        seq = PartitionSpec(*(None,) * (q.ndim - 2), "s", None)
        args, specs = [lay(q), lay(k), lay(v)], [seq, seq, seq]
        if segments is not None:
            args += [lay(s, -1) for s in segments]
            specs += [PartitionSpec(None, "s")] * 2

        def local(q, k, v, *seg):
            return jattn.ring_attention(
                q, k, v, axis_name="s", layout=layout, segment_ids=tuple(seg) if seg else None, **options
            )

        out = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=seq)(*args)
        return unlay(out)

    return jax.jit(fn)


def _qkv(rng, b, n, t, s, dtype=jnp.float64):
    def draw(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return draw(b, n, t, 5), draw(b, n, s, 5), draw(b, n, s, 7)


def _grads(fn, q, k, v):
    cot = jnp.asarray(np.random.default_rng(9).normal(size=(*q.shape[:-1], v.shape[-1])), q.dtype)
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.long
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_equals_dense_forward_and_gradients(p, layout):
    with jax.enable_x64(True):
        q, k, v = _qkv(np.random.default_rng(p), 2, 3, 4 * p, 4 * p)
        for name, mask in POSITION_MASKS.items():
            ring = _ring_fn(p, layout, mask=mask)
            dense = 4 * p
            want, _, _ = ref.attention(q, k, v, mask=None if mask is None else mask.dense(dense, dense))
            np.testing.assert_allclose(ring(q, k, v), want, **ref.tol(jnp.float64), err_msg=name)
            got = _grads(ring, q, k, v)
            exp = _grads(lambda q, k, v, m=mask: jattn.attention(q, k, v, mask=m), q, k, v)
            for g, e in zip(got, exp, strict=True):
                np.testing.assert_allclose(g, e, **ref.tol(jnp.float64), err_msg=name)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_segments_and_fully_masked_rows(layout):
    """Packed sequences across device borders; a query whose segment has no keys gives 0 and zero grads."""
    p, t = 4, 6
    with jax.enable_x64(True):
        q, k, v = _qkv(np.random.default_rng(1), 2, 3, p * t, p * t)
        q_seg = np.repeat(np.array([[0, 1, 2, 3], [5, 5, 6, 7]]), t, axis=1)  # (2, 24): segments cross borders
        q_seg[:, 3:9] = [[1, 1, 1, 1, 1, 1], [5, 6, 6, 6, 6, 6]]
        kv_seg = q_seg.copy()
        q_seg[0, 20:] = 99  # no key carries 99: these rows are fully masked
        segments = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
        ring = _ring_fn(p, layout, mask=masks.causal())
        allowed = (q_seg[:, None, :, None] == kv_seg[:, None, None, :]) & np.tril(np.ones((24, 24), bool))
        want, _, _ = ref.attention(q, k, v, mask=allowed)
        got = ring(q, k, v, segments)
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))
        assert np.all(np.asarray(got)[0, :, 20:] == 0)
        dq, dk, dv = _grads(lambda q, k, v: ring(q, k, v, segments), q, k, v)
        eq, ek, ev = _grads(lambda q, k, v: jattn.attention(q, k, v, mask=jnp.asarray(allowed)), q, k, v)
        assert np.all(np.asarray(dq)[0, :, 20:] == 0)
        for g, e in ((dq, eq), (dk, ek), (dv, ev)):
            np.testing.assert_allclose(g, e, **ref.tol(jnp.float64))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_lse_has_the_dense_gradient_and_the_max_logit_none(layout):
    """The lse's cotangent (with sinks, and on rows that see no key) reaches q, k, v and sinks as on the dense path."""
    p = 4
    with jax.enable_x64(True):
        q, k, v = _qkv(np.random.default_rng(4), 2, 3, 4 * p, 4 * p)
        q_seg = np.zeros((2, 4 * p), np.int32)
        q_seg[0, 5:9] = 7  # no key carries 7: these rows see nothing
        seg = (jnp.asarray(q_seg), jnp.zeros((2, 4 * p), jnp.int32))
        sinks = jnp.array([0.5, -1.0, 2.0])
        seq, rows = PartitionSpec(None, None, "s", None), PartitionSpec(None, None, "s")

        def lay(x, axis=-2):
            return jattn.zigzag(x, p, axis) if layout == "zigzag" else x

        def ring(q, k, v, sinks):
            def local(q, k, v, sinks, qs, ks):
                return jattn.ring_attention(
                    q, k, v, axis_name="s", layout=layout, mask=masks.causal(), segment_ids=(qs, ks), sinks=sinks,
                    return_lse=True, return_max_logit=True,
                )  # fmt: skip

            specs = (seq, seq, seq, PartitionSpec(), PartitionSpec(None, "s"), PartitionSpec(None, "s"))
            out = jax.shard_map(local, mesh=_mesh(p), in_specs=specs, out_specs=(seq, rows, rows))(
                lay(q), lay(k), lay(v), sinks, *(lay(x, -1) for x in seg)
            )
            return (
                out
                if layout == "contiguous"
                else (jattn.unzigzag(out[0], p), *(jattn.unzigzag(x, p, -1) for x in out[1:]))
            )

        def dense(q, k, v, sinks):
            mask = masks.causal() & masks.segment_ids(*seg)
            return jattn.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, return_max_logit=True)

        rng = np.random.default_rng(5)
        outs, pull = jax.vjp(jax.jit(ring), q, k, v, sinks)
        want_outs, want_pull = jax.vjp(dense, q, k, v, sinks)
        for a, b in zip(outs, want_outs, strict=True):
            np.testing.assert_allclose(a, b, **ref.tol(jnp.float64))
        cots = [jnp.asarray(rng.normal(size=x.shape)) for x in outs]
        for cot in ((cots[0], cots[1], 0 * cots[2]), (0 * cots[0], cots[1], 0 * cots[2])):
            for g, e in zip(pull(cot), want_pull(cot), strict=True):
                np.testing.assert_allclose(g, e, **ref.tol(jnp.float64))
        assert all(not np.any(np.asarray(g)) for g in pull((0 * cots[0], 0 * cots[1], cots[2])))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ring_low_precision_accumulates_in_float32(dtype):
    p = 4
    q, k, v = _qkv(np.random.default_rng(2), 2, 3, 4 * p, 4 * p, dtype)
    out = _ring_fn(p, "zigzag", mask=masks.causal())(q, k, v)
    assert out.dtype == dtype
    want, _, _ = ref.attention(q, k, v, mask=np.tril(np.ones((4 * p, 4 * p), bool)))
    np.testing.assert_allclose(ref.f64(out), want, **ref.tol(dtype))


@pytest.mark.long
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sequence_parallel_attention_pads_uneven_lengths_gqa_and_cross(layout):
    """T and S that do not divide the ring, T != S (queries bottom-right), grouped kv heads, under jit."""
    p, t, s = 4, 13, 22
    rng = np.random.default_rng(3)
    with jax.enable_x64(True), jax.set_mesh(_mesh(p)):
        q = jnp.asarray(rng.normal(size=(2, 1, 3, t, 5)))  # (B, K, G, T, D)
        k = jnp.asarray(rng.normal(size=(2, 1, 1, s, 5)))  # (B, K, 1, S, D)
        v = jnp.asarray(rng.normal(size=(2, 1, 1, s, 7)))
        for mask in (None, masks.causal(), masks.sliding_window(4)):
            fn = jax.jit(functools.partial(jattn.sequence_parallel_attention, axis_name="s", mask=mask, layout=layout))
            dense = None if mask is None else mask.dense(t, s)
            want, _, _ = ref.attention(q, k, v, mask=dense)
            np.testing.assert_allclose(fn(q, k, v), want, **ref.tol(jnp.float64))
            got = _grads(fn, q, k, v)
            exp = _grads(lambda q, k, v, m=mask: jattn.attention(q, k, v, mask=m), q, k, v)
            for g, e in zip(got, exp, strict=True):
                np.testing.assert_allclose(g, e, **ref.tol(jnp.float64))


def test_ring_gradient_reaches_only_the_past_across_devices():
    """A causal ring: the output at global position t depends on no key or value after t."""
    p, n = 4, 16
    with jax.enable_x64(True):
        q, k, v = _qkv(np.random.default_rng(4), 1, 1, n, n)
        ring = _ring_fn(p, "zigzag", mask=masks.causal())
        for t in (0, 5, 11):
            dk, dv = jax.grad(lambda k, v, t=t: jnp.sum(ring(q, k, v)[..., t, :]), argnums=(0, 1))(k, v)
            assert np.all(np.asarray(dk)[..., t + 1 :, :] == 0) and np.all(np.asarray(dv)[..., t + 1 :, :] == 0)
            assert np.all(np.abs(np.asarray(dv)[..., : t + 1, :]).sum(-1) > 0)


def _work(mask, p, layout, n=8):
    """``(P steps, P devices)``: how many (query chunk, key chunk) pairs each device computes at each step.

    Observed on a run: a score_mod reports the global positions of every tile it is applied to,
    which is every pair the ring computes (an empty pair is skipped). The query chunk names the
    device (its layout's owner) and the key chunk how far it has travelled: the step.
    """
    chunk = n if layout == "contiguous" else n // 2
    pairs = []

    def report(q_pos, kv_pos):
        pairs.append((int(q_pos) // chunk, int(kv_pos) // chunk))

    def mod(score, batch, head, q_pos, kv_pos):
        jax.debug.callback(report, q_pos[0, 0, 0], kv_pos[0, 0, 0])
        return score

    x = jnp.zeros((1, p * n, 4), jnp.float32)
    _ring_fn(p, layout, mask=mask, score_mod=mod)(x, x, x).block_until_ready()
    jax.effects_barrier()
    chunks = np.arange(p * n // chunk)
    owner = chunks if layout == "contiguous" else np.minimum(chunks, 2 * p - 1 - chunks)  # zigzag: r and 2P-1-r
    work = np.zeros((p, p), int)
    for q_chunk, kv_chunk in pairs:
        r, src = owner[q_chunk], owner[kv_chunk]
        work[(r - src) % p, r] += 1
    return work


@pytest.mark.parametrize("p", [2, 4, 8])
def test_causal_ring_skips_future_slices_and_zigzag_balances_them(p):
    """The schedule computes only non-empty chunk pairs; zigzag gives every device the same work per step."""
    contiguous = _work(masks.causal(), p, "contiguous")  # (steps, devices): 1 = a slice is computed
    np.testing.assert_array_equal(contiguous, np.triu(np.ones((p, p), int)))  # device r works at steps n <= r
    zig = _work(masks.causal(), p, "zigzag")  # quarter-size chunk pairs
    assert np.all(zig == zig[:, :1])  # balanced across devices at every step
    assert zig.sum() == p * (2 * p + 1)  # = number of non-empty chunk pairs of a causal 2P x 2P grid


def test_window_ring_skips_slices_two_back():
    window = _work(masks.sliding_window(8), 8, "contiguous")
    assert window[2:].sum() == 0  # a window of one slice never needs keys from two slices back


def test_ring_errors_name_the_problem():
    mesh = _mesh(2)
    x = jnp.ones((1, 6, 4), jnp.float32)

    def call(**options):
        fn = functools.partial(jattn.ring_attention, axis_name="s", **options)
        spec = PartitionSpec(None, "s", None)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, x, x)

    with pytest.raises(ValueError, match="position-only"):
        call(mask=masks.padding(kv_lengths=jnp.array([3])))
    with pytest.raises(ValueError, match="even local lengths"):
        call(layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        call(layout="spiral")
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        call(segment_ids=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        jattn.sequence_parallel_attention(x, x, x, axis_name="seq", mesh=mesh)


def test_ring_returns_the_log_sum_exp():
    p = 2
    with jax.enable_x64(True):
        q, k, v = _qkv(np.random.default_rng(5), 2, 3, 4 * p, 4 * p)
        mesh, seq = _mesh(p), PartitionSpec(None, None, "s", None)
        fn = functools.partial(jattn.ring_attention, axis_name="s", mask=masks.causal(), return_lse=True)
        out, lse = jax.shard_map(fn, mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, PartitionSpec(None, None, "s")))(
            q, k, v
        )
        want, _, want_lse = ref.attention(q, k, v, mask=np.tril(np.ones((4 * p, 4 * p), bool)))
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))
        np.testing.assert_allclose(lse, want_lse, **ref.tol(jnp.float64))


def test_modules_with_a_sequence_axis_equal_the_plain_modules_under_a_mesh():
    """NNX and Linen SelfAttention(sequence_axis='seq') on a data 2 x seq 4 mesh: outputs and grads."""
    from flax import nnx

    import jattn.linen
    import jattn.nnx

    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(4, 11, 12)), jnp.float32)
    mask = masks.causal() & masks.sliding_window(6)
    kw = dict(num_heads=4, num_kv_heads=2)
    graph, state = nnx.split(jattn.nnx.SelfAttention(12, sequence_axis="seq", rngs=nnx.Rngs(0), **kw))
    lin = jattn.linen.SelfAttention(12, sequence_axis="seq", **kw)
    lin_params = lin.init(jax.random.key(1), x, mask)

    def nnx_loss(state, x):
        return jnp.sum(jnp.sin(nnx.merge(graph, state)(x, mask)))

    def linen_loss(params, x):
        return jnp.sum(jnp.sin(lin.apply(params, x, mask)))

    for loss, params in ((nnx_loss, state), (linen_loss, lin_params)):
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        want, want_grads = fn(params, x)  # no mesh: the plain core
        with jax.set_mesh(mesh):
            got, got_grads = fn(params, x)
            hlo = fn.lower(params, x).compile().as_text()
        assert "collective-permute" in hlo  # the ring ran
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float32))
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, **ref.tol(jnp.float32))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_score_mod_sinks_and_max_logit_equal_the_dense_core(layout):
    """T5 table + ALiBi slopes (replicated, closed over) and sinks on 4 devices: out, lse, max logit
    and the gradients to q, k, v, table, slopes and sinks equal the dense core's (float64)."""
    p, nb = 4, 6
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        q, k, v = _qkv(rng, 2, 3, 4 * p, 4 * p)
        table, slopes = jnp.asarray(rng.normal(size=(nb, 3))), jnp.asarray([0.5, 0.3, 0.1])
        sinks = jnp.asarray(rng.normal(size=(3,)))
        mesh, seq = _mesh(p), PartitionSpec(None, None, "s", None)
        rep, row = PartitionSpec(), PartitionSpec(None, None, "s")

        def mod(table, slopes):
            return jattn.score_mods.compose(
                jattn.score_mods.relative_position_bias(table, nb, 7, True), jattn.score_mods.alibi(slopes)
            )

        def ring(q, k, v, table, slopes, sinks):
            def local(q, k, v, table, slopes, sinks):
                return jattn.ring_attention(
                    q, k, v, axis_name="s", layout=layout, mask=masks.causal(), score_mod=mod(table, slopes),
                    sinks=sinks, return_lse=True, return_max_logit=True,
                )  # fmt: skip

            lay = (lambda x: jattn.zigzag(x, p)) if layout == "zigzag" else (lambda x: x)
            unlay = (lambda x, a=-2: jattn.unzigzag(x, p, a)) if layout == "zigzag" else (lambda x, a=-2: x)
            out, lse, top = jax.shard_map(
                local, mesh=mesh, in_specs=(seq, seq, seq, rep, rep, rep), out_specs=(seq, row, row)
            )(lay(q), lay(k), lay(v), table, slopes, sinks)
            return unlay(out), unlay(lse, -1), unlay(top, -1)

        def dense(q, k, v, table, slopes, sinks):
            return jattn.attention(
                q, k, v, mask=masks.causal(), score_mod=mod(table, slopes), sinks=sinks, return_lse=True,
                return_max_logit=True, implementation="dense",
            )  # fmt: skip

        args = (q, k, v, table, slopes, sinks)
        for got, want in zip(jax.jit(ring)(*args), dense(*args), strict=True):
            np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))
        cot = jnp.asarray(rng.normal(size=(2, 3, 4 * p, 7)))
        grads = [
            jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a)[0] * cot), argnums=tuple(range(6))))(*args)
            for f in (ring, dense)
        ]
        for got, want in zip(*grads, strict=True):
            np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))


def test_modules_over_a_ring_refuse_score_mod_and_sinks_by_name():
    """sequence_parallel_attention takes neither: the module says so rather than drop them."""
    from flax import nnx

    import jattn.nnx

    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.ones((2, 8, 12), jnp.float32)
    for option in (dict(sinks=True), dict(score_mod=jattn.score_mods.softcap(3.0))):
        m = jattn.nnx.SelfAttention(12, num_heads=2, sequence_axis="seq", rngs=nnx.Rngs(0), **option)
        with (
            jax.set_mesh(mesh),
            pytest.raises(ValueError, match=r"sequence_axis='seq' \(ring attention over 4 devices\)"),
        ):
            m(x, masks.causal())
