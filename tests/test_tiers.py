"""tests/tiers.py names real tests: a renamed or removed test would silently leave its tier.

Every file in ``NEWEST`` exists under tests/ (or tests/multidevice/), and every ``SLOW`` node id names a test
file, and in it (or in the shared base it subclasses, tests/linear_family.py) the class and the test function
it names. Read from the sources, without collecting the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tiers import NEWEST, SLOW

TESTS = Path(__file__).resolve().parent
BASES = [TESTS / "linear_family.py"]  # test bodies a file's classes inherit


@pytest.mark.parametrize("name", sorted(NEWEST))
def test_every_newest_file_exists(name):
    assert (TESTS / name).is_file() or (TESTS / "multidevice" / name).is_file(), name


@pytest.mark.parametrize("node", sorted(SLOW))
def test_every_slow_node_id_names_a_test(node):
    path, *names = node.split("::")
    source = TESTS / path
    assert source.is_file(), node
    text = "\n".join(p.read_text() for p in [source, *BASES])
    for name in names:
        name = name.split("[")[0]  # a parametrised test's id: its function's name, then [params]
        assert re.search(rf"^\s*(def|class) {re.escape(name)}\b", text, re.M), node
