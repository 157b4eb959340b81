"""Long-context induction: a random block of 1024 tokens, then the block again (T = 2048).

Run:      python -m train --config configs/long_induction.py
Path:     softmax attention on the blockwise path (``model.implementation='blockwise'``): the
          (T, T) scores are never formed, so memory grows linearly in T. Compare
          ``--config.model.implementation=dense``.
Memory:   docs/guide/training.md gives the peak resident memory of both paths.
"""

from configs import induction


def get_config():
    c = induction.get_config()
    c.name = "long_induction"
    c.task = dict(name="induction", size=1024, vocab=64)
    c.model.implementation = "blockwise"
    c.batch_size = 8
    c.steps = 1000
    c.warmup_steps = 100
    c.log_every = 20
    c.eval_every = 200
    c.checkpoint_every = 200
    c.eval_batches = 2
    return c
