"""Score modifications for ``score_mod``.

``softcap``, ``alibi`` (with ``alibi_slopes``), ``relative_position_bias`` (T5 buckets,
:func:`t5_buckets`) and ``compose``.

See :mod:`jattn._score_mods` for the calling convention.
"""

from jattn._score_mods import alibi, alibi_slopes, compose, relative_position_bias, softcap, t5_buckets

__all__ = ["alibi", "alibi_slopes", "compose", "relative_position_bias", "softcap", "t5_buckets"]
