"""What the Flax modules of :mod:`jattn.nnx` and :mod:`jattn.linen` share.

``options`` holds their options, declared once (``ModuleOptions``), and their checks; ``kinds`` the
module kinds, one record each (what ``kind=`` computes, which options it takes, its cache and decoding);
``call`` a module call; ``multihead`` attention over the heads of projected activations; ``cache`` the
decoding cache as pure functions; ``decoding`` one decoding step from each kind of cache; ``paged`` a
serving step on a paged KV pool (a third kind of cache).

May import: ``_core``, ``_checks``, ``_scalars``, ``_masks``, ``_linear``, ``_ring``, ``_paths``,
``_rope``, ``_paged``, ``score_mods``. The rest of jattn imports this subpackage through this face only: the
names imported below, and nothing else. Its files import each other directly, never through the
face.
"""

from jattn._modules.call import CallArguments, Layers, check_context, check_input, forward, gate_params, init_cache
from jattn._modules.options import SELF_ATTENTION_ONLY, ModuleConfig, ModuleOptions, configure, document_options
from jattn._modules.paged import PagedBatch, init_paged_cache, is_paged, paged_forward
