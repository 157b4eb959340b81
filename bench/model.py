"""``python -m bench --model``: one training step of a small causal decoder, jattn + Flax against PyTorch eager.

The decoder is ``train.model.Decoder`` (2 layers, d_model 256, 4 heads, learned positions, GELU MLP
of 4 x d_model, pre-norm, bias-free q/k/v/out projections) with ``optax.adam``; :class:`TorchDecoder`
below is the same model written out in PyTorch (``F.scaled_dot_product_attention(is_causal=True)``,
``torch.optim.Adam``), same sizes and initialisation scheme (normal embeddings and positions,
each framework's default Linear init). Both steps are timed alternated in one process (medians);
the profile splits each step into attention forward, attention backward and the rest, timing the
attention of the model's shapes on its own (``(B, N, T, D)``, causal, forward and forward+backward).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from bench.suite import alternated_ms

VOCAB, D_MODEL, HEADS, LAYERS = 256, 256, 4, 2


def jattn_step(B: int, T: int):
    """A zero-argument callable running one jitted adam step of ``train.model.Decoder`` on fixed tokens."""
    import optax
    from flax import nnx

    from train.model import Decoder

    model = Decoder(VOCAB, T, d_model=D_MODEL, num_heads=HEADS, num_layers=LAYERS, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    carry = [params, opt.init(params)]

    def run():
        carry[0], carry[1], value = step(carry[0], carry[1], tokens)
        jax.block_until_ready(value)

    return run


def torch_step(B: int, T: int):
    """The same step in PyTorch eager: :class:`TorchDecoder` and ``torch.optim.Adam``."""
    import torch

    torch.manual_seed(0)
    model = _torch_decoder(T)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (B, T + 1))

    def run():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return run


def _torch_decoder(T: int):
    """:class:`TorchDecoder` (defined on first use: torch is imported only where the bench runs it)."""
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812 (torch's own spelling)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

        def forward(self, x):
            h = self.ln1(x)
            B, L, _ = h.shape
            q, k, v = (w(h).view(B, L, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(B, L, D_MODEL))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class TorchDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.randn(T, D_MODEL) / D_MODEL**0.5)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln_f, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return TorchDecoder()


def attention_parts(B: int, T: int) -> dict[str, dict]:
    """Zero-argument callables of the model's attention alone (both layers), forward and forward+backward, per framework."""
    import torch

    import jattn
    from jattn import masks

    shape = (B, HEADS, T, D_MODEL // HEADS)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    fwd = jax.jit(lambda q, k, v: jattn.attention(q, k, v, mask=masks.causal()))
    both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jattn.attention(q, k, v, mask=masks.causal())), argnums=(0, 1, 2)))
    tq, tk, tv = (torch.tensor(np.asarray(x), requires_grad=True) for x in (q, k, v))

    def torch_fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def torch_both():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()

    return {
        "jattn": {
            "fwd": lambda: jax.block_until_ready(fwd(q, k, v)),
            "fwdbwd": lambda: jax.block_until_ready(both(q, k, v)),
        },
        "torch": {"fwd": torch_fwd, "fwdbwd": torch_both},
    }


def model_case(B: int, T: int, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Per framework: ms of the step, of attention forward and backward (all layers), and of the rest."""
    steps = alternated_ms({"jattn": jattn_step(B, T), "torch": torch_step(B, T)}, repeats)
    parts = attention_parts(B, T)
    alone = alternated_ms({f"{fw} {mode}": f for fw, modes in parts.items() for mode, f in modes.items()}, repeats)
    rows = {}
    for fw, step in steps.items():
        fwd, both = LAYERS * alone[f"{fw} fwd"], LAYERS * alone[f"{fw} fwdbwd"]
        rows[fw] = {"step": step, "attention fwd": fwd, "attention bwd": both - fwd, "rest": step - both}
    return rows


def rest_parts(B: int, T: int) -> dict[str, dict]:
    """Zero-argument callables of the step's other operations at the model's shapes (all layers), per framework.

    Each is forward + backward with respect to its input and weights (jitted ``jax.grad`` /
    ``loss.backward()``), except the optimizer (one adam update of the model's parameters).
    """
    import optax
    import torch

    n, d = B * T, D_MODEL
    x = jax.random.normal(jax.random.key(0), (n, d))
    w_up, w_down, w_proj = (
        jax.random.normal(jax.random.key(i), s) / 16 for i, s in enumerate(((d, 4 * d), (4 * d, d), (d, 4 * d)))
    )
    labels = jax.random.randint(jax.random.key(5), (n,), 0, VOCAB)
    w_head = jax.random.normal(jax.random.key(6), (d, VOCAB)) / 16
    ln = (jnp.ones(d), jnp.zeros(d))

    def layer_norm(x, s, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * s + b

    jax_losses = {
        "MLP (up, GELU, down)": (lambda x, a, b: jnp.sum(jax.nn.gelu(x @ a) @ b), (x, w_up, w_down)),
        "q, k, v, out projections": (lambda x, w: jnp.sum(x @ w), (x, w_proj)),
        "layer norms": (lambda x, s, b: jnp.sum(layer_norm(x, s, b)), (x, *ln)),
        "head + cross-entropy": (
            lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean(),
            (x, w_head),
        ),
    }
    repeat = {"MLP (up, GELU, down)": LAYERS, "q, k, v, out projections": LAYERS, "layer norms": 2 * LAYERS + 1}
    ours = {}
    for name, (f, args) in jax_losses.items():
        g = jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))
        ours[name] = _times(repeat.get(name, 1), lambda g=g, args=args: jax.block_until_ready(g(*args)))
    tx, tup, tdown, tproj, thead = (
        torch.tensor(np.asarray(a), requires_grad=True) for a in (x, w_up, w_down, w_proj, w_head)
    )
    tlabels = torch.tensor(np.asarray(labels)).long()
    tln = torch.nn.LayerNorm(d)
    torch_losses = {
        "MLP (up, GELU, down)": lambda: (torch.nn.functional.gelu(tx @ tup) @ tdown).sum(),
        "q, k, v, out projections": lambda: (tx @ tproj).sum(),
        "layer norms": lambda: tln(tx).sum(),
        "head + cross-entropy": lambda: torch.nn.functional.cross_entropy(tx @ thead, tlabels),
    }
    theirs = {name: _times(repeat.get(name, 1), lambda f=f: f().backward()) for name, f in torch_losses.items()}
    ours["adam update"], theirs["adam update"] = jattn_adam(T), torch_adam(T)
    return {"jattn": ours, "torch": theirs}


def _times(n: int, f):
    """A zero-argument callable calling ``f`` ``n`` times (an operation every layer has)."""
    return lambda: [f() for _ in range(n)]


def jattn_adam(T: int):
    """One jitted optax adam update of the decoder's parameters (fixed gradients)."""
    import optax
    from flax import nnx

    from train.model import Decoder

    params = nnx.state(
        Decoder(VOCAB, T, d_model=D_MODEL, num_heads=HEADS, num_layers=LAYERS, rngs=nnx.Rngs(0)), nnx.Param
    )
    opt = optax.adam(1e-3)
    update = jax.jit(lambda p, s, g: optax.apply_updates(p, opt.update(g, s, p)[0]))
    state, grads = opt.init(params), jax.tree.map(jnp.ones_like, params)
    return lambda: jax.block_until_ready(update(params, state, grads))


def torch_adam(T: int):
    """One ``torch.optim.Adam`` step of the PyTorch decoder's parameters (fixed gradients)."""
    import torch

    model = _torch_decoder(T)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return opt.step


def rest_case(B: int, T: int, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Per operation of the step's rest: ms in jattn (JAX) and in torch, alternated."""
    parts = rest_parts(B, T)
    timed = alternated_ms({f"{fw}|{op}": f for fw, ops in parts.items() for op, f in ops.items()}, repeats)
    return {op: {fw: timed[f"{fw}|{op}"] for fw in parts} for op in parts["jattn"]}


#: XLA:CPU's operations of the compiled step by kind, from the first match of their names' prefixes.
OP_KINDS = (
    ("attention kernels (custom calls)", ("ffi_call", "custom-call", "custom_call")),
    ("matmuls", ("ynn_fusion", "dot", "onednn", "xnn")),
    ("layout copies (transposes)", ("copy", "transpose")),
    ("materialized broadcasts", ("wrapped_broadcast", "broadcast")),
)


def op_kind(name: str) -> str:
    """The kind (:data:`OP_KINDS`) of an XLA:CPU operation named ``name``; the others are elementwise/reductions."""
    return next((kind for kind, prefixes in OP_KINDS if name.startswith(prefixes)), "elementwise and reductions")


def step_profile(B: int, T: int, steps: int = 3) -> dict[str, float]:
    """ms a step that each kind of XLA operation of the jattn step takes (:func:`op_kind`), and the step's wall time.

    Operations that XLA runs at once on different threads each count whole, so the kinds may add up to more
    than the wall time.

    Runs in a subprocess: XLA:CPU records its operations for the profiler only with
    ``--xla_cpu_enable_xprof_traceme=true`` set before its backend starts.
    """
    import os
    import subprocess
    import sys

    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    code = f"import json; from bench import model; print(json.dumps(model._profiled_step({B}, {T}, {steps})))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = os.environ | {"XLA_FLAGS": flags, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def _profiled_step(B: int, T: int, steps: int) -> dict[str, float]:
    """:func:`step_profile`'s measurement, in this process (whose XLA records its operations)."""
    import collections
    import gzip
    import tempfile
    import time
    from pathlib import Path

    run = jattn_step(B, T)
    run(), run()
    with tempfile.TemporaryDirectory() as log:
        with jax.profiler.trace(log, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            wall = time.perf_counter() - t0
        trace = json.loads(gzip.decompress(next(Path(log).rglob("*.trace.json.gz")).read_bytes()))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kinds: dict[str, float] = collections.defaultdict(float)
    for e in events:
        name = e.get("name", "")
        # XLA's operations: lower-case HLO names (the runtime's own events are capitalised or start with "$")
        if e.get("ph") == "X" and name[:1].islower() and name.split(".")[0].replace("_", "").isalnum():
            kinds[op_kind(name)] += e.get("dur", 0) / 1e3 / steps
    return dict(kinds) | {"step (wall, profiled)": 1e3 * wall / steps}


#: PyTorch's operators of the eager step by kind (self time, so nested operators count once).
TORCH_KINDS = (
    ("attention kernels (custom calls)", ("aten::_scaled_dot_product", "aten::_flash_attention")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("layout copies (transposes)", ("aten::copy_", "aten::clone", "aten::contiguous")),
)


def torch_step_profile(B: int, T: int, steps: int = 3) -> dict[str, float]:
    """The same split of the PyTorch eager step (``torch.profiler``, self CPU time a step by :data:`TORCH_KINDS`)."""
    import time

    import torch

    run = torch_step(B, T)
    run(), run()
    kinds = {kind: 0.0 for kind, _ in TORCH_KINDS} | {"elementwise and reductions": 0.0}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = time.perf_counter() - t0
    for e in prof.key_averages():
        kind = next((k for k, prefixes in TORCH_KINDS if e.key.startswith(prefixes)), "elementwise and reductions")
        if e.key.startswith("aten::"):
            kinds[kind] += e.self_cpu_time_total / 1e3 / steps
    return kinds | {"step (wall, profiled)": 1e3 * wall / steps}
