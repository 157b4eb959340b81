"""A module kind is one record: a kind registered from this file alone trains and decodes in NNX and Linen.

The toy kind is retention with a learned decay per head, ``g_n = log σ(decay_logit_n)`` (one parameter a head),
written here as a :class:`jattn.RecurrentKind` with one :class:`jattn.Gate` and registered with
:func:`jattn.register_kind`: nothing else of jattn changes. It is checked against the recurrence written out in
float64 NumPy from the module's parameters, trained a few steps (its gate parameter gets a gradient and the loss
falls), and decoded token by token (equal to the full pass) through :class:`jattn.nnx.SelfAttention` and
:class:`jattn.linen.SelfAttention`. And the sources compare no kind's name outside the kind records.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jattn
import jattn.linen
import jattn.nnx
from tests import reference as ref

F_MODEL, HEADS, T = 12, 3, 9  # distinct sizes: D = 4
NAME = "toy_learned_retention"


def _decay(param, x, n, d):
    """``g (B, N, 1, T)``: the learned per-head log decay, the same at every step."""
    g = jax.nn.log_sigmoid(param("decay_logit"))  # (1, 1, N)
    return {"g": jnp.broadcast_to(g.reshape(1, n, 1, 1), (x.shape[0], n, 1, x.shape[1]))}


TOY = jattn.RecurrentKind(
    NAME,
    gates=(
        jattn.Gate(
            params=lambda features, heads, depth, householder: {
                "decay_logit": ((heads,), lambda key, shape, dtype: jnp.linspace(1.0, 3.0, shape[0], dtype=dtype))
            },
            compute=_decay,
        ),
    ),
)
jattn.register_kind(TOY)  # once a process (pytest imports this file once a worker)


def _np_toy(m, x):
    """The toy kind written out in float64 NumPy from the module's parameters: projections, the recurrence, wo."""
    x = ref.f64(x)
    heads = lambda y: y.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731  (B, N, T, D)
    q, k, v = (heads(x @ ref.f64(getattr(m, w).kernel[...])) for w in ("wq", "wk", "wv"))
    decay = 1 / (1 + np.exp(-ref.f64(m.decay_logit[...])))  # σ(logit) per head
    out = np.zeros_like(v)
    for b in range(x.shape[0]):
        for n in range(HEADS):
            S = np.zeros((q.shape[-1], v.shape[-1]))
            for t in range(x.shape[1]):
                S = decay[n] * S + np.outer(k[b, n, t], v[b, n, t])
                out[b, n, t] = S.T @ q[b, n, t] / np.sqrt(q.shape[-1])
    return out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1) @ ref.f64(m.wo.kernel[...])


def test_a_registered_kind_is_a_module_kind_in_nnx_and_linen():
    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=NAME, rngs=nnx.Rngs(0))
    assert m.gate_names == ("decay_logit",) and m.decay_logit[...].shape == (HEADS,)
    x = jax.random.normal(jax.random.key(1), (2, T, F_MODEL))
    np.testing.assert_allclose(m(x), _np_toy(m, x), rtol=1e-4, atol=1e-5)
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=NAME)
    variables = linen.init(jax.random.key(0), x)
    assert set(variables["params"]) == {"wq", "wk", "wv", "wo", "decay_logit"}
    np.testing.assert_allclose(linen.apply({"params": ref.linen_params(m)}, x), m(x), **ref.tol(jnp.float32))
    with pytest.raises(ValueError, match=rf"kind='{NAME}' \(gated_linear_attention: a state per head, no scores\)"):
        jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, num_kv_heads=1, kind=NAME, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"kind='{NAME}' is causal self-attention"):
        jattn.nnx.CrossAttention(F_MODEL, num_heads=HEADS, kind=NAME, context_features=5, rngs=nnx.Rngs(0))


def test_a_registered_kind_trains_its_gate():
    """Five SGD steps on a regression target: the loss falls and the decay parameter moves."""
    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=NAME, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, T, F_MODEL))
    target = jnp.cumsum(x, axis=1) / jnp.arange(1, T + 1, dtype=x.dtype)[None, :, None]  # the running mean: the past
    optimizer = nnx.Optimizer(m, optax.sgd(0.05), wrt=nnx.Param)
    before = np.asarray(m.decay_logit[...])

    @nnx.jit
    def step(m, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(m)
        optimizer.update(m, grads)
        return loss, grads.decay_logit[...]

    losses = []
    for _ in range(5):
        loss, grad = step(m, optimizer)
        losses.append(float(loss))
    assert np.all(np.abs(grad) > 0) and not np.allclose(m.decay_logit[...], before)
    assert losses[-1] < losses[0], losses


def test_a_registered_kind_decodes_from_its_cache_as_the_full_pass():
    """A prompt of 4, then one token at a time: NNX and Linen equal the full pass."""
    m = jattn.nnx.SelfAttention(F_MODEL, num_heads=HEADS, kind=NAME, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, F_MODEL))
    full = m(x)
    m.init_cache(2, T)
    pieces = [m(x[:, :4], decode=True)] + [m(x[:, t : t + 1], decode=True) for t in range(4, T)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **ref.tol(jnp.float32))
    linen = jattn.linen.SelfAttention(F_MODEL, num_heads=HEADS, kind=NAME)
    cache = linen.init(jax.random.key(0), 2, T, method="init_cache")["cache"]
    assert cache["state"].shape == (2, HEADS, 1, F_MODEL // HEADS, F_MODEL // HEADS)
    outs = []
    for t in range(T):
        y, state = linen.apply(
            {"params": ref.linen_params(m), "cache": cache}, x[:, t : t + 1], decode=True, mutable=["cache"]
        )
        outs.append(y)
        cache = state["cache"]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, **ref.tol(jnp.float32))


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="a module kind named 'ssd' exists already"):
        jattn.register_kind(jattn.RecurrentKind("ssd"))


def test_no_file_compares_a_kind_by_name_outside_the_kind_records():
    """The modules and the linear family read kinds through their records (jattn/_modules/kinds.py,
    jattn/_linear/kinds.py): no ``kind ==``, ``kind in (...)`` or ``in ..._KINDS`` anywhere else."""
    root = Path(jattn.__file__).parent
    files = [*root.glob("_modules/*.py"), *root.glob("_linear/**/*.py"), root / "nnx.py", root / "linen.py"]
    pattern = re.compile(r"\bkind *(==|!=| in | not in )|\bin +[A-Z_]*KINDS\b")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in files
        if "kind" not in path.name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert len(files) > 20 and not found, found
