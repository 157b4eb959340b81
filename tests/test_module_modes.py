"""Train/eval switches and imports as a Flax user meets them.

NNX: ``.eval()``, ``.train()`` and ``nnx.view(..., deterministic=...)`` on a user model that
holds a dropout attention module turn dropout off and on exactly as they do on one holding
Flax's own ``nnx.MultiHeadAttention``. Linen: the ``deterministic`` field and call argument as
``flax.linen.MultiHeadDotProductAttention`` takes them. Imports: ``jattn.nnx``, ``jattn.linen``
and ``jattn.flax`` after a plain ``import jattn``, which itself does not import Flax.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jattn.linen
import jattn.nnx

D, C, RATE = 8, 6, 0.5  # model features, context features, dropout rate


def _x(seed=0, shape=(2, 5, D)):
    return jax.random.normal(jax.random.key(seed), shape)


class UserModel(nnx.Module):
    """A user's model: an attention layer between two linear maps (no switch of its own)."""

    def __init__(self, attn: nnx.Module, *, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(D, D, rngs=rngs)
        self.attn = attn
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, context=None):
        h = self.inp(x)
        h = self.attn(h) if context is None else self.attn(h, context)
        return self.out(h)


def _attn(lib: str, cross: bool, rate: float) -> nnx.Module:
    rngs = nnx.Rngs(0, dropout=1)
    if lib == "jattn":
        if cross:
            return jattn.nnx.CrossAttention(D, C, num_heads=2, dropout_rate=rate, rngs=rngs)
        return jattn.nnx.SelfAttention(D, num_heads=2, dropout_rate=rate, rngs=rngs)
    kv = dict(in_kv_features=C) if cross else {}  # deterministic=False: jattn's default (Flax's is None)
    return nnx.MultiHeadAttention(
        2, D, qkv_features=D, dropout_rate=rate, deterministic=False, decode=False, rngs=rngs, **kv
    )


def _models(lib: str, cross: bool) -> tuple[UserModel, UserModel]:
    """A user model with dropout and its twin without dropout holding the same parameters."""
    model = UserModel(_attn(lib, cross, RATE), rngs=nnx.Rngs(2))
    twin = UserModel(_attn(lib, cross, 0.0), rngs=nnx.Rngs(3))
    nnx.update(twin, nnx.state(model, nnx.Param))
    return model, twin


def _switch(model: UserModel, switch: str) -> UserModel:
    """The model as the switch leaves it (``view*`` return a new view, the model unchanged)."""
    if switch == "eval":
        model.eval()
    elif switch == "eval_then_train":
        model.eval()
        model.train()
    elif switch == "view":
        return nnx.view(model, deterministic=True)
    elif switch == "eval_then_view_false":
        model.eval()
        return nnx.view(model, deterministic=False)
    return model


_JIT_CALL = nnx.jit(lambda m, *a: m(*a))  # one function: its programs are reused across the cases


def _behaviour(model: UserModel, twin: UserModel, args: tuple, jit: bool) -> tuple[bool, bool]:
    """(two calls give the same output, that output is the dropout-free one)."""
    call = _JIT_CALL if jit else (lambda m, *a: m(*a))
    a, b = call(model, *args), call(model, *args)
    free = call(twin, *args)
    return bool(jnp.array_equal(a, b)), bool(np.allclose(a, free, rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize(
    "switch, deterministic",
    [("eval", True), ("view", True), ("eval_then_train", False), ("eval_then_view_false", False)],
)
def test_nnx_switches_act_as_on_flax_multihead_attention(switch, deterministic, cross, jit):
    args = (_x(),) if not cross else (_x(), _x(1, (2, 4, C)))
    seen = {}
    for lib in ("flax", "jattn"):
        model, twin = _models(lib, cross)
        seen[lib] = _behaviour(_switch(model, switch), twin, args, jit)
        if switch == "view":  # a view leaves the model itself in training
            seen[lib + " after view"] = _behaviour(model, twin, args, jit)
    want = (True, True) if deterministic else (False, False)
    assert seen["jattn"] == seen["flax"] == want, seen
    if switch == "view":
        assert seen["jattn after view"] == seen["flax after view"] == (False, False), seen


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_nnx_call_argument_overrides_the_switch_as_on_flax(cross):
    args = (_x(),) if not cross else (_x(), _x(1, (2, 4, C)))
    for lib in ("flax", "jattn"):
        model, twin = _models(lib, cross)
        h = (model.inp(args[0]), *args[1:])
        free = twin.attn(*h)
        model.eval()
        on = model.attn(*h, deterministic=False), model.attn(*h, deterministic=False)
        assert not np.allclose(on[0], on[1]) and not np.allclose(on[0], free), lib
        model.train()
        np.testing.assert_allclose(model.attn(*h, deterministic=True), free, rtol=1e-6, atol=1e-6, err_msg=lib)


def test_nnx_switch_shows_in_view_info_and_checks_its_value():
    model, _ = _models("jattn", cross=False)
    assert "SelfAttention:\n  deterministic: bool | None = None" in nnx.view_info(model)
    with pytest.raises(TypeError, match=r"deterministic must be a bool, got 'yes'"):
        nnx.view(model, deterministic="yes")
    model.attn.deterministic = 1  # not a bool: named when the call reads it
    with pytest.raises(TypeError, match=r"deterministic \(the module attribute\) must be a bool, got 1"):
        model(_x())


def _linen_behaviour(module: nn.Module, free_module: nn.Module, field, call) -> tuple[bool, bool]:
    """(two dropout keys give the same output, that output is the dropout-free one) for one case."""
    x = _x()
    params = free_module.init(jax.random.key(0), x)
    kw = {} if call is None else dict(deterministic=call)
    m = module.clone(deterministic=field)
    a, b = (m.apply(params, x, rngs={"dropout": jax.random.key(k)}, **kw) for k in (1, 2))
    free = free_module.apply(params, x)
    return bool(jnp.array_equal(a, b)), bool(np.allclose(a, free, rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize(
    "field, call, deterministic",
    [(True, None, True), (False, None, False), (None, True, True), (None, False, False)],
    ids=["field-true", "field-false", "call-true", "call-false"],
)
def test_linen_deterministic_as_flax_multihead_attention(field, call, deterministic):
    """Every case Flax's module takes (field or call argument, not both); None: the field left at its default."""
    mha = dict(num_heads=2, qkv_features=D, out_features=D)
    flax_mod = nn.MultiHeadDotProductAttention(**mha, dropout_rate=RATE)
    flax_free = nn.MultiHeadDotProductAttention(**mha, deterministic=True)
    seen = {"flax": _linen_behaviour(flax_mod, flax_free, field, call)}
    ours = jattn.linen.SelfAttention(D, num_heads=2, dropout_rate=RATE)
    field = ours.deterministic if field is None else field  # jattn's default (False) for an unset field
    seen["jattn"] = _linen_behaviour(ours, jattn.linen.SelfAttention(D, num_heads=2), field, call)
    want = (True, True) if deterministic else (False, False)
    assert seen["jattn"] == seen["flax"] == want, seen


def test_linen_call_argument_overrides_the_field():
    """Where Flax raises (both set), jattn's call argument wins, as documented."""
    ours, free = jattn.linen.SelfAttention(D, num_heads=2, dropout_rate=RATE), jattn.linen.SelfAttention(D, num_heads=2)
    assert _linen_behaviour(ours, free, field=True, call=False) == (False, False)  # dropout on
    assert _linen_behaviour(ours, free, field=False, call=True) == (True, True)  # dropout off
    flax_mod = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=RATE)
    with pytest.raises(ValueError, match="deterministic"):  # Flax: both set
        _linen_behaviour(flax_mod, nn.MultiHeadDotProductAttention(num_heads=2), field=True, call=False)


LAZY_IMPORT = """
import sys
import jattn
assert "flax" not in sys.modules, sorted(m for m in sys.modules if m.startswith("flax"))
assert {"flax", "linen", "nnx"} <= set(dir(jattn)), dir(jattn)
print(jattn.nnx.SelfAttention.__module__, jattn.linen.SelfAttention.__module__, jattn.flax.attention_fn.__module__)
assert jattn.nnx is sys.modules["jattn.nnx"] and "flax" in sys.modules
try:
    jattn.no_such_name
except AttributeError as e:
    print(e)
"""


def test_plain_import_reaches_the_flax_submodules_lazily():
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LAZY_IMPORT)], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == [
        "jattn.nnx jattn.linen jattn.flax",
        "module 'jattn' has no attribute 'no_such_name'",
    ]
