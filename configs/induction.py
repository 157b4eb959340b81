"""Induction: a random block of twelve tokens, then the block again; loss on the repeat.

Run:      python -m train --config configs/induction.py
Expect:   100% held-out sequence accuracy; chance per token 1/16. Its attention.png shows
          layer 0 copying by position: each position of the repeat reads the token eleven
          positions back (an off-diagonal stripe), which the learned position table makes
          easy; layer 1 mostly attends to itself. The textbook two-layer induction circuit
          (previous-token head, then induction head) forms with ALiBi: configs/alibi.py.
Time:     43-50 s on the 2-core CPU (measured 2026-11-30): 100.0% sequence accuracy.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.name = "induction"
    c.task = dict(name="induction", size=12, vocab=16)
    c.steps = 2000
    c.control = False
    return c
