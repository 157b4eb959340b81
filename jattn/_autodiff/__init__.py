"""Derivatives at every order: JAX primitives with hand-written transposes, tangents and batching rules.

``linear_pair`` (:class:`LinearPair`: a linear map and its transpose as two primitives),
``one_pass_jvp`` (:class:`OnePassJvp`: a function and its tangent as one primitive) and ``batching``
(their ``vmap`` rule). Plain JAX machinery: nothing here knows attention.

May import: nothing of jattn. The rest of jattn imports this subpackage through this face only: the
names imported below, and nothing else. Its files import each other directly, never through the
face.
"""

from jattn._autodiff.linear_pair import LinearPair
from jattn._autodiff.one_pass_jvp import OnePassJvp
