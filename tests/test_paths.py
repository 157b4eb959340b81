"""The paths of jattn.attention behind one signature: each takes the call or refuses it, and the core says why.

Every path is one function ``(Operands, Options) -> Result`` in one registry (docs/architecture.md); the
automatic choice tries the platform's candidates in order. Where each of them refuses, the error names every
candidate with its own reason, not only the last.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jattn
import jattn._paths.registry as registry
import jattn._platform as platform_facts
from jattn import masks
from jattn._checks import KernelRefusalError
from tests import reference as ref


def test_every_path_of_the_support_table_runs_and_returns_what_was_asked():
    """Each implementation named: out, and lse where its column says yes, against the float64 reference."""
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8)))
    want, _, want_lse = ref.attention(q, k, v, np.tril(np.ones((9, 11), bool), 2))
    for path in jattn.IMPLEMENTATIONS:
        if path in ("cudnn",):  # needs a CUDA GPU (refused by name here: tests/test_automatic_choice.py)
            continue
        out, lse = jattn.attention(q, k, v, mask=masks.causal(), implementation=path, return_lse=True)
        np.testing.assert_allclose(out, want, **ref.tol(jnp.float32), err_msg=path)
        np.testing.assert_allclose(lse, want_lse, **ref.tol(jnp.float32), err_msg=path)


def test_an_automatic_choice_whose_every_candidate_refuses_names_each_reason(monkeypatch):
    """On a GPU, head depth 264: the kernel refuses (D > 256), cuDNN refuses (float32), and here the last
    candidate too (its path replaced by one that refuses): one ValueError naming all three and their reasons."""
    monkeypatch.setattr(platform_facts, "platform", lambda: "gpu")
    monkeypatch.setitem(registry.PATHS, "dense", lambda ops, opts: (_ for _ in ()).throw(KernelRefusalError("no")))
    q = jnp.ones((1, 2, 9, 264), jnp.float32)
    with pytest.raises(ValueError, match="every candidate path refused") as e:
        jattn.attention(q, q, q, mask=masks.causal())
    message = str(e.value)
    assert type(e.value) is ValueError
    assert "'pallas': implementation='pallas' (jattn's GPU kernel) takes head depths D, E up to 256" in message
    assert "'cudnn': " in message and "float32" in message
    assert message.endswith("'dense': no")


def test_a_named_path_raises_its_own_refusal():
    """One candidate (an explicit implementation): its refusal as it is, not the all-refused message."""
    q = jnp.ones((1, 2, 9, 264), jnp.float32)
    with pytest.raises(ValueError, match=r"takes head depths D, E up to 256") as e:
        jattn.attention(q, q, q, implementation="pallas")
    assert type(e.value) is KernelRefusalError
