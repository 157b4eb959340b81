"""The gated linear attention and delta-rule family: decays per step (``g``) or per key feature (``gk``), the delta rule (``beta``).

``recurrent`` its step-by-step form (KDA's too), ``chunk`` its chunkwise forms (scalar decays with and without the
delta rule, a decay per key feature, and KDA's through :mod:`jattn._linear.kda`). The recurrence is in
:mod:`jattn._linear.gated`.
"""
