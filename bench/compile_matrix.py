"""What the two compile checks share (``bench/triton_compile.py``, ``bench/mosaic_compile.py``): the command line
of their configuration matrix and the plain-text table of their summaries."""

from __future__ import annotations

import argparse
import os

__all__ = ["matrix_parser", "text_table"]


def matrix_parser(doc: str, variants, depths, dtypes, archs, jobs: str) -> argparse.ArgumentParser:
    """A parser whose ``--variant/--D/--dtype/--arch`` narrow the matrix and ``--jobs`` (``jobs``: what runs at
    once) sets the parallelism (default: the cores this process may use)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", nargs="+", default=list(variants), choices=variants)
    p.add_argument("--D", nargs="+", type=int, default=list(depths))
    p.add_argument("--dtype", nargs="+", default=list(dtypes), choices=dtypes)
    p.add_argument("--arch", nargs="+", type=int, default=list(archs), choices=archs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p.add_argument("--jobs", type=int, default=cores, help=f"{jobs} at once (default: the cores, {cores})")
    return p


def text_table(lines: list[list[str]]) -> str:
    """Rows of cells (the first the header) as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in lines)
