"""The slowest tests of the last ``make test`` / ``make test-newest``, as a Markdown table (docs/contributing.md).

``python -m tests.durations [N]`` reads the sessions' junit XML files in ``.durations/`` (the Makefile writes
them) and prints each session's wall-clock share: the N slowest tests (setup and call together, seconds on
one xdist worker) and each file's sum.
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read(path: Path) -> dict[str, float]:
    """Seconds per test id (``file::name[params]``) in one junit XML file."""
    times: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x or tests.test_x.TestClass
        cls = [parts.pop()] if parts and parts[-1][:1].isupper() else []
        times["::".join(["/".join(parts) + ".py", *cls, case.get("name", "")])] += float(case.get("time", 0.0))
    return times


def table(times: dict[str, float], n: int) -> str:
    """The ``n`` slowest tests and the slowest files, as Markdown."""
    files: dict[str, float] = collections.defaultdict(float)
    for test, seconds in times.items():
        files[test.split("::")[0]] += seconds
    rows = ["| seconds | test |", "|---|---|"]
    rows += [f"| {s:.1f} | `{t}` |" for t, s in sorted(times.items(), key=lambda x: -x[1])[:n]]
    rows += ["", "| seconds | file |", "|---|---|"]
    rows += [f"| {s:.0f} | `{f}` |" for f, s in sorted(files.items(), key=lambda x: -x[1])[:n]]
    rows += ["", f"{len(times)} tests, {sum(times.values()):.0f} s in all (the sum over both workers)"]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 15
    found = sorted((ROOT / ".durations").glob("*.xml"))
    if not found:
        print("no .durations/*.xml: run make test (or make test-newest) first", file=sys.stderr)
        return 1
    for path in found:
        print(f"### {path.stem}\n\n{table(read(path), n)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
