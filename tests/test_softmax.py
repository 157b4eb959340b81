"""The softmax's stable parts against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import jattn
from tests import reference as ref


@given(st.integers(1, 4), st.integers(1, 11), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 30.0, 1e30]))
def test_parts_match_reference(rows, cols, seed, magnitude):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, cols)) * magnitude
    where = rng.random((rows, cols)) < 0.7
    where[0] = False  # an empty row

    @jax.jit  # one program an example
    def run(x, where):
        parts = jattn.softmax_parts(x, where)
        return parts.weights(), parts.logsumexp(), parts.exp, parts.sum, jattn.softmax(x[1:])

    weights, lse, exp, total, plain = run(jnp.asarray(x, jnp.float32), jnp.asarray(where))
    want, want_lse, _ = ref.softmax(np.asarray(jnp.asarray(x, jnp.float32), np.float64), where)
    np.testing.assert_allclose(weights, want, **ref.tol(jnp.float32))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert np.all(np.asarray(exp)[~where] == 0.0) and np.all(np.asarray(exp) <= 1.0)
    np.testing.assert_array_equal(np.asarray(total)[0], 0.0)
    np.testing.assert_allclose(plain, ref.softmax(x[1:])[0], atol=1e-6)


def test_gradient_ignores_masked_entries_even_when_nan():
    x = jnp.array([[1.0, jnp.nan, 2.0, jnp.inf], [jnp.nan, jnp.nan, jnp.nan, jnp.nan]])
    where = jnp.array([[True, False, True, False], [False, False, False, False]])
    w, g = jax.jit(
        lambda x: (
            jattn.softmax(x, where),
            jax.grad(lambda x: jnp.sum(jattn.softmax(x, where) * jnp.arange(4.0)[None]))(x),
        )
    )(x)
    np.testing.assert_allclose(w[0], [1 / (1 + np.e), 0, np.e / (1 + np.e), 0], rtol=1e-6)
    np.testing.assert_array_equal(w[1], 0.0)
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~np.asarray(where)] == 0.0)


def test_nan_at_kept_entry_propagates_to_row():
    w = jattn.softmax(jnp.array([[1.0, jnp.nan, 2.0], [1.0, 2.0, 3.0]]))
    assert np.all(np.isnan(w[0])) and np.all(np.isfinite(w[1]))
