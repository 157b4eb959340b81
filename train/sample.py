"""``python -m train.sample --run runs/<name>``: greedy decoding with the KV cache.

The answer positions of a task are generated one token at a time from the cache (each generated
answer is fed back as the next input; the task's other tokens are given), and compared with the
same greedy procedure run with full-sequence forward passes: the two agree.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from train import loop
from train.rundir import RunError, positive_int


def answer_positions(exp: loop.Experiment) -> np.ndarray:
    """Input positions whose next token is an answer (the same for every example of a task)."""
    batch = exp.task.batch(exp.eval_key, 1)
    return np.flatnonzero(np.asarray(batch.mask[0]))


def greedy_full(exp: loop.Experiment, params, inputs: Array) -> Array:
    """Greedy answers ``(B, A)`` by full forward passes over the growing sequence (no cache).

    The model is causal, so the logits at position p of the whole sequence are those of its
    prefix: one compiled full-length pass per answer.
    """
    forward = jax.jit(lambda p, seq: exp.model(p)(seq))
    seq, answers = inputs, []
    for p in answer_positions(exp):
        pred = jnp.argmax(forward(params, seq)[:, p], -1).astype(seq.dtype)
        answers.append(pred)
        if p + 1 < seq.shape[1]:
            seq = seq.at[:, p + 1].set(pred)
    return jnp.stack(answers, 1)


def greedy_cached(exp: loop.Experiment, params, inputs: Array) -> Array:
    """Greedy answers ``(B, A)``: prefill up to the first answer, then one token per call."""
    model = exp.model(params)
    b, length = inputs.shape
    model.init_cache(b, length)
    positions = answer_positions(exp)
    decode = nnx.jit(lambda m, tokens: m(tokens, decode=True)[:, -1])  # compiled once per length
    logits = decode(model, inputs[:, : positions[0] + 1])
    answers, p = [], positions[0]
    while True:
        if p in positions:
            answers.append(jnp.argmax(logits, -1).astype(inputs.dtype))
        if p + 1 >= length:
            break
        token = answers[-1] if p in positions else inputs[:, p + 1]
        p += 1
        logits = decode(model, token[:, None])
    return jnp.stack(answers, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__)
    parser.add_argument("--run", required=True, help="run directory, e.g. runs/mqar")
    parser.add_argument("--examples", type=positive_int, default=4)
    args = parser.parse_args(argv)
    try:
        exp, params, step = loop.restore(args.run)
    except RunError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    batch = exp.task.batch(jax.random.fold_in(exp.eval_key, 0), args.examples)
    cached, full = greedy_cached(exp, params, batch.inputs), greedy_full(exp, params, batch.inputs)
    want = batch.targets[:, answer_positions(exp)]
    names = exp.task.token_names()
    for i in range(args.examples):
        print(f"input    {' '.join(names[t] for t in np.asarray(batch.inputs[i]))}")
        print(f"decoded  {' '.join(names[t] for t in np.asarray(cached[i]))}")
        print(f"target   {' '.join(names[t] for t in np.asarray(want[i]))}")
    agree = bool(jnp.all(cached == full))
    print(
        f"{args.run} at step {step}: cached greedy decoding {'equals' if agree else 'DIFFERS FROM'} the "
        f"full-sequence greedy answers; {float(jnp.mean(cached == want)):.1%} of answers correct"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
