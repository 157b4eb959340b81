"""jattn.log_linear_attention: both forms against a quadratic float64 reference with explicit Fenwick buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref

B, N, T, D, E = 2, 3, 29, 4, 5  # distinct sizes; T is not a multiple of the chunks below
L = 6  # bit_length(T - 1) + 1 = 6 levels


def bucket(t: int, s: int) -> int:
    """The Fenwick bucket of key s for query t >= s, by the paper's recursion (its ``get_level_index_weak``)."""
    if s == t:
        return 0
    top = 1 << (t.bit_length() - 1)  # the highest power of 2 <= t
    return top.bit_length() if s < top else bucket(t - top, s - top)


def quadratic(q, k, v, lam, g=None, beta=None, segment_ids=None, kv_mask=None, *, xp=np):
    """``o_t = Σ_{s<=t} λ_t[bucket(t, s)] (q_t / sqrt(D))ᵀ A_t ⋯ A_{s+1} β_s k_s v_sᵀ`` pair by pair, in ``xp``.

    ``A_r = a_r (I - β_r k_r k_rᵀ)``; a dropped step r has ``A_r = I`` and writes nothing; a change of segment
    id at a step r in (s, t] cuts the pair. ``carried[s]`` is ``A_r ⋯ A_{s+1} β_s k_s`` at the current step r,
    for every source s at once. With ``xp = jnp`` it is differentiable.
    """
    lead, T_ = q.shape[:-2], q.shape[-2]
    ids = np.zeros(T_, int) if segment_ids is None else np.asarray(segment_ids)
    keep = np.ones(T_, bool) if kv_mask is None else np.asarray(kv_mask)
    ids, keep = np.broadcast_to(ids, (*lead, T_)), np.broadcast_to(keep, (*lead, T_))
    ones = xp.ones((*lead, T_), q.dtype)
    a = ones if g is None else xp.exp(xp.broadcast_to(g, (*lead, T_)))
    b = ones if beta is None else xp.broadcast_to(beta, (*lead, T_))
    q = q / np.sqrt(q.shape[-1])
    carried = xp.zeros((*lead, T_, q.shape[-1]), q.dtype)  # (..., S, D)
    sources = np.arange(T_)
    outs = []
    for r in range(T_):
        if r:
            cut = (ids[..., r] != ids[..., r - 1])[..., None, None]
            kr = k[..., r, None, :]
            dot = xp.sum(kr * carried, -1, keepdims=True)
            moved = a[..., r, None, None] * (carried - (0.0 if beta is None else b[..., r, None, None] * kr * dot))
            carried = xp.where(cut, 0.0, xp.where(keep[..., r, None, None], moved, carried))
        write = xp.where(keep[..., r, None], b[..., r, None] * k[..., r, :], 0.0)
        carried = xp.where((sources == r)[:, None], write[..., None, :], carried)
        weights = xp.stack([lam[..., r, bucket(r, s)] if s <= r else lam[..., r, 0] * 0.0 for s in range(T_)], -1)
        coef = xp.where(sources <= r, weights * xp.sum(q[..., r, None, :] * carried, -1), 0.0)  # (..., S)
        o = xp.sum(coef[..., None] * v, -2)
        outs.append(xp.where(keep[..., r, None], o, 0.0))
    return xp.stack(outs, axis=-2)


def _inputs(seed=0, dtype=np.float64, T=T):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, N, T, x)) for x in (D, D, E))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    lam = r.uniform(0.2, 2.0, (B, N, T, L + 1))  # one level more than T needs: not read
    g, beta = -r.uniform(0, 1, (B, N, T)), r.uniform(0.05, 0.95, (B, N, T))
    return {n: x.astype(dtype) for n, x in dict(q=q, k=k, v=v, level_weights=lam, g=g, beta=beta).items()}


def _documents(seed=2):
    r = np.random.default_rng(seed)
    ids = np.cumsum(r.uniform(size=(B, 1, T)) < 0.12, axis=-1).astype(np.int32)
    keep = (np.arange(T) < np.array([T, T - 6])[:, None, None]) & (np.arange(T) != 9)  # padding and a hole
    return {"segment_ids": ids, "kv_mask": keep}


KINDS = {"linear": (), "ssd": ("g",), "deltanet": ("beta",), "gated deltanet": ("g", "beta")}


def _args(kind, x):
    return dict(q=x["q"], k=x["k"], v=x["v"], level_weights=x["level_weights"]) | {n: x[n] for n in KINDS[kind]}


def _reference(args, docs, xp=np):
    lam = args["level_weights"]
    return quadratic(args["q"], args["k"], args["v"], lam, args.get("g"), args.get("beta"), **docs, xp=xp)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("kind", KINDS)
def test_both_forms_equal_the_quadratic_reference(kind, mode):
    """float64, with documents, padding and a dropped step: chunks of 4 leave 3 levels to the scan over chunks."""
    with jax.enable_x64(True):
        args, docs = _args(kind, _inputs()), _documents()
        got = jattn.log_linear_attention(**args, **docs, mode=mode, chunk_size=4)
        np.testing.assert_allclose(got, _reference(args, docs), **ref.tol(jnp.float64))


def test_the_buckets_are_the_fenwick_levels_and_partition_the_prefix():
    """The reference's recursion gives bit_length(t ^ s); level ℓ >= 1 holds 2^(ℓ-1) keys or none."""
    for t in range(70):
        levels = [bucket(t, s) for s in range(t + 1)]
        assert levels == [(t ^ s).bit_length() for s in range(t + 1)]
        for ell in range(1, 8):
            assert levels.count(ell) in (0, 2 ** (ell - 1)), (t, ell)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_references_derivatives(kind, mode):
    """Every input's gradient, level weights and gates included, against JAX's derivative of the reference."""
    with jax.enable_x64(True):
        args = {n: jnp.asarray(x) for n, x in _args(kind, _inputs(T=11)).items()}
        args["level_weights"] = args["level_weights"][..., :5]
        docs = {n: x[..., :11] for n, x in _documents().items()}
        docs["kv_mask"] = docs["kv_mask"] & (np.arange(11) != 4)
        w = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, 11, E)))

        def loss(args):
            return jnp.sum(w * jattn.log_linear_attention(**args, **docs, mode=mode, chunk_size=2))

        def ref_loss(args):
            return jnp.sum(w * _reference(args, docs, xp=jnp))

        want_value = np.sum(np.asarray(w) * _reference({n: np.asarray(a) for n, a in args.items()}, docs))
        np.testing.assert_allclose(loss(args), want_value, rtol=1e-12)
        got, want = jax.grad(loss)(args), jax.grad(ref_loss)(args)
        for name in args:
            ref.assert_grad_close(got[name], want[name], jnp.float64)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("kind", KINDS)
def test_unit_level_weights_give_the_base_kind(kind, mode):
    """Every λ = 1: the levels add up to gated_linear_attention's one state (documents and padding too)."""
    with jax.enable_x64(True):
        x, docs = _inputs(), _documents()
        args = _args(kind, x) | {"level_weights": np.ones((T, L))}
        base = {n: a for n, a in args.items() if n != "level_weights"}
        got = jattn.log_linear_attention(**args, **docs, mode=mode, chunk_size=8)
        want = jattn.gated_linear_attention(**base, **docs, mode="recurrent")
        np.testing.assert_allclose(got, want, **ref.tol(jnp.float64))
        other = jattn.log_linear_attention(**args | {"level_weights": x["level_weights"]}, **docs, chunk_size=8)
        assert np.max(np.abs(other - want)) > 1e-2  # the levels' weights matter: the property could fail


def test_float32_at_2048_steps_is_within_1e_3_of_float64():
    """The chunk form in float32 against the same call in float64 (checked above against the reference)."""
    n = 2048
    r = np.random.default_rng(7)
    q, k, v = (r.standard_normal((1, 2, n, 8)) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g, beta = -r.uniform(0, 0.2, (1, 2, n)), r.uniform(0.05, 0.95, (1, 2, n))
    lam = r.uniform(0.2, 2.0, (1, 2, n, 12))
    x = dict(q=q, k=k, v=v, g=g, beta=beta, level_weights=lam)
    for gates in (("g",), ("g", "beta")):
        kw = {nm: a for nm, a in x.items() if nm not in ("g", "beta") or nm in gates}
        got = jattn.log_linear_attention(**{nm: jnp.asarray(a, jnp.float32) for nm, a in kw.items()})
        with jax.enable_x64(True):
            want = np.asarray(jattn.log_linear_attention(**{nm: jnp.asarray(a) for nm, a in kw.items()}))
        assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= 1e-3 * np.max(np.abs(want)), gates


def test_recurrent_state_continues_a_sequence():
    """Two recurrent calls, the second from the first's level states at its position, equal one chunked call;
    so does a per-example start (each example split at its own step)."""
    with jax.enable_x64(True):
        args = _args("gated deltanet", _inputs())
        whole = jattn.log_linear_attention(**args, chunk_size=4)
        for cut in (1, 8, 13):
            head = {n: a[..., :cut, :] if a.ndim == 4 else a[..., :cut] for n, a in args.items()}
            tail = {n: a[..., cut:, :] if a.ndim == 4 else a[..., cut:] for n, a in args.items()}
            first, state = jattn.log_linear_attention(**head, mode="recurrent", return_state=True)
            second = jattn.log_linear_attention(**tail, mode="recurrent", initial_state=state, start=cut)
            np.testing.assert_allclose(np.concatenate([first, second], -2), whole, **ref.tol(jnp.float64))
        # per example: example b's first call keeps cut_b steps (the rest padding), the second starts at cut_b
        cuts = np.array([5, 12])
        keep = np.arange(T) < cuts[:, None, None]
        _, state = jattn.log_linear_attention(**args, kv_mask=keep, mode="recurrent", return_state=True)
        rolled = {n: np.stack([np.roll(a[i], -c, axis=1) for i, c in enumerate(cuts)]) for n, a in args.items()}
        rest = jattn.log_linear_attention(**rolled, initial_state=state, start=cuts[:, None], mode="recurrent")
        for i, c in enumerate(cuts):
            np.testing.assert_allclose(rest[i, :, : T - c], whole[i, :, c:], **ref.tol(jnp.float64))


def _stateful(kind, seed=0):
    """Inputs whose initial state still counts at the end (mild decays), 7 levels (positions below 64)."""
    x = _inputs(seed)
    r = np.random.default_rng(seed + 10)
    args = _args(kind, x) | {"level_weights": r.uniform(0.2, 2.0, (B, N, T, 7))}
    if "g" in args:
        args["g"] = 0.05 * args["g"]
    return args, r.standard_normal((B, N, 7, D, E))


@pytest.mark.parametrize("start", [8, "per example"])
@pytest.mark.parametrize("kind", ["ssd", "gated deltanet"])
def test_chunk_form_with_states_equals_the_recurrent_form(kind, start):
    """initial_state at a start on the chunks, return_state: values, final level states and the gradients of every
    input (the initial state included) equal the recurrent form's (checked against the quadratic reference and
    by continuation above), with documents, padding, a dropped step and an example with no kept step."""
    with jax.enable_x64(True):
        args, state = _stateful(kind)
        args = {n: jnp.asarray(a) for n, a in args.items()} | {"initial_state": jnp.asarray(state)}
        start = np.array([8, 24])[:, None] if start == "per example" else start
        docs = _documents()
        w = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, T, E)))

        def run(args, mode, keep):
            out, last = jattn.log_linear_attention(
                **args, segment_ids=docs["segment_ids"], kv_mask=keep, start=start, return_state=True, mode=mode,
                chunk_size=4,
            )  # fmt: skip
            return out, last, jnp.sum(w * out) + jnp.sum(jnp.sin(last))

        for keep in (docs["kv_mask"], docs["kv_mask"] & np.array([True, False])[:, None, None]):
            got, want = run(args, "chunk", keep), run(args, "recurrent", keep)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, **ref.tol(jnp.float64))
        restarts = np.any(np.diff(docs["segment_ids"][1]) != 0)  # nothing kept: the states as they came, or zeros
        np.testing.assert_array_equal(want[1][1], 0.0 if restarts else args["initial_state"][1])
        grads = jax.grad(lambda a: run(a, "chunk", docs["kv_mask"])[2])(args)
        want = jax.grad(lambda a: run(a, "recurrent", docs["kv_mask"])[2])(args)
        assert np.max(np.abs(want["initial_state"])) > 1e-2  # the initial state reaches the outputs and the end
        for name in args:
            ref.assert_grad_close(grads[name], want[name], jnp.float64)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_weights_at_levels_no_key_reaches_are_not_read(mode):
    """NaN and inf at levels above ``bit_length(p)`` for position p change nothing: outputs, states, gradients.

    From position 0 (with and without states out) and from start 8 with an initial state; the weights poisoned
    are exactly those above each position's reach (per position, not only past the call's last level), and the
    outputs, final states and gradients equal those of the clean weights, which equal the quadratic reference.
    """
    with jax.enable_x64(True):
        args, state = _stateful("gated deltanet")
        args = {n: jnp.asarray(a) for n, a in args.items()}
        levels = args["level_weights"].shape[-1]
        for start, initial in [(0, None), (8, jnp.asarray(state))]:
            position = start + np.arange(T)
            unreached = np.arange(levels) > np.array([int(p).bit_length() for p in position])[:, None]  # (T, L)
            assert unreached.any() and not unreached[:, 0].any()
            poisoned = jnp.where(unreached, jnp.asarray([np.nan, np.inf])[np.arange(levels) % 2], args["level_weights"])

            def run(lam, start=start, initial=initial):
                out, last = jattn.log_linear_attention(
                    **(args | {"level_weights": lam}), start=start, initial_state=initial, return_state=True,
                    mode=mode, chunk_size=4,
                )  # fmt: skip
                return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.sin(last)), (out, last)

            (_, clean), clean_grad = jax.value_and_grad(run, has_aux=True)(args["level_weights"])
            (_, got), got_grad = jax.value_and_grad(run, has_aux=True)(poisoned)
            for a, b in zip(got, clean, strict=True):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(got_grad, clean_grad)
            assert not np.any(np.asarray(got_grad)[..., unreached])  # nothing flows to the unread weights
        plain = jattn.log_linear_attention(**(args | {"level_weights": poisoned}), mode=mode, chunk_size=4, start=8)
        np.testing.assert_allclose(
            jattn.log_linear_attention(**args, mode=mode, chunk_size=4, start=8), plain, **ref.tol(jnp.float64)
        )


@pytest.mark.parametrize("kind", ["ssd", "gated deltanet"])
def test_two_chunk_calls_passing_the_state_equal_one_call(kind):
    """Cut at a chunk boundary (the first part ending on a kept step): outputs and final states of one call."""
    with jax.enable_x64(True):
        args, _ = _stateful(kind)
        docs = _documents()

        def part(x, cut, end):
            return x[..., cut:end, :] if x.ndim == 4 else x[..., cut:end]

        whole, final = jattn.log_linear_attention(**args, **docs, return_state=True, chunk_size=4)
        for cut in (8, 16):
            head = {n: part(a, 0, cut) for n, a in args.items()}
            tail = {n: part(a, cut, T) for n, a in args.items()}
            first, state = jattn.log_linear_attention(
                **head, **{n: x[..., :cut] for n, x in docs.items()}, return_state=True, chunk_size=4
            )
            second, last = jattn.log_linear_attention(
                **tail, **{n: x[..., cut:] for n, x in docs.items()}, initial_state=state, start=cut,
                return_state=True, chunk_size=4,
            )  # fmt: skip
            np.testing.assert_allclose(np.concatenate([first, second], -2), whole, **ref.tol(jnp.float64))
            np.testing.assert_allclose(last, final, **ref.tol(jnp.float64))


def test_jit_and_vmap_agree_with_eager_and_a_loop():
    x = {n: jnp.asarray(a, jnp.float32) for n, a in _args("ssd", _inputs()).items()}
    eager = jattn.log_linear_attention(**x, chunk_size=8)
    jitted = jax.jit(lambda x: jattn.log_linear_attention(**x, chunk_size=8))(x)
    np.testing.assert_allclose(jitted, eager, **ref.tol(jnp.float32))
    mapped = jax.vmap(lambda x: jattn.log_linear_attention(**x, chunk_size=8))(x)
    looped = np.stack([jattn.log_linear_attention(**{n: a[i] for n, a in x.items()}, chunk_size=8) for i in range(B)])
    np.testing.assert_allclose(mapped, looped, **ref.tol(jnp.float32))


def test_bad_arguments_are_named():
    x = _args("ssd", _inputs(dtype=np.float32))
    with pytest.raises(ValueError, match="power of 2"):
        jattn.log_linear_attention(**x, chunk_size=6)
    with pytest.raises(ValueError, match=r"L >= 6 levels.*\(2, 3, 29, 3\)"):
        jattn.log_linear_attention(**x | {"level_weights": x["level_weights"][..., :3]})
    with pytest.raises(ValueError, match=r"start to be a multiple of chunk_size=8.*start=12.*mode='recurrent'"):
        jattn.log_linear_attention(**x | {"level_weights": np.ones((T, 7), np.float32)}, chunk_size=8, start=12)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        jattn.log_linear_attention(**x, mode="recurrent", initial_state=np.zeros((L, D, E), np.float32))
    with pytest.raises(TypeError, match="level_weights must be floating"):
        jattn.log_linear_attention(**x | {"level_weights": np.ones((T, L), np.int32)})
    with pytest.raises(ValueError, match="g is a log decay"):
        jattn.log_linear_attention(**x | {"g": np.ones((B, N, T), np.float32)})


# -- the modules' log kinds ------------------------------------------------------------------------------------

F_MODEL, HEADS = 24, 3  # head depth 8


def _module_reference(kind, m, x):
    """The module's output in float64 NumPy: projections, the kind's gates from its parameters, :func:`quadratic`."""
    p = {name: np.asarray(getattr(m, name)[...], np.float64) for name in m.gate_names}
    x = np.asarray(x, np.float64)
    b, t = x.shape[:2]
    softplus = lambda z: np.logaddexp(0.0, z)  # noqa: E731
    split = lambda y: y.reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731  (B, T, N·X) -> (B, N, T, X)
    q, k, v = (split(x @ np.asarray(getattr(m, w).kernel[...], np.float64)) for w in ("wq", "wk", "wv"))
    if kind == "log_gated_deltanet":  # SiLU, then an L2 norm over the head depth
        q, k = (y / (1 + np.exp(-y)) for y in (q, k))
        q, k = (y / np.sqrt(np.sum(y**2, -1, keepdims=True) + 1e-6) for y in (q, k))
    g = np.moveaxis(-np.exp(p["a_log"]) * softplus(x @ p["w_dt"] + p["dt_bias"]), -1, -2)
    beta = np.moveaxis(1 / (1 + np.exp(-(x @ p["w_beta"]))), -1, -2) if kind == "log_gated_deltanet" else None
    lam = split(softplus((x @ p["w_level"]).reshape(b, t, HEADS, -1) * p["level_scale"]).reshape(b, t, -1))
    out = quadratic(q, k, v, lam, g, beta)
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1) @ np.asarray(m.wo.kernel[...], np.float64)


@pytest.mark.parametrize("kind", ["log_ssd", "log_gated_deltanet"])
def test_each_log_kind_equals_its_gates_written_out(kind):
    """A float64 NNX module against NumPy (its parameters, the paper's level weights, the quadratic reference), to
    1e-12; Linen with the same parameters equals it."""
    from flax import nnx

    with jax.enable_x64(True):
        m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 11, F_MODEL), jnp.float64)
        got = m(x)
        np.testing.assert_allclose(got, _module_reference(kind, m, x), **ref.tol(jnp.float64))
        linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, param_dtype=jnp.float64)
        np.testing.assert_allclose(linen.apply({"params": ref.linen_params(m)}, x), got, **ref.tol(jnp.float64))


@pytest.mark.parametrize("kind", ["log_ssd", "log_gated_deltanet"])
def test_log_kind_decoding_from_the_cache_equals_the_full_pass(kind):
    """NNX: a prompt of 5 then token by token; Linen: token by token; the cache holds the level states."""
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 13, F_MODEL))
    full = m(x)
    m.init_cache(2, 13)
    assert m.cache["state"][...].shape == (2, HEADS, 1, 5, 8, 8)  # bit_length(12) + 1 = 5 levels
    pieces = [m(x[:, :5], decode=True)] + [m(x[:, t : t + 1], decode=True) for t in range(5, 13)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **ref.tol(jnp.float32))
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=kind)
    cache = linen.init(jax.random.key(0), 2, 13, method="init_cache")["cache"]
    outs = []
    for t in range(13):
        y, state = linen.apply(
            {"params": ref.linen_params(m), "cache": cache}, x[:, t : t + 1], decode=True, mutable=["cache"]
        )
        outs.append(y)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, **ref.tol(jnp.float32))


def test_positions_past_the_levels_raise_or_give_nan():
    """Eager: a start whose positions need more levels than given raises; traced (jit): that sequence is NaN."""
    x = {n: a[..., :3, :] if a.ndim == 4 else a[..., :3] for n, a in _args("ssd", _inputs(dtype=np.float32)).items()}
    x["level_weights"] = x["level_weights"][..., :4]  # positions below 8
    with pytest.raises(ValueError, match=r"L >= 5 levels"):
        jattn.log_linear_attention(**x, mode="recurrent", start=6)
    run = jax.jit(lambda s: jattn.log_linear_attention(**x, mode="recurrent", start=s))
    out = run(jnp.asarray([[5], [4]], jnp.int32))  # positions up to 7 and 6: 4 levels hold them
    assert np.all(np.isfinite(out))
    out = run(jnp.asarray([[5], [6]], jnp.int32))  # example 1 reaches position 8: needs a fifth level
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


def test_a_log_kind_cache_refuses_positions_past_its_levels():
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="log_ssd", rngs=nnx.Rngs(0))
    m.init_cache(2, 4)  # positions below 4: 3 levels
    x = jax.random.normal(jax.random.key(1), (2, 5, F_MODEL))
    with pytest.raises(ValueError, match="decoding past the log kind's cache levels"):
        m(x, decode=True)
