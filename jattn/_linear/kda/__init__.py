"""Kimi Delta Attention (KDA): the delta rule with a decay per key feature, in chunks.

``chunk`` its chunkwise parts (the UT transform with per-feature decays), ``pair_sums`` the per-feature pair sums
inside a chunk as a binary tree of matmuls. Its step-by-step form is the gated / delta-rule family's
(:mod:`jattn._linear.gated_delta_rule.recurrent`).
"""
