"""ALiBi against learned absolute positions: train at length L, evaluate at L, 2L and 4L.

Run:      python -m train --config configs/alibi.py
"""

from configs import induction


def get_config():
    c = induction.get_config()
    c.name = "alibi"
    c.task = dict(name="induction", size=12, vocab=64)
    c.model.positions = "alibi"
    c.model.num_heads = 4
    c.control = True
    c.control_model = dict(positions="learned")
    c.extrapolate = (2, 4)
    c.learning_rate = 3e-3
    c.steps = 1000
    c.warmup_steps = 100
    c.eval_every = 500
    return c
