"""Reverse: eight tokens over ten symbols, a separator, then the tokens in reverse order.

Run:      python -m train --config configs/reverse.py
Expect:   100% held-out sequence accuracy; chance per token 1/10.
Time:     34 s on the 2-core CPU (measured 2026-11-30): 100.0% sequence accuracy.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.name = "reverse"
    c.task = dict(name="reverse", size=8, vocab=10)
    c.steps = 2000
    c.control = False
    return c
