"""A dedicated test session on 8 simulated CPU devices (``make test`` runs it after the main one).

The device count must be set before JAX starts its backend, so this session runs apart from the
single-device suite (``pytest tests/multidevice``); the main session does not collect it.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
