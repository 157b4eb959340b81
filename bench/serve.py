"""``python -m bench.serve``: the serving engine (train/engine.py) against one-at-a-time and a static padded batch.

The same requests (prompts of mixed lengths, mixed new-token counts, greedy) on a decoder with random weights
(``train.model.Decoder``: d_model 128, 4 heads, 2 kv heads, 2 layers, 256 positions), three ways, each warmed up
(every bucket compiled) then timed alternated in one process (medians of ``--repeats``): continuous batching (also on a pool of 128 pages, which must reuse pages),
the same engine one request at a time (``max_running=1``) and a static padded batch (``static=True``: a batch
admitted when the last has ended, prompts padded to the longest, decoding until the longest ends). Also the
batch-invariant mode's cost (every matmul on 16-row tiles) on the engine and on the training forward. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from train.engine import Engine, EngineConfig, Request
from train.model import Decoder

VOCAB, MAX_LEN = 64, 256


def model(batch_invariant: bool) -> Decoder:
    return Decoder(VOCAB, MAX_LEN, d_model=128, num_heads=4, num_kv_heads=2, num_layers=2,
                   implementation="blockwise", batch_invariant=batch_invariant, rngs=nnx.Rngs(0))  # fmt: skip


def requests(n: int, seed: int = 0) -> list[Request]:
    """``n`` prompts of 8-128 tokens, each continued by 8-64 tokens."""
    rng = np.random.default_rng(seed)
    return [
        Request(
            id=i,
            prompt=rng.integers(0, VOCAB, int(rng.integers(8, 129))).astype(np.int32),
            max_new=int(rng.integers(8, 65)),
            seed=i,
        )
        for i in range(n)
    ]


def run(m: Decoder, n: int, **options) -> dict:
    """Serves ``n`` requests on a fresh engine (the compiled step is shared); tokens/s and page use."""
    cfg = dict(num_pages=512, page_size=16, max_len=MAX_LEN, token_budget=256, max_running=32) | options
    engine = Engine(m, EngineConfig(**cfg))
    reqs = requests(n)
    for r in reqs:
        engine.add(r)
    start = time.perf_counter()
    done = engine.run()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated) for r in done)
    s = engine.pages.stats
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": engine.steps, "tokens": tokens,
            "padded": engine.tokens_padded, "peak_pages": s.peak, "allocated": s.allocated, "reused": s.reused,
            "in_use_after": engine.pages.in_use, "generated": [r.generated for r in sorted(done, key=lambda r: r.id)]}  # fmt: skip


def forward_ms(m: Decoder, repeats: int) -> float:
    """The jitted training forward of 8 x 256 tokens (median ms)."""
    graphdef, params = nnx.split(m)
    f = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    tokens = jax.random.randint(jax.random.key(1), (8, MAX_LEN), 0, VOCAB)
    f(params, tokens).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(params, tokens).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    inv, plain = model(True), model(False)
    modes = {
        "continuous": (inv, {}),
        "sequential": (inv, {"max_running": 1}),
        "static": (inv, {"static": True}),
        "continuous_no_invariance": (plain, {}),
        "continuous_pool_128": (inv, {"num_pages": 128}),
    }
    results: dict[str, list[dict]] = {k: [] for k in modes}
    for m, options in modes.values():  # warm-up: every bucket compiled
        run(m, args.requests, **options)
    for _ in range(args.repeats):
        for name, (m, options) in modes.items():
            results[name].append(run(m, args.requests, **options))
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    last = {k: {x: y for x, y in v[-1].items() if x != "generated"} for k, v in results.items()}
    same = all(
        v[-1]["generated"] == results["continuous"][-1]["generated"]
        for k, v in results.items()
        if k != "continuous_no_invariance"
    )
    out = {
        "tokens_per_s": med,
        "continuous_over_sequential": med["continuous"] / med["sequential"],
        "continuous_over_static": med["continuous"] / med["static"],
        "invariance_cost_engine": med["continuous_no_invariance"] / med["continuous"],
        "forward_ms": {"batch_invariant": forward_ms(inv, 5), "plain": forward_ms(plain, 5)},
        "same_tokens_all_modes": same,
        "runs": last,
        "device": str(jax.devices()[0]),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
