"""DeltaProduct (``gated_linear_attention(num_householder=n)``) against explicit Householder products in float64.

The tests every kind passes are :class:`tests.linear_family.LinearFamilyTests`, run here over the rows
``gated deltaproduct`` and ``deltaproduct`` (3 Householder steps a token; T = 13 tokens, 39 sub-steps): both forms
(chunks of 8 and 16) and the gradients against the explicit-product float64 reference (and its hand-written
adjoint, confirmed by central differences of the NumPy loop), float32 at T = 2048, decoding in pieces, jit
and vmap, the module kinds ``gated_deltaproduct`` and ``deltaproduct`` written out and decoding from their cache.
Beside them the special cases: one Householder step is the delta rule, bad arguments, the modules' option.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests import reference as ref
from tests.linear_family import DELTAPRODUCT_KINDS, F_MODEL, HEADS, LinearFamilyTests, as_jax, documents

B, N, T, D, E, NH = 2, 3, 13, 5, 7, 3  # the rows' sizes: distinct; T·NH = 39 sub-steps, not a multiple of the chunks


class TestHouseholderKinds(LinearFamilyTests):
    KINDS = DELTAPRODUCT_KINDS


def test_one_householder_step_is_the_delta_rule():
    """n_h = 1 is Gated DeltaNet (the float64 delta-rule loop), and n_h = 2 with the second betas 0 is too."""
    with jax.enable_x64(True):
        args = as_jax(DELTAPRODUCT_KINDS[0].example())  # gated: q, k, v, beta, g and an initial state
        q, state, kw = args["q"], args["initial_state"], {"g": args["g"], "beta": args["beta"][..., ::NH]}
        k, v = args["k"][..., ::NH, :], args["v"][..., ::NH, :]  # one key and value a token
        docs = documents(T, 4)
        want, _ = ref.gated_linear(q, k, v, **kw, **docs, state=state)
        np.testing.assert_allclose(
            ref.delta_product(q, k, v, kw["beta"], 1, g=kw["g"], **docs, state=state)[0], want, rtol=1e-13
        )
        r = np.random.default_rng(9)
        k2 = jnp.stack([k, jnp.asarray(r.standard_normal(k.shape))], axis=-2).reshape(B, N, 2 * T, D)
        v2 = jnp.stack([v, jnp.asarray(r.standard_normal(v.shape))], axis=-2).reshape(B, N, 2 * T, E)
        beta2 = jnp.stack([kw["beta"], jnp.zeros_like(kw["beta"])], axis=-1).reshape(B, N, 2 * T)

        def both(q, k, v, k2, v2, beta2, kw, state):
            one = jattn.gated_linear_attention(q, k, v, **kw, num_householder=1, **docs, initial_state=state)
            two = jattn.gated_linear_attention(
                q, k2, v2, g=kw["g"], beta=beta2, num_householder=2, **docs, initial_state=state, chunk_size=8
            )
            return one, two

        for out in jax.jit(both)(q, k, v, k2, v2, beta2, kw, state):
            np.testing.assert_allclose(out, want, **ref.tol(jnp.float64))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(k=np.zeros((2, 4, 5))), r"with num_householder=2, k has n_h sub-steps a token.*T·n_h = 6.*\(2, 4, 5\)"),
        (dict(beta=np.zeros((2, 5))), r"beta has n_h sub-steps.*T·n_h = 6.*\(2, 5\)"),
        (dict(beta=None), r"num_householder=2 takes the delta rule's beta"),
        (dict(g=np.zeros((2, 6))), r"g is per token: it must broadcast to \(\.\.\., T=3\), got shape \(2, 6\)"),
        (dict(kv_mask=np.ones(6, bool)), r"kv_mask is per token: it must have shape \(\.\.\., T=3\).*\(6,\)"),
        (dict(num_householder=0), r"num_householder"),
        (dict(gk=np.zeros((2, 3, 5))), r"not per key feature \(gk\)"),
    ],
)
def test_bad_arguments_are_named(kw, match):
    args = dict(q=np.zeros((2, 3, 5)), k=np.zeros((2, 6, 5)), v=np.zeros((2, 6, 4)), beta=np.full((2, 6), 0.5))
    with pytest.raises(ValueError, match=match):
        jattn.gated_linear_attention(**(args | {"num_householder": 2} | kw))


# -- the modules' kinds 'deltaproduct' and 'gated_deltaproduct' ---------------------------------------------
# Written out ((n h d) projections, SiLU + L2 keys, sigmoid betas, SSD gate, the loop; NNX float32 and float64,
# Linen) and decoding from their cache: the rows' module tests above.


def test_num_householder_is_the_deltaproduct_kinds_own():
    from flax import nnx

    with pytest.raises(
        ValueError, match=r"num_householder is DeltaProduct's.*kind='gated_deltanet'.*num_householder=2"
    ):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="gated_deltanet", num_householder=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_householder"):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind="deltaproduct", num_householder=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kind='deltaproduct' is causal self-attention"):
        jattn.nnx.CrossAttention(F_MODEL, 7, num_heads=HEADS, kind="deltaproduct", rngs=nnx.Rngs(0))
