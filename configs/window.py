"""Sliding-window attention on the induction task: each token sees itself and the 14 before it.

The repeat of a 12-token block needs to look back 11 positions, so a window of 14 suffices.
Run:      python -m train --config configs/window.py
Expect:   100% held-out sequence accuracy (chance per token 1/16); with
          --config.model.window=4 the repeat is out of reach and accuracy stays low.
Time:     see README ("Recorded runs") for the measured figure on the 2-core CPU.
"""

from configs import induction


def get_config():
    c = induction.get_config()
    c.name = "window"
    c.model.window = 14
    return c
