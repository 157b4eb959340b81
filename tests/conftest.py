"""JAX strict mode for the whole suite, and a repeatable hypothesis profile."""

from pathlib import Path

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/multidevice runs in its own session (8 simulated devices), only when named."""
    if collection_path.name == "multidevice":
        return not any("multidevice" in str(arg) for arg in config.args)
    return None
