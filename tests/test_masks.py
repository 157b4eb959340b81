"""Mask predicates against literal masks, block classification against the dense mask, and the
core with mask objects against the float64 reference with the materialised mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jattn
from jattn import masks
from tests import reference as ref


def rows(text: str) -> np.ndarray:
    return np.array([[c == "#" for c in line.strip()] for line in text.strip().splitlines()])


LITERAL = [
    (masks.causal(), 4, 4, "#...\n##..\n###.\n####"),
    # T < S: bottom-right alignment, the last query sees every key (a KV cache's newest tokens).
    (masks.causal(), 2, 5, "####.\n#####"),
    (masks.sliding_window(1), 5, 5, "#....\n##...\n.##..\n..##.\n...##"),
    (masks.sliding_window(1, 2), 5, 5, "###..\n####.\n.####\n..###\n...##"),
    (masks.global_tokens([0, 3]), 5, 5, "#####\n#..#.\n#..#.\n#####\n#..#."),
    (masks.chunked(2), 5, 5, "##...\n##...\n..##.\n..##.\n....#"),
    (masks.prefix_lm(3), 5, 5, "###..\n###..\n###..\n####.\n#####"),
    (masks.sliding_window(1, 1) | masks.global_tokens([0]), 6, 6, "######\n###...\n####..\n#.###.\n#..###\n#...##"),
    (masks.causal() & masks.sliding_window(2), 5, 5, "#....\n##...\n###..\n.###.\n..###"),
    (masks.causal() & ~masks.chunked(2), 4, 4, "....\n....\n##..\n##.."),
    # The renderings shown in README.md.
    (masks.sliding_window(2), 6, 6, "#.....\n##....\n###...\n.###..\n..###.\n...###"),
    (
        masks.causal() & (masks.sliding_window(2) | masks.global_tokens([0])),
        6,
        6,
        "#.....\n##....\n###...\n####..\n#.###.\n#..###",
    ),
    (masks.chunked(3), 6, 6, "###...\n###...\n###...\n...###\n...###\n...###"),
    (
        masks.causal() & masks.segment_ids(jnp.array([[0, 0, 0, 1, 1, 1]])),
        6,
        6,
        "#.....\n##....\n###...\n...#..\n...##.\n...###",
    ),
    (masks.padding(kv_lengths=jnp.array([4])), 3, 6, "####..\n####..\n####.."),
]


@pytest.mark.parametrize(("mask", "T", "S", "want"), LITERAL)
def test_predicates_against_literal_masks(mask, T, S, want):
    dense = mask.dense(T, S)  # (T, S), or (1, 1, T, S) for a per-example mask of one example
    np.testing.assert_array_equal(dense.reshape(T, S), rows(want))
    assert mask.render(T, S) == want


def test_offsets_and_per_example_masks():
    # Queries at positions 3, 4 of 6 keys, as in a decode step.
    np.testing.assert_array_equal(masks.causal().dense(2, 6, q_offset=3), rows("####..\n#####."))
    per = masks.causal().dense(1, 4, q_offset=jnp.array([0, 2]))  # (B, 1, T, S)
    np.testing.assert_array_equal(per[:, 0, 0], rows("#...\n###."))
    pad = (masks.causal() & masks.padding(kv_lengths=jnp.array([2, 4]))).dense(3, 4)
    assert pad.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(pad[0, 0], rows("##..\n##..\n##.."))
    np.testing.assert_array_equal(pad[1, 0], rows("##..\n###.\n####"))
    qpad = masks.padding(q_lengths=jnp.array([1]), kv_lengths=jnp.array([3])).dense(2, 4)
    np.testing.assert_array_equal(qpad[0, 0], rows("###.\n...."))
    seg = masks.segment_ids(jnp.array([[0, 0, 1, 1, 2]])).dense(5, 5)
    np.testing.assert_array_equal(seg[0, 0], rows("##...\n##...\n..##.\n..##.\n....#"))
    doc = (masks.causal() & masks.segment_ids(jnp.array([[0, 0, 1, 1, 1]]))).dense(5, 5)
    np.testing.assert_array_equal(doc[0, 0], rows("#....\n##...\n..#..\n..##.\n..###"))


def test_bad_mask_arguments():
    with pytest.raises(ValueError, match="sliding_window left must be a non-negative int, got -1"):
        masks.sliding_window(-1)
    with pytest.raises(ValueError, match="chunked size must be a positive int, got 0"):
        masks.chunked(0)
    with pytest.raises(ValueError, match=r"padding kv_lengths must have shape \(B,\), got \(2, 2\)"):
        masks.padding(kv_lengths=jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids q_segments must have shape \(B, T\)"):
        masks.segment_ids(jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match="masks combine only with masks or boolean arrays"):
        masks.causal() & 3
    with pytest.raises(TypeError, match="mask must be boolean"):
        masks.causal() & jnp.ones((2, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"q_offset and kv_offset place a jattn\.masks predicate"):
        jattn.attention(jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones((3, 2)), mask=jnp.ones((3, 3), bool), q_offset=1)


# The types one constructor call makes (prefix_lm's is a combination): the primitive masks, which
# classify blocks exactly; a combination by &, | or ~ of them is another type.
PRIMITIVES = {type(m) for m in (masks.causal(), masks.sliding_window(1), masks.chunked(2), masks.global_tokens([0]))}


@given(
    ref.static_masks(), st.integers(1, 20), st.integers(1, 20), st.integers(1, 6), st.integers(1, 6), st.integers(0, 5)
)
def test_block_kinds_agree_with_dense_mask(mask, T, S, bq, bk, shift):
    q_offset = S - T + shift - 2
    kinds = mask.block_kinds(T, S, bq, bk, q_offset=q_offset)
    dense = np.asarray(jax.jit(lambda: mask.dense(T, S, q_offset=q_offset))())  # one program an example
    assert kinds.shape == (-(-T // bq), -(-S // bk))
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            block = dense[a * bq : (a + 1) * bq, b * bk : (b + 1) * bk]
            if kinds[a, b] == masks.EMPTY:
                assert not block.any()
            elif kinds[a, b] == masks.FULL:
                assert block.all()
            elif type(mask) in PRIMITIVES:
                assert block.any() and not block.all()  # the primitives classify exactly


def test_causal_blocks_halve_the_work():
    kinds = masks.causal().block_kinds(1024, 1024, 128, 128)
    assert (kinds == masks.EMPTY).sum() == 28 and (kinds == masks.PARTIAL).sum() == 8
    window = masks.sliding_window(128).block_kinds(4096, 4096, 128, 128)
    assert ((window != masks.EMPTY).sum(1) <= 2).all()  # O(T·w): two key blocks per query block


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(),
        masks.sliding_window(2, 1) | masks.global_tokens([0]),
        masks.prefix_lm(4) & masks.padding(kv_lengths=jnp.array([6, 9])),
        masks.causal() & masks.segment_ids(jnp.array([[0] * 5 + [1] * 4, [0] * 9])),
        ~masks.chunked(3),
    ],
)
def test_core_with_mask_objects_matches_reference_forward_and_gradients(mask):
    B, N, T, D = 2, 3, 9, 5
    q, k, v = (jax.random.normal(jax.random.key(i), (B, N, T, D)) for i in range(3))
    dense = np.asarray(mask.dense(T, T))

    def loss(q, k, v, mask):
        return jnp.sum(jnp.sin(jattn.attention(q, k, v, mask=mask)))

    @jax.jit
    def run(q, k, v):
        grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, m) for m in (mask, dense)]
        return jattn.attention(q, k, v, mask=mask), *grads

    out, g, g_dense = run(q, k, v)
    want, _, _ = ref.attention(q, k, v, mask=dense)
    np.testing.assert_allclose(out, want, **ref.tol(jnp.float32))
    for a, b in zip(g, g_dense, strict=True):
        np.testing.assert_allclose(a, b, **ref.tol(jnp.float32))
