r"""``python -m bench.paged``: issue #60's paged-attention targets on this CPU, float32, medians alternated in one process.

1. ``decode``: one decode step of 32 requests (contexts 512-4096 mixed, N=8, K=2, D=128): ``jattn.paged_attention``
   on a pool of 64-token pages against today's contiguous-cache step, ``jattn.attention`` on ``(B, K, G, 1, D)``
   against a cache ``(B, K, 1, 4096, D)`` with the requests' lengths as ``masks.padding`` (target: paged >= 0.9x);
2. ``split_kv``: one request, context 32,768, decode step with the fused kernel's splits of ``SPLIT_KV`` keys run in
   parallel against one split of all its keys (target: >= 1.6x on 2 cores), for K=1 and K=2;
3. ``invariance cost``: the training forward (causal, B=1, N=8, T=8192, D=64, ``implementation='blockwise'``)
   with its splits merged by log-sum-exp (what makes paged decoding equal to it) against one split.

Prints a table with the CPU's model name; ``--repeats`` rounds (default 7).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from bench.suite import alternated_ms
from jattn import masks
from jattn._blockwise import fused_cpu
from jattn._masks.positions import UNBOUNDED

N, K, D, Z = 8, 2, 128, 64


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, and its core count here."""
    text = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    return f"{model}, {len(jax.devices())} device, {jattn._platform.cores()} cores"


def _pool(lengths: list[int], k_heads: int, seed: int = 0):
    """Contiguous k, v ``(R, S_max, K, D)`` and the same keys in a pool of Z-token pages (shuffled), float32."""
    rng = np.random.default_rng(seed)
    S = max(lengths)
    k = rng.standard_normal((len(lengths), S, k_heads, D), np.float32)
    v = rng.standard_normal((len(lengths), S, k_heads, D), np.float32)
    pages = [-(-n // Z) for n in lengths]
    order = rng.permutation(sum(pages))
    kp = np.zeros((sum(pages), Z, k_heads, D), np.float32)
    vp = np.zeros_like(kp)
    table = np.zeros((len(lengths), max(pages)), np.int32)
    at = 0
    for r, n in enumerate(lengths):
        for j in range(pages[r]):
            rows = min(Z, n - j * Z)
            kp[order[at], :rows], vp[order[at], :rows] = k[r, j * Z : j * Z + rows], v[r, j * Z : j * Z + rows]
            table[r, j] = order[at]
            at += 1
    return k, v, kp, vp, table


def decode_case(repeats: int) -> dict:
    """Target 1: paged against contiguous decode, 32 requests."""
    lengths = [int(x) for x in np.random.default_rng(1).integers(512, 4097, size=32)]
    k, v, kp, vp, table = _pool(lengths, K)
    R, G = len(lengths), N // K
    q = jax.random.normal(jax.random.key(0), (R, N, D))
    kv_lens, cu = jnp.asarray(lengths, jnp.int32), jnp.arange(R + 1, dtype=jnp.int32)
    paged = jax.jit(lambda q, kp, vp, t, n, cu: jattn.paged_attention(q, kp, vp, t, n, cu))
    kc, vc = (jnp.asarray(x.transpose(0, 2, 1, 3)[:, :, None]) for x in (k, v))  # (B, K, 1, S, D)
    mask = masks.padding(kv_lengths=kv_lens)
    contiguous = jax.jit(lambda q, k, v: jattn.attention(q, k, v, mask=mask))
    qc = q.reshape(R, K, G, 1, D)
    args = tuple(jnp.asarray(x) for x in (kp, vp, table))
    got = np.asarray(paged(q, *args, kv_lens, cu)).reshape(R, K, G, D)
    want = np.asarray(contiguous(qc, kc, vc)).reshape(R, K, G, D)
    ms = alternated_ms(
        {
            "paged": lambda: paged(q, *args, kv_lens, cu).block_until_ready(),
            "contiguous": lambda: contiguous(qc, kc, vc).block_until_ready(),
        },
        repeats,
    )
    path = jattn.choose_implementation(qc, kc, vc, mask=mask)
    return dict(ms=ms, ratio=ms["contiguous"] / ms["paged"], max_diff=float(np.abs(got - want).max()), path=path)


def split_case(k_heads: int, repeats: int, S: int = 32768) -> dict:
    """Target 2: one request's decode step at context S, splits in parallel against one split."""
    _, _, kp, vp, table = _pool([S], k_heads)
    q = jax.random.normal(jax.random.key(0), (1, N, D))
    tables = (jnp.asarray(table), jnp.asarray([S], jnp.int32), jnp.asarray([0, 1], jnp.int32))
    pages = (jnp.asarray(kp), jnp.asarray(vp))
    call = dict(window=(UNBOUNDED, 0), scale=D**-0.5, threads=jattn._platform.cores())

    def run(split):
        return jax.jit(lambda q, kp, vp, *t: fused_cpu.paged_forward(q, kp, vp, *t, **call, split=split)[0])

    splits, whole = run(fused_cpu.SPLIT_KV), run(S)
    ms = alternated_ms(
        {
            "splits": lambda: splits(q, *pages, *tables).block_until_ready(),
            "one split": lambda: whole(q, *pages, *tables).block_until_ready(),
        },
        repeats,
    )
    return dict(ms=ms, ratio=ms["one split"] / ms["splits"])


def invariance_cost(repeats: int, T: int = 8192) -> dict:
    """Target 3: the training forward with splits of SPLIT_KV merged against one split of all its keys."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (8, T, 64)) for x in keys)
    call = dict(length=T, q_offset=0, kv_offset=0, window=(UNBOUNDED, 0), scale=0.125)
    call["threads"] = jattn._platform.cores()

    def run(split):
        return jax.jit(lambda q, k, v: fused_cpu.forward(q, k, v, **call, split=split)[0])

    splits, whole = run(fused_cpu.SPLIT_KV), run(T)
    ms = alternated_ms(
        {
            "splits": lambda: splits(q, k, v).block_until_ready(),
            "one split": lambda: whole(q, k, v).block_until_ready(),
        },
        repeats,
    )
    return dict(ms=ms, ratio=ms["one split"] / ms["splits"])


def main(argv: list[str] | None = None) -> None:
    """Runs the three cases and prints their table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"# {cpu_name()}, jax {jax.__version__}, fused layer {fused_cpu.layer()}")
    d = decode_case(args.repeats)
    print(f"decode, 32 requests 512-4096: paged {d['ms']['paged']:.2f} ms, contiguous ({d['path']}) "
          f"{d['ms']['contiguous']:.2f} ms: paged {d['ratio']:.2f}x (target >= 0.9x); max diff {d['max_diff']:.1e}")  # fmt: skip
    for k_heads in (1, 2):
        s = split_case(k_heads, args.repeats)
        print(f"split-KV, context 32768, K={k_heads}: splits {s['ms']['splits']:.2f} ms, one split "
              f"{s['ms']['one split']:.2f} ms: {s['ratio']:.2f}x (target >= 1.6x)")  # fmt: skip
    c = invariance_cost(args.repeats)
    print(f"training forward T=8192 causal: splits merged {c['ms']['splits']:.1f} ms, one split "
          f"{c['ms']['one split']:.1f} ms: cost {1 / c['ratio'] - 1:+.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
