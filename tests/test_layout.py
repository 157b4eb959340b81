"""jattn/'s layout (docs/architecture.md): subpackages by subject, reached through their faces, and no import cycle.

Read from the sources with ``ast`` (every import, inside functions too, but those under ``TYPE_CHECKING``):

- no import cycle among jattn's modules;
- a module outside a subpackage imports it through its face (``jattn._masks``), never one of its
  files (``jattn._masks.base``); a file inside imports its siblings, never its own face;
- a subpackage's files import only what its face's docstring declares ("May import: ...");
- the top of jattn/ holds at most 30 entries.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jattn"


def _name(path: Path) -> str:
    parts = ["jattn", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
PACKAGES = {m.split(".")[1] for m, p in MODULES.items() if p.name == "__init__.py" and m != "jattn"}


def _typing_only(tree: ast.Module) -> set[int]:
    """The line numbers of imports under ``if TYPE_CHECKING:`` (no import at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom)}
    return lines


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported jattn module, line)`` for every run-time import of ``module`` (``from jattn.p import f``: ``jattn.p.f``)."""
    tree = ast.parse(MODULES[module].read_text())
    skip, found = _typing_only(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jattn") and node.lineno not in skip:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub if sub in MODULES else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("jattn")]
    return found


def _package(module: str) -> str | None:
    """The subpackage a module belongs to (its face included), or None at the top of jattn/."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in PACKAGES else None


def _may_import(package: str) -> set[str]:
    """The names a face's docstring declares after "May import:" (backticked)."""
    doc = ast.get_docstring(ast.parse(MODULES[f"jattn.{package}"].read_text())) or ""
    declared = re.search(r"May import:(.*?)\.(\s|$)", doc, re.S)
    assert declared, f"jattn/{package}/__init__.py's docstring says what it may import ('May import: ...')"
    return set(re.findall(r"``(\w+)``", declared.group(1)))


def test_no_import_cycle():
    edges = {m: {t for t, _ in _imports(m) if t in MODULES and t != "jattn"} for m in MODULES}
    for m in list(edges):  # importing a file of a subpackage runs its face first
        edges[m] |= {f"jattn.{_package(t)}" for t in edges[m] if _package(t) and _package(t) != _package(m)}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            assert state.get(t) != 1, "import cycle: " + " -> ".join([*path[path.index(t) :], t])
            if t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


def test_subpackages_are_reached_through_their_faces():
    wrong = []
    for m in MODULES:
        own, face = _package(m), MODULES[m].name == "__init__.py"
        for target, line in _imports(m):
            dest = _package(target)
            if dest and dest != own and target != f"jattn.{dest}":
                wrong.append(f"{m}:{line} imports {target}: use the face jattn.{dest}")
            if dest and dest == own and target == f"jattn.{dest}" and not face:
                wrong.append(f"{m}:{line} imports its own face: import the sibling file")
    assert not wrong, "\n".join(wrong)


def test_subpackages_import_only_what_their_faces_declare():
    wrong = []
    for m in MODULES:
        own = _package(m)
        if own is None:
            continue
        allowed = _may_import(own)
        for target, line in _imports(m):
            top = target.split(".")[1] if target.count(".") else None
            if top and top != own and top not in allowed:
                wrong.append(f"{m}:{line} imports {target}, not in jattn/{own}/'s 'May import': {sorted(allowed)}")
    assert not wrong, "\n".join(wrong)


def test_the_top_of_jattn_shows_the_subjects():
    entries = [p for p in ROOT.iterdir() if p.name != "__pycache__" and not p.name.startswith(".")]
    assert len(entries) <= 30, sorted(p.name for p in entries)
    assert len(PACKAGES) >= 5, PACKAGES


def test_the_architecture_page_declares_what_each_face_declares():
    """docs/architecture.md's "May import" of each subpackage is its face's, name for name (they cannot drift)."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    wrong = []
    for package in sorted(PACKAGES):
        section = re.search(rf"### `jattn/{package}/`\n\n(.*?)(?=\n### |\Z)", page, re.S)
        assert section, f"docs/architecture.md has no section for jattn/{package}/"
        line = re.search(r"May import:(.*?)\.(\s|$)", section.group(1), re.S)
        assert line, f"docs/architecture.md's jattn/{package}/ section says what it may import"
        declared = set(re.findall(r"`(\w+)`", line.group(1)))
        if declared != _may_import(package):
            wrong.append(f"jattn/{package}/: the page says {sorted(declared)}, the face {sorted(_may_import(package))}")
    assert not wrong, "\n".join(wrong)
