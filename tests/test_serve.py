"""The serving engine end to end: a request's tokens and logprobs do not depend on the batch, and are the trainer's.

A tiny decoder (attention on the fused CPU path, matmuls on fixed row tiles: ``batch_invariant=True``) serves
prompts of mixed lengths, two sampled completions each (sharing the prompt's pages), in ragged steps through a
pool small enough that requests wait for pages and reuse freed ones. Each request is then served alone (one at a
time, other chunks, other pages) and scored by the jitted training forward over its whole sequence: tokens and
logprobs must be bitwise equal. The static padded batch (the benchmark's baseline) must give the same greedy
tokens. The command serves a trained run and stops cleanly on Ctrl-C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import loop, serve
from train.engine import Engine, EngineConfig, Group, Request
from train.model import Decoder, row_tiled_dot_general

VOCAB, MAX_LEN, PAGE = 16, 40, 4


def _model() -> Decoder:
    return Decoder(VOCAB, MAX_LEN, d_model=32, num_heads=2, num_kv_heads=1, num_layers=2, mlp_ratio=4,
                   implementation="blockwise", batch_invariant=True, rngs=nnx.Rngs(0))  # fmt: skip


def _requests(samples: int = 2) -> list[Request]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(5):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 25))).astype(np.int32)
        group = Group(shared=(len(prompt) - 1) // PAGE, waiting=samples) if samples > 1 else None
        for _ in range(samples):
            n = len(out)
            out.append(Request(id=n, prompt=prompt, max_new=3 + (5 * n) % 9, seed=n, group=group))
    return out


def _serve(requests: list[Request], **options) -> tuple[dict[int, Request], Engine]:
    cfg = dict(num_pages=24, page_size=PAGE, max_len=MAX_LEN, token_budget=16, max_running=6, temperature=1.0)
    engine = Engine(_model(), EngineConfig(**(cfg | options)))
    for r in requests:
        engine.add(r)
    return {r.id: r for r in engine.run()}, engine


@pytest.fixture(scope="module")
def batched() -> tuple[dict[int, Request], Engine]:
    return _serve(_requests())


def test_a_request_served_in_a_batch_is_bitwise_the_request_served_alone(batched):
    done, _ = batched
    alone = []
    for r in _requests():
        r.group = None  # alone: no shared pages either
        alone.append(r)
    alone, _ = _serve(alone, max_running=1, token_budget=5)  # one at a time, other chunks, reused pages
    assert len(done) == len(alone) == 10
    for i, r in done.items():
        assert len(r.generated) == r.max_new
        assert r.generated == alone[i].generated, i
        assert np.array_equal(np.asarray(r.logprobs), np.asarray(alone[i].logprobs)), i


def test_served_logprobs_are_bitwise_the_training_forwards(batched):
    done, _ = batched
    graphdef, params = nnx.split(_model())
    forward = jax.jit(lambda p, t: jax.nn.log_softmax(nnx.merge(graphdef, p)(t).astype(jnp.float32), axis=-1))
    for r in done.values():
        logp = np.asarray(forward(params, jnp.asarray(r.tokens, jnp.int32)[None]))[0]  # (L, vocab)
        at = np.arange(len(r.prompt) - 1, len(r.tokens) - 1)
        assert np.array_equal(logp[at, r.generated], np.asarray(r.logprobs)), r.id


def test_pages_are_shared_freed_and_reused(batched):
    done, engine = batched
    pool = engine.pages
    assert pool.in_use == 0 and pool.reserved == 0 and not pool.refs.any()
    assert sorted(pool.free) == list(range(pool.num_pages))
    followers = sum(r.group.shared for r in done.values() if r.group is not None) // 2  # one of two shares
    assert pool.stats.shared >= followers > 0
    assert pool.stats.reused > 0 and pool.stats.peak <= pool.num_pages
    # every request's pages: it needs ceil((prompt + new - 1) / page) keys, the shared ones taken once
    need = sum(-(-(len(r.prompt) + r.max_new - 1) // PAGE) for r in done.values())
    assert pool.stats.allocated == need - followers


def test_the_static_padded_batch_gives_the_same_greedy_tokens():
    cont, _ = _serve(_requests(samples=1), temperature=0.0)
    static, engine = _serve(_requests(samples=1), temperature=0.0, static=True, max_running=4, num_pages=48)
    assert engine.tokens_padded > 0
    for i, r in cont.items():
        assert r.generated == static[i].generated
        assert np.array_equal(np.asarray(r.logprobs), np.asarray(static[i].logprobs))


def test_a_row_of_a_tiled_matmul_has_the_same_bits_whatever_the_rows():
    w = jax.random.normal(jax.random.key(0), (128, 512))
    x = jax.random.normal(jax.random.key(1), (100, 128))
    tiled = jax.jit(lambda x, w: row_tiled_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ()))))
    alone = np.asarray(tiled(x[5:6], w))[0]
    for rows in (2, 16, 37, 64, 100):
        assert np.array_equal(np.asarray(tiled(x[:rows] if rows > 5 else x[4:6], w))[5 if rows > 5 else 1], alone)
    batched = np.asarray(tiled(x[:64].reshape(4, 16, 128), w)).reshape(64, 512)[5]  # batch dims flattened
    assert np.array_equal(batched, alone)


def test_a_pool_too_small_for_a_request_is_named():
    engine = Engine(_model(), EngineConfig(num_pages=2, page_size=PAGE, max_len=MAX_LEN, max_running=2,
                                           token_budget=8))  # fmt: skip
    engine.add(Request(id=0, prompt=np.zeros(20, np.int32), max_new=4, seed=0))
    with pytest.raises(RuntimeError, match="pool is too small"):
        engine.run()
    with pytest.raises(ValueError, match="max_len"):
        engine.add(Request(id=1, prompt=np.zeros(38, np.int32), max_new=4, seed=0))


def test_the_command_serves_a_run_and_keeps_what_finished_on_ctrl_c(tmp_path, monkeypatch, capsys):
    from tests.test_cli import tiny, train

    run = tmp_path / "run"
    train(tiny(run, steps=2, warmup_steps=1, log_every=1, eval_every=2, checkpoint_every=2))
    argv = ["--run", str(run), "--requests", "3", "--samples", "2", "--max-new-tokens", "3", "--page-size", "4",
            "--max-running", "2", "--quiet", "--show", "6"]  # fmt: skip
    assert serve.main(argv) == 0
    out = capsys.readouterr().out
    assert "6/6 requests finished, 18 tokens" in out and "0 in use at the end" in out
    assert out.count("request ") == 6

    class StopAfter(loop.StopOnSignal):  # Ctrl-C after three steps
        def __call__(self, step: int) -> bool:
            return step >= 3

    monkeypatch.setattr(loop, "StopOnSignal", StopAfter)
    assert serve.main(argv) == 130
    out = capsys.readouterr().out
    assert "interrupted:" in out and "requests finished (above)" in out
