"""MQAR for the linear-attention family: one model of the comparison (``python -m train.family`` runs them all).

Zoology's multi-query associative recall scaled to 2 CPU cores: ``task.num_pairs`` key-value pairs then as
many queries (length 4 x pairs - 1), 32 keys and 32 values (``python -m train.family`` raises both to the
number of pairs past 32), d_model 64, 2 layers, 2 heads, a short convolution (4 steps) before every mixer,
2000 steps of batch 64 for every model (the same budget). ``model.mixer`` picks the model: ``attention``
(softmax), ``linear`` (elu + 1 features, normalised), ``retention``, ``ssd``, ``gla``, ``deltanet``,
``gated_deltanet``.

Run:      python -m train --config configs/mqar_family.py --config.model.mixer=deltanet --config.task.num_pairs=16
Expect:   the table of ``python -m train.family`` (docs/guide/linear.md#the-family-on-mqar).
Time:     on the 2-core CPU, 1-4 min a model at 16 pairs, 7-15 min at 64 (length 255; measured 2026-12-04).
"""

from configs import default


def get_config():
    c = default.get_config()
    c.name = "mqar_family"
    c.task.num_pairs = 16
    c.task.num_queries = 16
    c.model.short_conv = 4  # before every mixer, as the linear-attention papers use (softmax's too: one model)
    c.control = False
    c.eval_every = 1000
    c.checkpoint_every = 1000
    return c
