"""Every Python example in README.md and docs/ runs, so none can rot.

Each ```python block must be self-contained (its imports and inputs defined in the block). The blocks
run one after another in one fresh subprocess, each in a fresh namespace (which keeps them
independent) and within its own time budget (:data:`BLOCK_BUDGET`, not one limit for all): one process pays JAX's import and the compilation of the ops the blocks share once.
Measured on 2 cores: about 50 s of CPU in one process against about 75 s with a process for each
file (and more with one for each block); every failing block is reported with its file and line. A
block that sets JAX's devices or platform (``jax_num_cpu_devices``, ``jax_platforms``, before JAX's
first use, as a user's script does to simulate a mesh on a CPU) gets a process of its own.

The subprocesses run in JAX's strict mode, as the rest of the suite does (tests/conftest.py): rank
promotion raises, dtype promotion is strict and every warning is an error. Users do not run strict,
but an example that passes strict passes the defaults too (strict only turns implicit promotions and
warnings into errors), so the examples stay clean and stay runnable as written. Subprocesses rather
than this process: the examples configure JAX's devices, which only a fresh process can do, and they
must not see the test session's own JAX settings.

Bash blocks are not run; their ``--config`` paths and every ``configs/*.py`` the docs name must
exist. The support tables (README, docs/guide/core.md) must be ``jattn.SUPPORT``, docs/architecture.md's module table
must name every module of jattn/, and relative links must reach a file and heading that exist.
"""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jattn

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
OWN_PROCESS = re.compile(r"jax_num_cpu_devices|jax_platforms|XLA_FLAGS|JAX_NUM_CPU_DEVICES|JAX_PLATFORMS")

#: Seconds each block may take (one takes about 10 s on 2 quiet cores; the slowest measured 30 s under load).
BLOCK_BUDGET = 240

# Runs in the subprocess: blocks as JSON on stdin, each compiled under its file name and padded to its
# line, so a traceback points at the Markdown line; every block runs, each within its own budget (an
# alarm interrupts one that overruns it), and each failure is reported with its seconds.
RUNNER = r"""
import json, signal, sys, time, traceback
budget = int(sys.argv[1])

def overran(signum, frame):
    raise TimeoutError(f"the example ran past its budget of {budget} s")

signal.signal(signal.SIGALRM, overran)
failed = []
for block in json.load(sys.stdin):
    code = compile("\n" * (block["line"] - 1) + block["source"], block["file"], "exec")
    start = time.monotonic()
    signal.alarm(budget)
    try:
        exec(code, {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        failed.append(f"{block['file']}:{block['line']} ({time.monotonic() - start:.0f} s)")
    finally:
        signal.alarm(0)
if failed:
    sys.exit("FAILED: the examples at " + ", ".join(failed))
"""


def blocks(path: Path, lang: str) -> list[dict]:
    """The fenced blocks of ``lang`` in a Markdown file, with the line their code starts on."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) == lang:
            line = text.count("\n", 0, m.start(2)) + 1
            found.append(dict(file=str(path.relative_to(ROOT)), line=line, source=m.group(2)))
    return found


def groups() -> list:
    """All blocks in one process (it pays JAX's import and its compilations once), but one process
    for each block that configures JAX's devices itself."""
    shared, own = [], []
    for path in DOCS:
        for block in blocks(path, "python"):
            if OWN_PROCESS.search(block["source"]):
                own.append(pytest.param([block], id=f"{block['file']}:{block['line']}"))
            else:
                shared.append(block)
    return [pytest.param(shared, id="one-process", marks=pytest.mark.long), *own]


# make test's compile-speed flags (Makefile, FAST_COMPILE): the examples compile many small programs
# and run each once, and these flags take a third of their CPU time. make test passes the ones this
# jaxlib knows in JATTN_FAST_XLA_FLAGS (and XLA_FLAGS); run alone, the test checks them once itself,
# since XLA aborts on a flag it does not know.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)


@functools.cache
def fast_flags() -> str:
    if "JATTN_FAST_XLA_FLAGS" in os.environ:
        return os.environ["JATTN_FAST_XLA_FLAGS"]
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    known = subprocess.run(probe, env={**os.environ, "XLA_FLAGS": FAST_COMPILE}, capture_output=True, timeout=120)
    return FAST_COMPILE if known.returncode == 0 else ""


@pytest.mark.parametrize("group", groups())
def test_examples_run(group: list[dict]) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "XLA_FLAGS": flags if fast_flags() in flags else f"{fast_flags()} {flags}".strip(),
        "JAX_NUMPY_RANK_PROMOTION": "raise",
        "JAX_NUMPY_DTYPE_PROMOTION": "strict",
        "PYTHONWARNINGS": "error",
    }
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(BLOCK_BUDGET)],
        input=json.dumps(group),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=BLOCK_BUDGET * len(group) + 120,  # a backstop: each block has its own budget inside
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


def test_every_file_has_examples() -> None:
    """The docs have examples where they should (a fence typo would silently skip a block)."""
    for name in (
        "README.md",
        "docs/guide/core.md",
        "docs/guide/masks.md",
        "docs/guide/flax.md",
        "docs/guide/decoder.md",  # a whole decoder, decoding checked against the full pass
        "docs/guide/porting.md",  # loading nnx.MultiHeadAttention weights, checked against Flax's output
    ):
        assert blocks(ROOT / name, "python"), name
    for path in DOCS:
        for m in FENCE.finditer(path.read_text()):
            assert m.group(1) in ("python", "bash", "text", "yaml", "toml", "mermaid", ""), (path, m.group(1))


def test_named_configs_exist() -> None:
    for path in DOCS:
        text = path.read_text()
        named = set(re.findall(r"\bconfigs/[\w.]+\.py\b", text))
        for block in blocks(path, "bash"):
            named |= set(re.findall(r"--config[ =]([^\s]+\.py)", block["source"]))
        for name in named:
            assert (ROOT / name).is_file(), f"{path.relative_to(ROOT)} names {name}, which does not exist"


NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


def test_counts_of_configs_are_the_files() -> None:
    """A count of configs in the docs ("Ten more configs", "12 configs") is the number of files in configs/."""
    files = [p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py"]
    assert (ROOT / "configs" / "default.py") in files
    for path in DOCS:
        for number, more in re.findall(r"\b(\d+|[A-Za-z]+) (more |other )?configs\b", path.read_text()):
            if not (number.isdigit() or number.lower() in NUMBERS):
                continue  # "the configs", "other configs": no count
            n = int(number) if number.isdigit() else NUMBERS.index(number.lower())
            want = len(files) - 1 if more else len(files)  # "more", "other": besides configs/default.py
            assert n == want, f"{path.relative_to(ROOT)} counts {number} {more}configs; configs/ holds {want}"


def test_bench_commands_parse() -> None:
    """Every ``python -m bench ...`` command the docs give (a figure's reproduction) is one bench takes."""
    from bench.__main__ import parser

    commands = 0
    for path in DOCS:
        for line in re.findall(r"python -m bench((?: --?[\w-]+(?: [\w.-]+)*)*)", path.read_text()):
            args = line.split()
            if "--help" in args:
                continue
            try:
                parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{path.relative_to(ROOT)}: python -m bench{line} is not a command bench takes")
            commands += 1
    assert commands >= 10


def test_support_tables_are_jattn_support() -> None:
    """The argument x path tables (README, docs/guide/core.md) are jattn.SUPPORT, cell by cell.

    tests/test_contract.py checks SUPPORT against the paths' behaviour.
    """
    header = "| argument | " + " | ".join(f"`{p}`" for p in jattn.IMPLEMENTATIONS) + " |"
    found = 0
    for path in DOCS:
        text = path.read_text()
        if header not in text:
            continue
        found += 1
        rows = text[text.index(header) :].split("\n\n", 1)[0].splitlines()[2:]
        table = {}
        for row in rows:
            name, *cells = (c.strip() for c in row.strip().strip("|").split(" | "))
            table[name] = dict(zip(jattn.IMPLEMENTATIONS, cells, strict=True))
        assert table == jattn.SUPPORT, f"{path.relative_to(ROOT)}'s support table is not jattn.SUPPORT"
    assert found >= 2, "README.md and docs/guide/core.md each show the support table"


def test_transformation_table_is_jattn_transforms() -> None:
    """docs/guide/transformations.md's table is jattn.TRANSFORMS, cell by cell (tests/test_transforms.py checks the cells)."""
    columns = list(next(iter(jattn.TRANSFORMS.values())))
    header = "| transformation | " + " | ".join(f"`{p}`" for p in columns) + " |"
    text = (ROOT / "docs/guide/transformations.md").read_text()
    rows = text[text.index(header) :].split("\n\n", 1)[0].splitlines()[2:]
    table = {}
    for row in rows:
        name, *cells = (c.strip() for c in row.strip().strip("|").split(" | "))
        table[name] = dict(zip(columns, cells, strict=True))
    assert table == jattn.TRANSFORMS


def anchors(path: Path) -> set[str]:
    """The ids of a Markdown file's headings, as mkdocs (Python-Markdown's toc) and GitHub make them."""
    text = FENCE.sub("", path.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_resolve() -> None:
    """Relative links of README.md and docs/ point at files and headings that exist (mkdocs --strict checks docs/ too)."""
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file) if file else path
            assert linked.exists(), f"{path.relative_to(ROOT)} links to {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{path.relative_to(ROOT)} links to {target}: no such heading"


def test_architecture_page_names_every_module() -> None:
    layout = (ROOT / "docs" / "architecture.md").read_text().split("## The modules", 1)[1]
    for module in sorted((ROOT / "jattn").rglob("*.py")) + sorted((ROOT / "jattn").rglob("*.cc")):
        path = module.relative_to(ROOT).as_posix()  # jattn/_blockwise/plan.py: the subpackages too
        stem = path.removesuffix(module.suffix) + "."
        assert path in layout or stem + "*" in layout, f"docs/architecture.md misses {path}"
