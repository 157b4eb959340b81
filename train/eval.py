"""``python -m train.eval --run runs/<name>``: reload, report held-out accuracy, show examples.

Loads the latest checkpoint and prints a few examples (input, target, prediction) on the answer
positions.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from train import loop
from train.rundir import RunError, positive_int


def examples(exp: loop.Experiment, params, count: int) -> list[str]:
    """``count`` held-out examples rendered as text, answer positions marked."""
    batch = exp.task.batch(jax.random.fold_in(exp.eval_key, 0), count)
    pred = np.asarray(jnp.argmax(exp.model(params)(batch.inputs), -1))
    names = exp.task.token_names()
    lines = []
    for i in range(count):
        mask = np.asarray(batch.mask[i])
        ans = np.asarray(batch.targets[i])[mask]
        got = pred[i][mask]
        lines.append(
            f"input  {' '.join(names[t] for t in np.asarray(batch.inputs[i]))}\n"
            f"target {' '.join(names[t] for t in ans)}\n"
            f"pred   {' '.join(names[t] for t in got)}   {'ok' if np.array_equal(ans, got) else 'WRONG'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.eval", description=__doc__)
    parser.add_argument("--run", required=True, help="run directory, e.g. runs/mqar")
    parser.add_argument("--examples", type=positive_int, default=3)
    args = parser.parse_args(argv)
    try:
        exp, params, step = loop.restore(args.run)
    except RunError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    metrics = {k: float(v) for k, v in loop.make_evaluate(exp)(params).items()}
    print(
        f"{args.run} at step {step}: held-out token accuracy {metrics['token_acc']:.2%}, "
        f"sequence accuracy {metrics['seq_acc']:.2%}, loss {metrics['loss']:.4f} (chance {exp.task.chance:.2%})"
    )
    for text in examples(exp, params, args.examples):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
