"""Batch invariance of paged attention's fused CPU path: a request's output and lse are bitwise the same whatever
else is in the batch, wherever it sits, wherever its pages are and however its tokens arrive, and equal to
``jattn.attention``'s fused forward over the whole sequence (the training forward); split-KV changes no bit."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks
from tests import reference as ref

N, K, D, E = 6, 2, 24, 20  # G = 3; D != E != N
MASKS = {
    "causal": masks.causal(),
    "window": masks.sliding_window(70),
    "causal & window": masks.causal() & masks.sliding_window(300),
}


def _takes_fused() -> bool:
    q, kp = jnp.zeros((1, N, D)), jnp.zeros((1, 16, K, D))
    try:
        jattn.paged_attention(q, kp, jnp.zeros((1, 16, K, E)), jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32),
                              jnp.array([0, 1], jnp.int32), implementation="fused")  # fmt: skip
    except ValueError:
        return False
    return True


fused_only = pytest.mark.skipif(not _takes_fused(), reason="the fused CPU kernels are not built here")


class Sequences:
    """Each request's whole sequence (queries, keys, values at positions 0..L-1), float32."""

    def __init__(self, lengths, seed):
        rng = np.random.default_rng(seed)
        self.lengths = list(lengths)
        self.q = [rng.standard_normal((n, N, D), np.float32) for n in lengths]
        self.k = [rng.standard_normal((n, K, D), np.float32) for n in lengths]
        self.v = [rng.standard_normal((n, K, E), np.float32) for n in lengths]
        self.rng = rng

    def pool(self, Z):
        """k_pages, v_pages, page_table holding every request's whole sequence on shuffled pages (and spares)."""
        pages = [-(-n // Z) for n in self.lengths]
        P = sum(pages) + 3
        order = self.rng.permutation(P)
        kp = self.rng.standard_normal((P, Z, K, D), np.float32)  # garbage past each request's keys
        vp = self.rng.standard_normal((P, Z, K, E), np.float32)
        table = np.full((len(pages), max(pages)), -7, np.int32)  # unused entries out of range: never read
        at = 0
        for r, n in enumerate(self.lengths):
            for j in range(pages[r]):
                rows = slice(j * Z, min((j + 1) * Z, n))
                kp[order[at], : rows.stop - rows.start], vp[order[at], : rows.stop - rows.start] = (
                    self.k[r][rows],
                    self.v[r][rows],
                )
                table[r, j] = order[at]
                at += 1
        self.pages = kp, vp, table

    def step(self, spans, mask):
        """One ragged call: request r's query positions ``spans[r] = (a, b)`` (its keys 0..b-1), for the requests of
        ``spans``; the others ride along with no tokens. The batch's order and the pages' places are shuffled;
        Q is padded to a power of 2. Returns each request's ``(out, lse)`` rows."""
        kp, vp, table = self.pages
        move = self.rng.permutation(kp.shape[0])  # page p goes to place move[p]
        kp, vp = np.empty_like(kp), np.empty_like(vp)
        kp[move], vp[move] = self.pages[0], self.pages[1]
        table = np.where(table >= 0, move[np.maximum(table, 0)], table)
        order = self.rng.permutation(len(self.lengths))
        a, b = (np.array([spans.get(r, (0, 0))[i] for r in order]) for i in (0, 1))
        q = np.concatenate([self.q[r][a[i] : b[i]] for i, r in enumerate(order)])
        cu = np.concatenate([[0], np.cumsum(b - a)]).astype(np.int32)
        q = np.concatenate([q, self.rng.standard_normal(((1 << len(q).bit_length()) - len(q), N, D), np.float32)])
        out, lse = jattn.paged_attention(
            q, kp, vp, table[order], b.astype(np.int32), cu, mask=mask, return_lse=True, implementation="fused"
        )
        out, lse = np.asarray(out), np.asarray(lse)
        assert not out[cu[-1] :].any() and np.all(lse[cu[-1] :] == -np.inf)  # padding tokens
        return {r: (out[cu[i] : cu[i + 1]], lse[cu[i] : cu[i + 1]]) for i, r in enumerate(order) if r in spans}

    def training(self, r, mask):
        """``jattn.attention``'s fused forward over request r's whole sequence: out (L, N, E), lse (L, N)."""
        n = self.lengths[r]
        q = self.q[r].transpose(1, 0, 2).reshape(1, K, N // K, n, D)
        k, v = (x.transpose(1, 0, 2)[None, :, None] for x in (self.k[r], self.v[r]))
        out, lse = jattn.attention(q, k, v, mask=mask, return_lse=True, implementation="blockwise")
        return np.asarray(out).reshape(N, n, E).transpose(1, 0, 2), np.asarray(lse).reshape(N, n).T


def _chunks(rng, n, largest):
    """Random cut points 0 = c0 < c1 < ... = n with pieces of 1 to ``largest`` tokens."""
    cuts, at = [0], 0
    while at < n:
        at = min(n, at + int(rng.integers(1, largest + 1)))
        cuts.append(at)
    return cuts


@fused_only
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask", list(MASKS))
def test_every_arrival_gives_the_training_forwards_bits(seed, mask):
    """Random batches (1 to 23 requests), positions, page sizes and placements, prefill chunkings and decode steps:
    each request's rows equal the training forward's, bit for bit (and the float64 reference to rounding)."""
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 200, size=int(rng.integers(1, 24)))]
    seqs = Sequences(lengths, seed)
    seqs.pool(int(rng.choice([16, 64, 128])))
    got = [([], []) for _ in lengths]
    cuts = [_chunks(rng, n, int(rng.choice([1, 7, 64, 500]))) for n in lengths]
    while any(len(c) > 1 for c in cuts):
        live = [r for r, c in enumerate(cuts) if len(c) > 1 and rng.random() < 0.8]
        live = live or [next(r for r, c in enumerate(cuts) if len(c) > 1)]
        for r, (out, lse) in seqs.step({r: (cuts[r][0], cuts[r][1]) for r in live}, MASKS[mask]).items():
            got[r][0].append(out), got[r][1].append(lse)
            cuts[r].pop(0)
    for r in range(len(lengths)):
        out, lse = np.concatenate(got[r][0]), np.concatenate(got[r][1])
        want, want_lse = seqs.training(r, MASKS[mask])
        np.testing.assert_array_equal(out, want, err_msg=f"request {r} of {len(lengths)}")
        np.testing.assert_array_equal(lse, want_lse)
        q = seqs.q[r].transpose(1, 0, 2).reshape(K, N // K, -1, D)
        k, v = (x.transpose(1, 0, 2)[:, None] for x in (seqs.k[r], seqs.v[r]))
        n = lengths[r]
        f64, _, f64_lse = ref.attention(q, k, v, mask=MASKS[mask].dense(n, n))
        np.testing.assert_allclose(out, f64.reshape(N, n, E).transpose(1, 0, 2), **ref.tol(jnp.float32))
        np.testing.assert_allclose(lse, f64_lse.reshape(N, n).T, **ref.tol(jnp.float32))


@fused_only
def test_split_kv_merges_to_the_training_forwards_bits():
    """A request longer than SPLIT_KV keys: its decode step runs its splits on separate tasks merged by log-sum-exp;
    its rows equal the training forward's bits (one task, splits merged in the same order) on one thread and on
    every core, and the float64 reference to rounding; the forward's jvp (one pass) keeps those bits too."""
    n = jattn.SPLIT_KV * 2 + 333
    seqs = Sequences([n], 5)
    want, want_lse = seqs.training(0, masks.causal())
    cores = os.sched_getaffinity(0)
    seqs.pool(64)
    for pin in ({min(cores)}, cores):
        os.sched_setaffinity(0, pin)
        try:
            (out, lse) = seqs.step({0: (n - 3, n)}, masks.causal())[0]
        finally:
            os.sched_setaffinity(0, cores)
        np.testing.assert_array_equal(out, want[-3:])
        np.testing.assert_array_equal(lse, want_lse[-3:])
    q = seqs.q[0][-3:].transpose(1, 0, 2).reshape(K, N // K, 3, D)
    k, v = (x.transpose(1, 0, 2)[:, None] for x in (seqs.k[0], seqs.v[0]))
    f64, _, _ = ref.attention(q, k, v, mask=masks.causal().dense(3, n, q_offset=n - 3))
    np.testing.assert_allclose(out, f64.reshape(N, 3, E).transpose(1, 0, 2), **ref.tol(jnp.float32))
    qq = seqs.q[0].transpose(1, 0, 2).reshape(1, K, N // K, n, D)
    kk, vv = (x.transpose(1, 0, 2)[None, :, None] for x in (seqs.k[0], seqs.v[0]))
    f = lambda q: jattn.attention(q, kk, vv, mask=masks.causal(), implementation="blockwise")  # noqa: E731
    primal, _ = jax.jvp(f, (qq,), (jnp.ones_like(qq),))
    np.testing.assert_array_equal(np.asarray(primal).reshape(N, n, E).transpose(1, 0, 2), want)


@fused_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_pools_are_read_as_the_training_forward_reads_them(dtype):
    """bfloat16 and float16 pools (float16 subnormals included) are upcast element by element as the kernel packs a
    tile: a chunked prefill and decode give the bits of the training forward on the same 16-bit inputs, and the
    output's dtype is theirs."""
    n = 700
    seqs = Sequences([n], 7)
    for x in (*seqs.q, *seqs.k, *seqs.v):
        x[...] = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    seqs.k[0][:5] *= 1e-6  # float16 subnormals
    seqs.k[0][...] = np.asarray(jnp.asarray(seqs.k[0], dtype).astype(jnp.float32))
    seqs.pool(16)
    kp, vp, table = seqs.pages
    seqs.pages = (kp.astype(dtype), vp.astype(dtype), table)
    outs = []
    for a, b in ((0, 600), (600, 699), (699, 700)):
        q = jnp.asarray(seqs.q[0][a:b], dtype)
        out = jattn.paged_attention(q, *seqs.pages[:2], table, np.array([b], np.int32), np.array([0, b - a], np.int32))
        assert out.dtype == dtype
        outs.append(np.asarray(out.astype(jnp.float32)))
    q = jnp.asarray(seqs.q[0].transpose(1, 0, 2).reshape(1, K, N // K, n, D), dtype)
    k, v = (jnp.asarray(x.transpose(1, 0, 2)[None, :, None], dtype) for x in (seqs.k[0], seqs.v[0]))
    want = jattn.attention(q, k, v, mask=masks.causal(), implementation="blockwise")
    want = np.asarray(want.astype(jnp.float32)).reshape(N, n, E).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.concatenate(outs), want)
