"""jattn: attention for JAX and Flax, one pure core and thin modules over it.

The dimension key (B, T, S, N, K, G, D, E) is stated in :mod:`jattn._core`.
"""

from jattn import masks
from jattn._core import attention, attention_weights
from jattn._softmax import SoftmaxParts, softmax, softmax_parts

__all__ = ["SoftmaxParts", "masks", "attention", "attention_weights", "softmax", "softmax_parts"]
__version__ = "0.1.0"
