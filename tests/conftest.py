"""JAX strict mode for the whole suite, and a repeatable hypothesis profile."""

import gc
import os
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, settings

from tests.tiers import NEWEST, SLOW

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=12,  # the differential fuzz (tests/test_contract.py) is the broad search; CI time is ~15 min
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")


def pytest_addoption(parser) -> None:
    parser.addoption("--slow", action="store_true", help="long runs: the differential fuzz with 5,000 cases")


def pytest_configure(config) -> None:
    if config.getoption("--slow", default=False):
        os.environ["JATTN_SLOW"] = "1"  # read by tests/test_contract.py when it is imported


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    """Marks the tests of :data:`tests.tiers.NEWEST` files ``newest`` and those :data:`tests.tiers.SLOW` names ``heavy``.

    Tests marked ``long`` run first.

    ``long`` first, so none starts near the end while the other worker idles.

    xdist's first chunk for worker 0 holds them all; worker 1 meanwhile takes the short tests.
    Handing out one test at a time (``--maxschedchunk=1``) alternates the long ones between the
    workers but measured no faster (clean-clone CI 16:20 both ways), so make test keeps xdist's
    default chunks, which keep each file's tests (and their compiled programs) together.
    """
    for item in items:
        if item.path.name in NEWEST:
            item.add_marker("newest")
        if item.nodeid.removeprefix("tests/") in SLOW:
            item.add_marker("heavy")
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: file order otherwise


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/multidevice runs in its own session (8 simulated devices), only when named."""
    if collection_path.name == "multidevice":
        return not any("multidevice" in str(arg) for arg in config.args)
    return None


#: A worker's memory mappings past which JAX's caches are cleared between tests. Every compiled program
#: keeps about 3 mappings of JIT code until its cache lets it go; Linux refuses a process more than
#: vm.max_map_count of them (65530 by default), and XLA:CPU then fails with "LLVM compilation error:
#: Cannot allocate memory" (seen on jax 0.12.1 in a worker that had compiled about 20,000 programs).
MAX_MAPS = 40_000


def _mappings() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux: no such limit to keep under
        return 0


def pytest_runtest_teardown(item, nextitem) -> None:
    """Clears JAX's compiled programs when this process nears Linux's limit on memory mappings (:data:`MAX_MAPS`)."""
    if _mappings() > MAX_MAPS:
        jax.clear_caches()
        gc.collect()
