"""Ring attention: sequence-parallel attention inside ``jax.shard_map``, its sweeps and derivatives.

``attention`` holds :func:`jattn.ring_attention`, :func:`jattn.sequence_parallel_attention` and the
zigzag layout; ``sweeps`` the forward, backward and tangent sweeps around the ring; ``rules`` the
derivatives at every order.

May import: ``_autodiff``, ``_blockwise``, ``_checks``, ``_masks``, ``_arrays``, ``_online``, ``_softmax``. The
rest of jattn imports this subpackage through this face only: the names imported below, and nothing
else. Its files import each other directly, never through the face.
"""

from jattn._ring.attention import ring_attention, sequence_parallel_attention, unzigzag, zigzag
