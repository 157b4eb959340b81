"""Linear attention (elu + 1 features, chunked causal form) on the sort task.

Run:      python -m train --config configs/linear.py
Expect:   see README ("Recorded runs") for the measured accuracy and time on the 2-core CPU.
"""

from configs import sort


def get_config():
    c = sort.get_config()
    c.name = "linear"
    c.model.mixer = "linear"
    return c
