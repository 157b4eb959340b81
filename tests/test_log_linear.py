"""jattn.log_linear_attention: both forms against a quadratic float64 reference with explicit Fenwick buckets.

The tests every kind passes are :class:`tests.linear_family.LinearFamilyTests`, run here over the rows
``LOG_KINDS`` (log-linear attention over linear attention, SSD, DeltaNet and Gated DeltaNet): both forms and the
gradients (level weights and gates included) against :func:`tests.linear_family.quadratic`, the reference computed
pair by pair with the paper's bucket recursion (and its hand-written adjoint), with documents, padding and a dropped
step; float32 at T = 2048;
decoding in pieces (level states and positions passed on); jit and vmap; the module kinds ``log_ssd`` and
``log_gated_deltanet`` written out and decoding from their cache. Beside them the special cases: the buckets are
the Fenwick levels, unit level weights give the base kind, the level states carried between calls and through the
chunk form, weights at unreached levels are not read, bad arguments, positions past the levels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref
from tests.linear_family import F_MODEL, HEADS, LOG_KINDS, LinearFamilyTests, as_jax, bucket, documents

B, N, T, D, E = 2, 3, 29, 4, 5  # the rows' sizes: distinct; T is not a multiple of the chunks
L = 6  # bit_length(T - 1) + 1 = 6 levels (the rows give one more, not read)
KINDS = {kind.name.removeprefix("log "): kind for kind in LOG_KINDS}  # linear, ssd, deltanet, gated deltanet
MODES = ("chunk", "recurrent")


class TestLogLinearKinds(LinearFamilyTests):
    KINDS = LOG_KINDS


def _args(kind, seed=0, dtype=np.float64):
    """The row's q, k, v, level weights (7 levels) and gates as NumPy ``dtype``."""
    return {n: x.astype(dtype) for n, x in KINDS[kind].example(seed=seed).items()}


def _documents():
    """Segment ids, padding and a dropped step (tests.linear_family.documents)."""
    return documents(T, 6)


def _part(x, t0, t1):
    return x[..., t0:t1, :] if x.ndim == 4 else x[..., t0:t1]


def test_the_buckets_are_the_fenwick_levels_and_partition_the_prefix():
    """The reference's recursion gives bit_length(t ^ s); level ℓ >= 1 holds 2^(ℓ-1) keys or none."""
    for t in range(70):
        levels = [bucket(t, s) for s in range(t + 1)]
        assert levels == [(t ^ s).bit_length() for s in range(t + 1)]
        for ell in range(1, 8):
            assert levels.count(ell) in (0, 2 ** (ell - 1)), (t, ell)


@pytest.mark.parametrize("kind", KINDS)
def test_unit_level_weights_give_the_base_kind(kind):
    """Every λ = 1: the levels add up to gated_linear_attention's one state (documents and padding too), both forms."""
    with jax.enable_x64(True):
        x, docs = _args(kind), _documents()

        def run(args, lam):
            base = {n: a for n, a in args.items() if n != "level_weights"}
            got = [jattn.log_linear_attention(**args, **docs, mode=mode, chunk_size=8) for mode in MODES]
            want = jattn.gated_linear_attention(**base, **docs, mode="recurrent")
            other = jattn.log_linear_attention(**args | {"level_weights": lam}, **docs, chunk_size=8)
            return got, want, other

        args = as_jax(x | {"level_weights": np.ones((T, L))})
        got, want, other = jax.jit(run)(args, jnp.asarray(x["level_weights"]))
        for out, mode in zip(got, MODES, strict=True):
            np.testing.assert_allclose(out, want, **ref.tol(jnp.float64), err_msg=mode)
        assert np.max(np.abs(other - want)) > 1e-2  # the levels' weights matter: the property could fail


def test_recurrent_state_continues_a_sequence():
    """Two recurrent calls, the second from the first's level states at its position, equal one chunked call;
    so does a per-example start (each example split at its own step)."""
    with jax.enable_x64(True):
        args = as_jax(_args("gated deltanet"))
        cuts = np.array([5, 12])  # per example: example b's first call keeps cut_b steps, the second starts there
        keep = np.arange(T) < cuts[:, None, None]

        def run(args):
            whole = jattn.log_linear_attention(**args, chunk_size=4)
            joined = []
            for cut in (1, 8, 13):
                head = {n: _part(a, 0, cut) for n, a in args.items()}
                tail = {n: _part(a, cut, T) for n, a in args.items()}
                first, state = jattn.log_linear_attention(**head, mode="recurrent", return_state=True)
                second = jattn.log_linear_attention(**tail, mode="recurrent", initial_state=state, start=cut)
                joined.append(jnp.concatenate([first, second], -2))
            _, state = jattn.log_linear_attention(**args, kv_mask=keep, mode="recurrent", return_state=True)
            rolled = {n: jnp.stack([jnp.roll(a[i], -c, axis=1) for i, c in enumerate(cuts)]) for n, a in args.items()}
            rest = jattn.log_linear_attention(**rolled, initial_state=state, start=cuts[:, None], mode="recurrent")
            return whole, joined, rest

        whole, joined, rest = jax.jit(run)(args)
        for got in joined:
            np.testing.assert_allclose(got, whole, **ref.tol(jnp.float64))
        for i, c in enumerate(cuts):
            np.testing.assert_allclose(rest[i, :, : T - c], whole[i, :, c:], **ref.tol(jnp.float64))


def _stateful(kind, seed=0):
    """Inputs whose initial state still counts at the end (mild decays), 7 levels (positions below 64)."""
    args = _args(kind, seed)
    if "g" in args:
        args["g"] = 0.05 * args["g"]
    return args, np.random.default_rng(seed + 10).standard_normal((B, N, 7, D, E))


@pytest.mark.parametrize("start", [8, "per example"])
@pytest.mark.parametrize("kind", ["ssd", "gated deltanet"])
def test_chunk_form_with_states_equals_the_recurrent_form(kind, start):
    """initial_state at a start on the chunks, return_state: values, final level states and the gradients of every
    input (the initial state included) equal the recurrent form's (checked against the quadratic reference and
    by continuation above), with documents, padding, a dropped step and an example with no kept step."""
    with jax.enable_x64(True):
        args, state = _stateful(kind)
        args = as_jax(args | {"initial_state": state})
        start = np.array([8, 24])[:, None] if start == "per example" else start
        docs = _documents()
        w = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, T, E)))
        keeps = (docs["kv_mask"], docs["kv_mask"] & np.array([True, False])[:, None, None])

        def run(args, mode, keep):
            out, last = jattn.log_linear_attention(
                **args, segment_ids=docs["segment_ids"], kv_mask=keep, start=start, return_state=True, mode=mode,
                chunk_size=4,
            )  # fmt: skip
            return out, last, jnp.sum(w * out) + jnp.sum(jnp.sin(last))

        def everything(args):
            forms = [(run(args, "chunk", keep), run(args, "recurrent", keep)) for keep in keeps]
            grads = [jax.grad(lambda a, m=m: run(a, m, docs["kv_mask"])[2])(args) for m in MODES]
            return forms, grads

        forms, (grads, want_grads) = jax.jit(everything)(args)
        for got, want in forms:
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, **ref.tol(jnp.float64))
        restarts = np.any(np.diff(docs["segment_ids"][1]) != 0)  # nothing kept: the states as they came, or zeros
        np.testing.assert_array_equal(want[1][1], 0.0 if restarts else args["initial_state"][1])
        assert np.max(np.abs(want_grads["initial_state"])) > 1e-2  # the initial state reaches the outputs and the end
        for name in args:
            ref.assert_grad_close(grads[name], want_grads[name], jnp.float64)


@pytest.mark.parametrize("mode", MODES)
def test_weights_at_levels_no_key_reaches_are_not_read(mode):
    """NaN and inf at levels above ``bit_length(p)`` for position p change nothing: outputs, states, gradients.

    From position 0 (with and without states out) and from start 8 with an initial state; the weights poisoned
    are exactly those above each position's reach (per position, not only past the call's last level), and the
    outputs, final states and gradients equal those of the clean weights, which equal the quadratic reference.
    """
    with jax.enable_x64(True):
        args, state = _stateful("gated deltanet")
        args = as_jax(args)
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

            both = jax.jit(
                lambda clean, poisoned, run=run: [
                    jax.value_and_grad(run, has_aux=True)(lam) for lam in (clean, poisoned)
                ]
            )
            ((_, clean), clean_grad), ((_, got), got_grad) = both(args["level_weights"], poisoned)
            for a, b in zip(got, clean, strict=True):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(got_grad, clean_grad)
            assert not np.any(np.asarray(got_grad)[..., unreached])  # nothing flows to the unread weights
        plain = jax.jit(
            lambda lam: jattn.log_linear_attention(**(args | {"level_weights": lam}), mode=mode, chunk_size=4, start=8)
        )
        np.testing.assert_allclose(plain(args["level_weights"]), plain(poisoned), **ref.tol(jnp.float64))


@pytest.mark.parametrize("kind", ["ssd", "gated deltanet"])
def test_two_chunk_calls_passing_the_state_equal_one_call(kind):
    """Cut at a chunk boundary (the first part ending on a kept step): outputs and final states of one call."""
    with jax.enable_x64(True):
        args, _ = _stateful(kind)
        docs = _documents()

        def run(args):
            whole = jattn.log_linear_attention(**args, **docs, return_state=True, chunk_size=4)
            joined = []
            for cut in (8, 16):
                head, tail = ({n: _part(a, *steps) for n, a in args.items()} for steps in ((0, cut), (cut, T)))
                first, state = jattn.log_linear_attention(
                    **head, **{n: x[..., :cut] for n, x in docs.items()}, return_state=True, chunk_size=4
                )
                second, last = jattn.log_linear_attention(
                    **tail, **{n: x[..., cut:] for n, x in docs.items()}, initial_state=state, start=cut,
                    return_state=True, chunk_size=4,
                )  # fmt: skip
                joined.append((jnp.concatenate([first, second], -2), last))
            return whole, joined

        (whole, final), joined = jax.jit(run)(as_jax(args))
        for out, last in joined:
            np.testing.assert_allclose(out, whole, **ref.tol(jnp.float64))
            np.testing.assert_allclose(last, final, **ref.tol(jnp.float64))


def test_bad_arguments_are_named():
    x = _args("ssd", dtype=np.float32)
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
# Written out (NNX float32 and float64, Linen; the paper's level weights, the quadratic reference) and decoding
# from their cache: the rows' module tests above.


def test_a_log_kind_cache_holds_a_state_per_level():
    from flax import nnx

    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="log_ssd", rngs=nnx.Rngs(0))
    m.init_cache(2, 13)
    assert m.cache["state"][...].shape == (2, HEADS, 1, 5, 8, 8)  # bit_length(12) + 1 = 5 levels


def test_positions_past_the_levels_raise_or_give_nan():
    """Eager: a start whose positions need more levels than given raises; traced (jit): that sequence is NaN."""
    x = {n: a[..., :3, :] if a.ndim == 4 else a[..., :3] for n, a in _args("ssd", dtype=np.float32).items()}
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
