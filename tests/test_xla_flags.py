"""The XLA flag ``import jattn`` sets against XLA:CPU's YNNPACK miscompile (docs: transformations), each in a fresh process.

The reproducer is jax-only: a reduction of a product with an operand broadcast along a leading
axis, broadcast again. jattn sets the flag exactly on the jaxlib releases where it is wrong without
it (the route around it is still needed there), and it is right after ``import jattn`` on any.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jaxlib
import pytest

FLAG = "--xla_cpu_experimental_ynn_fusion_type"

REPRODUCER = textwrap.dedent(
    """
    import os, warnings
    import numpy as np
    import jax
    {start}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        {importing}
    f = lambda x, y, z: (x[None] * y).sum(-1)[..., None] * z[None]
    rng = np.random.default_rng(0)
    args = [rng.normal(size=s).astype(np.float32) for s in ((2, 16, 4), (128, 2, 16, 4), (2, 16, 16))]
    want = f(*(a.astype(np.float64) for a in args))
    print("error", float(np.abs(np.asarray(jax.jit(f)(*args)) - want).max()))
    print("flags", os.environ.get("XLA_FLAGS", ""))
    print("warned", any(issubclass(w.category, RuntimeWarning) and "YNNPACK" in str(w.message) for w in caught))
    """
)


def _run(env: dict | None = None, start: bool = False, importing: str = "import jattn") -> dict:
    """The reproducer in a fresh Python: its max error, XLA_FLAGS after the imports, and whether jattn warned."""
    code = REPRODUCER.format(
        before="", start="jax.numpy.ones(1).block_until_ready()" if start else "", importing=importing
    )
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JATTN_XLA_FLAGS")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=base | (env or {}), capture_output=True, text=True, check=True
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    return {"error": float(lines["error"]), "flags": lines.get("flags", ""), "warned": lines["warned"] == "True"}


@pytest.fixture(scope="module")
def probe() -> dict:
    """The reproducer without the flag, and after ``import jattn``, on the installed jaxlib."""
    return {"without": _run({"JATTN_XLA_FLAGS": "0"}), "imported": _run()}


def test_the_flag_is_set_exactly_where_the_reproducer_is_wrong(probe):
    """jattn's table of affected jaxlib releases agrees with the reproducer on the installed one.

    Fails when an XLA release in the table no longer miscompiles (the flag can go there) and when one outside
    it does (the table needs it); on an affected release the import makes the reproducer right.
    """
    wrong, sets = probe["without"]["error"] > 1.0, FLAG in probe["imported"]["flags"]
    assert FLAG not in probe["without"]["flags"]
    assert sets == wrong, (
        f"jaxlib {jaxlib.__version__}: reproducer wrong without the flag: {wrong}; jattn sets it: {sets}"
    )
    assert probe["imported"]["error"] < 1e-4 and not probe["imported"]["warned"]
    if sets:
        assert f"{FLAG}=dot,individual_dot" in probe["imported"]["flags"].split()


def test_a_flag_the_user_set_is_kept():
    got = _run({"XLA_FLAGS": f"{FLAG}="})  # no YNNPACK fusion at all: right too
    assert got["flags"].split() == [f"{FLAG}="] and got["error"] < 1e-4


def test_a_backend_started_before_the_import_gets_a_warning_not_a_silent_wrong_answer(probe):
    got = _run(start=True)
    if FLAG not in probe["imported"]["flags"]:  # an unaffected jaxlib: nothing to warn about
        assert not got["warned"] and got["error"] < 1e-4
    else:
        assert got["warned"] and FLAG not in got["flags"]
