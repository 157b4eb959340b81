"""jattn.paged_attention on its two paths ('xla', 'fused') against the float64 reference, request by request.

Each request's keys are gathered with NumPy from its pages (placed anywhere in the pool, some shared) and fed
to tests/reference.py's dense attention with its queries at the end of its keys. Sizes are distinct and odd
(R, N, K, D, E, Z differ) so a misread axis fails. The fused cases skip where its kernel is not there (or
not written yet); it takes masks of one key interval a query and no score_mod, and refuses the rest naming
'xla'. Also: broken tables (eager ValueError; under jit NaN rows for exactly the broken request), shape
errors, the same bits for a request alone, in a batch, chunked or token by token, and no buffer of the
gathered cache's size in the xla path's compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks, score_mods
from jattn._blockwise import fused_cpu
from jattn._paged import fused, xla
from jattn._paged.checks import check_paged
from tests import reference as ref
from tests.paged_cases import Case

N, K, D, E = 6, 2, 11, 7  # query heads, kv heads (G = 3), depths; R differs in every case
PAD = 3  # padding tokens past cu_q_lens[R]


@functools.cache
def _fused_missing() -> str | None:
    """Why the fused path cannot run here (a skip's reason), or None."""
    if not hasattr(fused_cpu, "paged_forward"):
        return "the fused paged kernel is not written yet (jattn._blockwise.fused_cpu.paged_forward)"
    if not fused.available():
        return "the fused CPU kernels are not built here"
    c = _case(0, [1], [3], 16)
    try:
        jattn.paged_attention(*c.args(jnp.float32), implementation="fused")
    except NotImplementedError as e:
        return f"the fused paged path is not implemented yet: {e}"
    return None


@pytest.fixture(params=["xla", "fused"])
def impl(request) -> str:
    if request.param == "fused" and (why := _fused_missing()):
        pytest.skip(why)
    return request.param


def _case(seed, q_lens, kv_lens, Z, *, heads=(N, K), share=None, spare=3) -> Case:
    """Requests with ``q_lens`` queries and ``kv_lens`` keys, their pages in a random order in a pool of pages of ``Z``.

    ``share=(a, b, n)``: request b's first n pages are request a's (a shared prompt). Table entries past a
    request's pages hold junk (out of range): nothing may read them.
    """
    rng = np.random.default_rng(seed)
    n_heads, kv_heads = heads
    need = [-(-kv // Z) for kv in kv_lens]
    M = max(need) + 1
    P = sum(need) + spare
    order = iter(rng.permutation(P))
    table = rng.choice([-1, P, P + 5], size=(len(q_lens), M))
    for r, n in enumerate(need):
        table[r, :n] = [next(order) for _ in range(n)]
    if share is not None:
        a, b, n = share
        table[b, :n] = table[a, :n]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return Case(
        rng.standard_normal((cu[-1] + PAD, n_heads, D)),
        rng.standard_normal((P, Z, kv_heads, D)),
        rng.standard_normal((P, Z, kv_heads, E)),
        table,
        np.asarray(kv_lens),
        cu,
    )


def _want(c: Case, dtype, mask=masks.causal(), scale=None, np_mod=None, sinks=None):  # noqa: B008
    """The float64 reference: ``out (Q, N, E)`` and ``lse (Q, N)``, request by request from its gathered keys."""
    q, kp, vp = (ref.f64(jnp.asarray(x, dtype)) for x in (c.q, c.k_pages, c.v_pages))
    Q, n_heads, _ = q.shape
    G = n_heads // kp.shape[2]
    out, lse = np.zeros((Q, n_heads, E)), np.full((Q, n_heads), -np.inf)
    for r in range(len(c.kv_lens)):
        lo, hi, S = c.cu[r], c.cu[r + 1], c.kv_lens[r]
        if hi == lo:
            continue
        pages = c.table[r, : -(-S // kp.shape[1])]
        k = np.repeat(kp[pages].reshape(-1, kp.shape[2], D)[:S].transpose(1, 0, 2), G, axis=0)[None]  # (1, N, S, D)
        v = np.repeat(vp[pages].reshape(-1, kp.shape[2], E)[:S].transpose(1, 0, 2), G, axis=0)[None]
        dense = None if mask is None else np.asarray(mask.dense(hi - lo, S, q_offset=S - (hi - lo)))
        mod = None if np_mod is None else functools.partial(lambda r, s, b, *a: np_mod(s, b + r, *a), r)
        o, _, row_lse = ref.attention(
            q[None, lo:hi].transpose(0, 2, 1, 3),
            k,
            v,
            dense,
            scale=scale,
            score_mod=mod,
            sinks=sinks,
            q_offset=S - (hi - lo),
        )
        out[lo:hi], lse[lo:hi] = o[0].transpose(1, 0, 2), row_lse[0].T
    return out, lse


def _close(got, want, dtype) -> None:
    out, lse = got
    assert out.dtype == dtype and out.shape == want[0].shape
    assert lse.dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32) and lse.shape == want[1].shape
    np.testing.assert_allclose(ref.f64(out), want[0], **ref.tol(dtype))
    np.testing.assert_allclose(ref.f64(lse), want[1], **ref.tol(dtype))


SCENARIOS = {
    "decode": ([1, 1, 1, 1, 1], [37, 1, 130, 64, 200]),
    "prefill": ([23, 70, 1, 129], [23, 70, 1, 129]),
    "mixed": ([1, 40, 0, 7, 1, 18], [90, 40, 13, 50, 1, 150]),  # a finished request, a chunk not at 0
}


@pytest.mark.parametrize("Z", [16, 64, 128])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_values_against_the_reference(impl, scenario, Z):
    c = _case(1, *SCENARIOS[scenario], Z)
    got = jattn.paged_attention(*c.args(), return_lse=True, implementation=impl)
    _close(got, _want(c, jnp.float32), jnp.float32)
    assert np.all(np.asarray(got[0][-PAD:]) == 0) and np.all(np.asarray(got[1][-PAD:]) == -np.inf)  # padding


def test_shared_prompt_pages(impl):
    """Two requests whose tables name the same prompt pages, then their own; multi-query heads (K = 1)."""
    c = _case(2, [1, 9, 30], [70, 60, 30], 16, heads=(3, 1), share=(0, 1, 3))
    assert np.array_equal(c.table[0, :3], c.table[1, :3])
    _close(jattn.paged_attention(*c.args(), return_lse=True, implementation=impl), _want(c, jnp.float32), jnp.float32)


INTERVAL_MASKS = {
    "none": None,
    "window": masks.sliding_window(17),
    "two-sided window": masks.sliding_window(6, 3),
    "causal & window": masks.causal() & masks.sliding_window(20, 5),
}


@pytest.mark.parametrize("scenario", ["mixed", "far"])
@pytest.mark.parametrize("name", INTERVAL_MASKS)
def test_masks_of_one_key_interval(impl, name, scenario):
    """Far: queries from position 144 on (a block's first), whose window of 17 starts at key 127; the tiles of
    128 keys wholly before every query's window are skipped, and that one is not."""
    c = _case(3, *(SCENARIOS["mixed"] if scenario == "mixed" else ([1, 19, 6], [262, 280, 150])), 16)
    mask = INTERVAL_MASKS[name]
    got = jattn.paged_attention(*c.args(), mask=mask, return_lse=True, implementation=impl)
    _close(got, _want(c, jnp.float32, mask), jnp.float32)


@pytest.mark.parametrize(
    "mask", [masks.causal() | masks.global_tokens([0, 45]), ~masks.causal()], ids=["global tokens", "rows without keys"]
)
def test_other_masks_on_xla(mask):
    """Any mask of positions: global tokens; ``j > i`` leaves each request's last query no key (out 0, lse -inf)."""
    c = _case(4, *SCENARIOS["mixed"], 16)
    got = jattn.paged_attention(*c.args(), mask=mask, return_lse=True, implementation="xla")
    _close(got, _want(c, jnp.float32, mask), jnp.float32)
    with pytest.raises(ValueError, match="implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), mask=mask, implementation="fused")


SLOPES = score_mods.alibi_slopes(N)
MODS = {  # the jattn modification and its NumPy twin
    "softcap": (score_mods.softcap(30.0), lambda s, *_: 30.0 * np.tanh(s / 30.0)),
    "alibi": (
        score_mods.alibi(SLOPES),
        lambda s, b, h, qp, kp: s - np.asarray(SLOPES, np.float64)[h] * np.abs(qp - kp),
    ),
    "batch and head": (
        lambda s, b, h, qp, kp: s + 0.5 * b.astype(s.dtype) - 0.25 * h.astype(s.dtype),
        lambda s, b, h, qp, kp: s + 0.5 * b - 0.25 * h,
    ),
}


@pytest.mark.parametrize("name", MODS)
def test_score_mods_on_xla(name):
    """``batch`` is the request, ``head`` the query head, positions absolute; scale 4 takes the soft cap's bend."""
    c = _case(5, *SCENARIOS["mixed"], 16)
    mod, np_mod = MODS[name]
    got = jattn.paged_attention(*c.args(), scale=4.0, score_mod=mod, return_lse=True, implementation="xla")
    _close(got, _want(c, jnp.float32, scale=4.0, np_mod=np_mod), jnp.float32)
    with pytest.raises(ValueError, match="score_mod; implementation='xla' takes it"):
        jattn.paged_attention(*c.args(), score_mod=mod, implementation="fused")


def test_sinks(impl):
    c = _case(6, *SCENARIOS["mixed"], 16)
    sinks = np.random.default_rng(6).standard_normal(N).astype(np.float32)
    got = jattn.paged_attention(*c.args(), sinks=jnp.asarray(sinks), return_lse=True, implementation=impl)
    out, lse = _want(c, jnp.float32, sinks=sinks.astype(np.float64))
    rows = c.cu[-1]
    _close((got[0][:rows], got[1][:rows]), (out[:rows], lse[:rows]), jnp.float32)
    assert np.all(np.asarray(got[0][rows:]) == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs(impl, dtype):
    c = _case(7, *SCENARIOS["mixed"], 16)
    _close(jattn.paged_attention(*c.args(dtype), return_lse=True, implementation=impl), _want(c, dtype), dtype)


def test_float64_on_xla_and_the_fused_refusal():
    """The xla path computes float64 in float64 (its forward on the checked operands); the fused path refuses it."""
    c = _case(8, *SCENARIOS["mixed"], 16)
    with jax.enable_x64(True):
        p = check_paged(*c.args(jnp.float64), masks.causal(), None)
        out, lse = xla.forward(p, None)
        _close((out, lse), _want(c, jnp.float64), jnp.float64)
        with pytest.raises(ValueError, match=r"float64 inputs .*implementation='xla' takes it"):
            jattn.paged_attention(*c.args(jnp.float64), implementation="fused")


def test_float64_through_the_api():
    c = _case(8, *SCENARIOS["mixed"], 16)
    with jax.enable_x64(True):
        got = jattn.paged_attention(*c.args(jnp.float64), return_lse=True, implementation="xla")
        _close(got, _want(c, jnp.float64), jnp.float64)


def test_a_batch_without_requests_is_all_padding(impl):
    """R = 0: every token is padding (out 0, lse -inf), eagerly and under jit."""
    q, kp, vp = np.ones((3, N, D), np.float32), np.ones((2, 16, K, D), np.float32), np.ones((2, 16, K, E), np.float32)
    tables = np.zeros((0, 1), np.int32), np.zeros((0,), np.int32), np.zeros((1,), np.int32)
    for f in (jattn.paged_attention, jax.jit(jattn.paged_attention, static_argnames=("return_lse", "implementation"))):
        out, lse = f(q, kp, vp, *tables, return_lse=True, implementation=impl)
        np.testing.assert_array_equal(np.asarray(out), np.zeros((3, N, E)))
        np.testing.assert_array_equal(np.asarray(lse), np.full((3, N), -np.inf))


def test_out_alone_without_return_lse(impl):
    c = _case(9, [2], [5], 16)
    out = jattn.paged_attention(*c.args(), implementation=impl)
    assert isinstance(out, jax.Array) and out.shape == (2 + PAD, N, E) and out.dtype == jnp.float32


def test_stale_slots_do_not_leak_on_xla():
    """NaN in the slots past kv_lens (a page's unwritten tail, a page the table no longer names) changes nothing."""
    c = _case(10, *SCENARIOS["mixed"], 16)
    want = jattn.paged_attention(*c.args(), return_lse=True, implementation="xla")
    used = np.zeros(c.k_pages.shape[:2], bool)
    for r, kv in enumerate(c.kv_lens):
        for j in range(kv):
            used[c.table[r, j // 16], j % 16] = True
    c.k_pages[~used], c.v_pages[~used] = np.nan, np.nan
    got = jattn.paged_attention(*c.args(), return_lse=True, implementation="xla")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jit_with_traced_tables_equals_eager(impl):
    """The same bits: the tables' values traced change no operation."""
    c = _case(11, *SCENARIOS["mixed"], 16)
    f = functools.partial(jattn.paged_attention, return_lse=True, implementation=impl)
    eager, jitted = f(*c.args()), jax.jit(f)(*c.args())
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _broken(kind: str, c: Case) -> tuple[Case, int | None, str]:
    """``c`` with request 1's table entries broken: the case, the broken request (None: all) and the message."""
    c = dataclasses.replace(c, table=c.table.copy(), kv_lens=c.kv_lens.copy(), cu=c.cu.copy())
    if kind == "page out of range":
        c.table[1, 1] = c.k_pages.shape[0] + 2
        return c, 1, r"page_table\[1\] holds page \d+, out of range for k_pages"
    if kind == "kv beyond pages":
        c.kv_lens[1] = c.table.shape[1] * c.k_pages.shape[1] + 1
        return c, 1, r"kv_lens\[1\] = \d+ is beyond the request's pages"
    if kind == "q longer than kv":
        c.kv_lens[1] = c.cu[2] - c.cu[1] - 2
        return c, 1, "request 1 has q length 40 .* longer than its kv length"
    c.cu[2] = c.cu[1] - 1  # cu_q_lens decreases
    return c, None, "cu_q_lens must increase from >= 0 to at most Q"


BROKEN = ["page out of range", "kv beyond pages", "q longer than kv", "cu_q_lens decreases"]


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_tables_raise_eagerly_and_give_nan_rows_under_jit(impl, kind):
    good = _case(12, *SCENARIOS["mixed"], 16)
    bad, request, message = _broken(kind, good)
    with pytest.raises(ValueError, match=message):
        jattn.paged_attention(*bad.args(), implementation=impl)
    f = jax.jit(functools.partial(jattn.paged_attention, return_lse=True, implementation=impl))
    want, got = f(*good.args()), f(*bad.args())
    nan = np.ones(good.q.shape[0], bool)
    if request is not None:
        nan[:] = False
        nan[good.cu[request] : good.cu[request + 1]] = True
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isnan(a[nan])) and not np.any(np.isnan(a[~nan]))
        np.testing.assert_array_equal(a[~nan], b[~nan])


def _reshaped(args: tuple, index: int, new) -> tuple:
    return (*args[:index], new, *args[index + 1 :])


def test_shape_and_dtype_errors_name_the_argument():
    c = _case(13, [2, 1], [5, 9], 16)
    args = c.args()
    q, kp, vp, table, kv, cu = args
    type_errors = {
        "q must be floating point": _reshaped(args, 0, q.astype(jnp.int32)),
        "share one dtype": _reshaped(args, 1, kp.astype(jnp.bfloat16)),
        "page_table must be an integer array": _reshaped(args, 3, table.astype(jnp.float32)),
    }
    for message, bad in type_errors.items():
        with pytest.raises(TypeError, match=message):
            jattn.paged_attention(*bad)
    value_errors = {
        r"q must be \(Q, N, D\)": _reshaped(args, 0, q[0]),
        r"k_pages must be \(P, Z, K, D\) with D": _reshaped(args, 1, kp[..., :3]),
        r"v_pages must be \(P, Z, K, E\)": _reshaped(args, 2, vp[:, :4]),
        r"q must be .* N a multiple of K": _reshaped(args, 0, q[:, :5]),
        r"page_table must be \(R, M\)": _reshaped(args, 3, table[0]),
        r"kv_lens must be \(R,\)": _reshaped(args, 4, kv[:1]),
        r"cu_q_lens must be \(R \+ 1,\)": _reshaped(args, 5, cu[:2]),
    }
    for message, bad in value_errors.items():
        with pytest.raises(ValueError, match=message):
            jattn.paged_attention(*bad)
    with pytest.raises(ValueError, match="sinks must be floating"):
        jattn.paged_attention(*args, sinks=jnp.zeros(4))


def test_a_request_gets_the_same_bits_alone_in_a_batch_chunked_and_token_by_token(impl):
    """Request X (45 keys) prefilled alone; in a batch of 3 at another place, its pages elsewhere; chunked
    3 + 5 + rest; decoded token by token. Every call padded to a few shapes (serving's buckets)."""
    S, Z = 45, 16
    rng = np.random.default_rng(14)
    k_pages, v_pages = rng.standard_normal((16, Z, K, D)), rng.standard_normal((16, Z, K, E))
    k_pages[8:11], v_pages[8:11] = k_pages[:3], v_pages[:3]  # X's pages copied to 8, 9, 10
    q = rng.standard_normal((S, N, D))
    f = jax.jit(functools.partial(jattn.paged_attention, return_lse=True, implementation=impl))

    def call(qs, table, kv, cu, Q):
        qs = np.concatenate([qs, np.zeros((Q - len(qs), N, D))])
        ints = (jnp.asarray(x, jnp.int32) for x in (table, kv, cu))
        return [
            np.asarray(x)[: cu[-1]] for x in f(*(jnp.asarray(x, jnp.float32) for x in (qs, k_pages, v_pages)), *ints)
        ]

    own, moved, other = [0, 1, 2, 3], [8, 9, 10, 3], [4, 5, 6, 7]
    alone = call(q, [own], [S], [0, S], 64)
    others = rng.standard_normal((9, N, D))
    batch = call(
        np.concatenate([others[:8], q, others[8:]]), [other, moved, other], [30, S, 50], [0, 8, S + 8, S + 9], 64
    )
    chunks = [call(q[lo:hi], [own], [hi], [0, hi - lo], 64) for lo, hi in [(0, 3), (3, 8), (8, S)]]
    tokens = [call(q[i : i + 1], [own], [i + 1], [0, 1], 8) for i in range(S)]
    for way, got in {
        "batch": [x[8 : 8 + S] for x in batch],
        "chunked": [np.concatenate(x) for x in zip(*chunks, strict=True)],
        "token by token": [np.concatenate(x) for x in zip(*tokens, strict=True)],
    }.items():
        for a, b in zip(got, alone, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=way)


def test_the_xla_path_never_builds_the_gathered_cache():
    """A decode step of 8 requests of 1024 keys: every array of the compiled program but the pools themselves is
    under a quarter of the gathered cache (R·S·K·D elements)."""
    R, S, Z, kv_heads, depth = 8, 1024, 16, 2, 64
    M = S // Z
    P = R * M + 5
    f32, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = (
        f32((R, 4, depth), jnp.float32),
        f32((P, Z, kv_heads, depth), jnp.float32),
        f32((P, Z, kv_heads, depth), jnp.float32),
        f32((R, M), i32),
        f32((R,), i32),
        f32((R + 1,), i32),
    )
    f = functools.partial(jattn.paged_attention, implementation="xla")
    text = jax.jit(f).lower(*args).compile().as_text()
    pool = f"[{P},{Z},{kv_heads},{depth}]"
    shapes = [s for s in re.findall(r"\b(?:f16|bf16|f32|f64|s8|u8|s32|u32|s64|pred)(\[[\d,]*\])", text) if s != pool]
    assert shapes
    biggest = max(int(np.prod([int(n) for n in s[1:-1].split(",") if n], dtype=np.int64)) for s in shapes)
    assert biggest < R * S * kv_heads * depth / 4, biggest
