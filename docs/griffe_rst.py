"""A griffe extension for the API reference: jattn's reST markup in its docstrings, as Markdown.

jattn's docstrings are Google-style with a few reST constructs that ``help()`` and editors read
well: roles (``:func:`jattn.attention```), literal blocks after ``::`` and ``.. math::``
directives. mkdocstrings renders docstrings as Markdown, where those come out garbled (a literal
block becomes a paragraph, a formula's underscores emphasis). This extension rewrites them when
the docs are built, and only there (mkdocs.yml: ``extensions``); the docstrings stay as they are:

* a role becomes inline code (``~`` keeps the last dotted name, as Sphinx does);
* a paragraph ending in ``::`` ends in ``:`` and the indented block after it becomes a fenced
  ``text`` block (a line that is only ``::`` is dropped);
* a ``.. math::`` directive's block becomes a fenced ``text`` block;
* a class docstring with an ``{options}`` line is taken from the imported class, where the
  attention modules' option entries are written in at import.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|obj|exc|math):`([^`]+)`")


def _role(match: re.Match) -> str:
    text = match.group(1)
    if "<" in text and text.endswith(">"):  # :func:`title <target>`
        text = text[: text.index("<")].strip()
    elif text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def to_markdown(text: str) -> str:
    """``text`` (a docstring, dedented) with its roles, literal blocks and math blocks as Markdown."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        directive = stripped.startswith(".. math::")
        literal = stripped.endswith("::") and not directive
        if not (directive or literal):
            out.append(ROLE.sub(_role, line))
            i += 1
            continue
        base = _indent(line)
        if literal and stripped != "::":
            out.append(ROLE.sub(_role, line[:-1]))  # "Shapes::" -> "Shapes:"
        block: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        body = [b for b in block if b.strip()]
        if not body:
            continue
        cut = min(_indent(b) for b in body)
        pad = " " * base
        while not block[0].strip():
            block.pop(0)
        out += [
            "",
            pad + "```text",
            *(pad + ROLE.sub(_role, b[cut:]) if b.strip() else "" for b in block),
            pad + "```",
            "",
        ]
    return "\n".join(out)


def _runtime_docstring(obj: griffe.Object) -> str:
    """The docstring of ``obj``'s class as imported: the modules' option entries are written in at import.

    ``jattn._modules.options.document_options`` replaces a docstring's ``{options}`` line with
    the entries of the options the class takes; griffe reads the source, so it takes them from
    the imported class.
    """
    cls = importlib.import_module(obj.module.path)
    for name in obj.path.removeprefix(obj.module.path + ".").split("."):
        cls = getattr(cls, name)
    return inspect.cleandoc(cls.__doc__)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring with :func:`to_markdown` once the object tree is complete."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Griffe's hook, run on every object of the loaded tree."""
        if obj.docstring is not None:
            if obj.is_class and "{options}" in obj.docstring.value.split():
                obj.docstring.value = _runtime_docstring(obj)
            obj.docstring.value = to_markdown(obj.docstring.value)
