"""The diagonal-plus-low-rank (DPLR) transition: RWKV-7 and the generalized delta rule.

``steps`` its checked inputs (``a``, ``b`` beside the rest), ``recurrent`` and ``chunk`` its two forms. The
recurrence is in :mod:`jattn._linear.dplr.chunk`'s docstring.
"""
