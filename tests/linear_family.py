"""The linear family's shared tests: each kind a row, the tests every kind passes written once.

In the spirit of tokamax's ``AttentionTestBase`` (subclassed per implementation): :class:`LinearFamilyTests`
holds the tests that every kind of :func:`jattn.gated_linear_attention` and :func:`jattn.log_linear_attention`
passes, and each test file subclasses it with its rows (``KINDS``), keeping its kinds' special cases beside it
(tests/test_gated_linear.py, tests/test_dplr.py, tests/test_deltaproduct.py, tests/test_log_linear.py). A row
(:class:`Kind`) says how to make the kind's inputs, how to call it, which float64 reference it equals (for
values and for gradients), how its inputs are cut into pieces and which module kind computes it.

The shared tests, each per row:

- both forms (chunks of the row's sizes, recurrent) equal the float64 reference to 1e-12 with documents,
  padding, a dropped step and an initial state (where the kind takes one), and float32 within float32's tolerance;
- the gradients of every input (gates and initial state included) equal those of the reference's hand-written
  adjoint to 1e-12 (``reference.gated_linear_vjp``, ``reference.dplr``'s, :func:`householder_adjoint`,
  :func:`quadratic_adjoint`), which central differences of the reference's loop confirm, one direction per
  input; float32 gradients within float32's tolerance;
- float32 at T = 2048 within 1e-3 (relative to the largest output) of float64, which equals the reference
  (log-linear: the recurrent form, the quadratic reference being too slow there);
- decoding in pieces (a prefix chunked, then one step at a time, the state passed on) equals the full pass;
- jit and vmap equal the eager call and a loop over the batch;
- the module kind (NNX float32, float64 two ways, Linen) equals its gates written out in float64 NumPy;
- module decoding from the cache (NNX: a prompt, then one token at a time; Linen: token by token) equals the
  full pass.

Every compared computation runs under one ``jax.jit`` per test and dtype (the forms of a kind batched in one
program); the float64 ones under ``jax.enable_x64``. Inputs are float64 values that float32 holds exactly, so
one reference serves both dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from tests import reference as ref

B, N = 2, 3  # batch and heads of the shared tests: distinct, so a misread leading axis fails
F_MODEL, HEADS = 24, 3  # the modules' width and heads (head depth 8)
GATE_NAMES = ("g", "gk", "beta", "a", "b")  # central differences move these by 1% of a unit direction


def exact32(x) -> np.ndarray:
    """``x`` rounded to float32's values, as float64."""
    return np.asarray(np.asarray(x, np.float32), np.float64)


def unit_keys(x: np.ndarray) -> np.ndarray:
    """L2-normalised over the last axis (the delta rule's keys)."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def documents(T: int, pad: int, seed: int = 2) -> dict[str, np.ndarray]:
    """Segment ids ``(B, 1, T)`` (a new document with probability 0.15 a step) and a ``kv_mask (B, 1, T)``
    that pads the second example's last ``pad`` steps and drops step ``T // 3`` of both."""
    r = np.random.default_rng(seed)
    ids = np.cumsum(r.uniform(size=(B, 1, T)) < 0.15, axis=-1).astype(np.int32)
    keep = (np.arange(T) < np.array([T, T - pad])[:, None, None]) & (np.arange(T) != T // 3)
    return {"segment_ids": ids, "kv_mask": keep}


def long_documents(T: int) -> dict[str, np.ndarray]:
    """Two examples over T steps: the first in documents (a new one with probability 0.15 a step), the second
    one long document whose last 6 steps are padding."""
    ids = np.cumsum(np.random.default_rng(12).uniform(size=(1, 1, T)) < 0.15, axis=-1)
    ids = np.concatenate([ids, np.zeros((1, 1, T))]).astype(np.int32)
    return {"segment_ids": ids, "kv_mask": np.arange(T) < np.array([T, T - 6])[:, None, None]}


def cut(x, axis: int, t0: int, t1: int):
    """Steps ``t0 .. t1 - 1`` of ``x`` along its ``axis``-th axis from the right, unless that axis is 1 (broadcast)."""
    if x.shape[-axis] == 1:
        return x
    return x[..., t0:t1] if axis == 1 else x[..., t0:t1, :]


def as_jax(args: dict, dtype=None) -> dict:
    return {n: jnp.asarray(x, dtype) for n, x in args.items()}


@dataclasses.dataclass(frozen=True)
class Kind:
    """One row: a kind of the linear family. Subclasses say how to make its inputs, call it and reference it."""

    name: str
    T: int = 37  # not a multiple of the chunks
    D: int = 5
    E: int = 7
    chunk_sizes: tuple[int, ...] = (8,)  # mode='chunk' at each, beside mode='recurrent'
    grad_chunk_sizes: tuple[int, ...] | None = None  # the gradient test's chunks (None: chunk_sizes)
    stateful: bool = True  # takes initial_state (N, D, E) and returns the final state, as its reference
    prefix: int = 20  # decoding: the first piece's steps
    pad: int = 6  # the second example's padded steps
    module: str | None = None  # the module kind that computes it
    module_options: tuple[tuple[str, object], ...] = ()
    module_reference: Callable | None = None  # (module kind, NNX module, x) -> float64 output
    module_length: int = 11
    prompt: int = 4  # module decoding: the prompt's tokens

    def __str__(self) -> str:
        return self.name

    # -- what a row says ---------------------------------------------------------------------------------------

    def inputs(self, r: np.random.Generator, lead: tuple[int, ...], T: int) -> dict[str, np.ndarray]:
        """q, k, v and the kind's gates, float64 NumPy (float32's values)."""
        raise NotImplementedError

    def call(self, args: dict, **kw):
        """The jattn call of the kind on ``args`` (as :meth:`inputs`, plus ``initial_state``)."""
        return jattn.gated_linear_attention(**args, **kw)

    def reference(self, args: dict, docs: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """The float64 reference's output and final state (None where it has none)."""
        raise NotImplementedError

    def reference_grads(self, args: dict, docs: dict, dout: np.ndarray, dfinal: np.ndarray | None) -> dict:
        """The gradients of ``Σ dout·out + Σ dfinal·final`` by the reference, each in its input's shape."""
        raise NotImplementedError

    def piece(self, args: dict, t0: int, t1: int) -> dict:
        """The inputs of steps ``t0 .. t1 - 1`` (a gate constant over the steps, as it is)."""
        return {n: cut(x, 1 if n in ("g", "beta") else 2, t0, t1) for n, x in args.items()}

    def at(self, start) -> dict:
        """What a call starting at step ``start`` takes besides the state (log-linear: the position)."""
        return {}

    # -- shared ------------------------------------------------------------------------------------------------

    def state(self, seed: int = 3, lead: tuple[int, ...] = (N,)) -> np.ndarray:
        return exact32(np.random.default_rng(seed).standard_normal((*lead, self.D, self.E)))

    def example(self, seed: int = 0, lead: tuple[int, ...] = (B, N), T: int | None = None, state: bool = True):
        """:meth:`inputs` (with an initial state where the row has one and ``state``), float32's values."""
        args = {n: exact32(x) for n, x in self.inputs(np.random.default_rng(seed), lead, T or self.T).items()}
        return args | ({"initial_state": self.state(seed + 3, lead[1:])} if state and self.stateful else {})

    def forms(self, chunk_sizes=None) -> list[dict]:
        return [{"mode": "chunk", "chunk_size": c} for c in chunk_sizes or self.chunk_sizes] + [{"mode": "recurrent"}]


def _form_name(form: dict) -> str:
    return form["mode"] + (f" {form['chunk_size']}" if "chunk_size" in form else "")


# -- the rows ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gated(Kind):
    """A kind of gated_linear_attention's decay / delta rule, against ``reference.gated_linear`` (its adjoint
    ``reference.gated_linear_vjp`` for gradients)."""

    gates: Callable = lambda r, lead, T, D: {}  # (rng, lead, T, D) -> the gate arrays

    def inputs(self, r, lead, T):
        q, k, v = (r.standard_normal((*lead, T, x)) for x in (self.D, self.D, self.E))
        return {"q": q, "k": unit_keys(k), "v": v} | self.gates(r, lead, T, self.D)

    def reference(self, args, docs):
        a = {n: x for n, x in args.items() if n != "initial_state"}
        return ref.gated_linear(**a, **docs, state=args.get("initial_state"))

    def reference_grads(self, args, docs, dout, dfinal):
        lead, (T, D), E = args["q"].shape[:-2], args["q"].shape[-2:], args["v"].shape[-1]
        shapes = {"q": (T, D), "k": (T, D), "v": (T, E), "g": (T,), "beta": (T,), "gk": (T, D)}
        shapes["initial_state"] = (D, E)
        full = {n: np.broadcast_to(x, (*lead, *shapes[n])) for n, x in args.items()}  # the adjoint's shapes
        state = full.pop("initial_state", None)
        grads = ref.gated_linear_vjp(**full, **docs, state=state, dout=dout, dfinal=dfinal)
        grads["initial_state"] = grads.pop("state")
        return {n: ref.unbroadcast(grads[n], np.shape(x)) for n, x in args.items()}


def _scalar_decay(r, lead, T, D):
    return {"g": -r.uniform(0, 1, (*lead, T))}


def _retention(r, lead, T, D):  # a constant per head, (N, 1)
    return {"g": np.log(1 - 2.0 ** -np.arange(5, 5 + lead[-1]))[:, None]}


def _feature_decay(r, lead, T, D):
    return {"gk": -r.uniform(0, 1, (*lead, T, D))}


def _beta(r, lead, T, D):
    return {"beta": r.uniform(0.05, 0.95, (*lead, T))}


def _kda(r, lead, T, D):  # g too: it adds to gk
    return {
        "gk": -r.uniform(0, 1, (*lead, T, D)),
        "g": -r.uniform(0, 0.5, (*lead, T)),
        "beta": r.uniform(0, 1, (*lead, T)),
    }


def _written_gates(kind: str, p: dict, x: np.ndarray) -> dict:
    """The gates of ``kind`` written out in float64 NumPy from the module's parameters (jattn._linear.kinds)."""
    softplus, sigmoid = (lambda z: np.log1p(np.exp(z))), (lambda z: 1 / (1 + np.exp(-z)))
    heads = lambda y: np.moveaxis(y, -1, -2)  # noqa: E731  (B, T, N) -> (B, N, T)
    out = {}
    if kind == "retention":
        out["g"] = np.log(1 - 2.0 ** -(5.0 + np.arange(HEADS)))[None, :, None]
    if kind in ("ssd", "gated_deltanet"):
        out["g"] = heads(-np.exp(p["a_log"]) * softplus(x @ p["w_dt"] + p["dt_bias"]))
    if kind == "gla":
        gk = np.log(sigmoid(x @ p["w_gk_down"] @ p["w_gk_up"] + p["b_gk"])) / 16
        out["gk"] = gk.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)
    if kind == "kda":  # -exp(a_log) per head times softplus of a rank-D map, per head and feature
        gk = softplus(x @ p["w_gk_down"] @ p["w_gk_up"] + p["dt_bias"]).reshape(*x.shape[:2], HEADS, -1)
        out["gk"] = (-np.exp(p["a_log"])[:, None] * gk).transpose(0, 2, 1, 3)
    if kind in ("deltanet", "gated_deltanet", "kda"):
        out["beta"] = heads(sigmoid(x @ p["w_beta"]))
    return out


def _silu_l2(y: np.ndarray) -> np.ndarray:
    """SiLU, then an L2 norm over the head depth (the delta kinds' q and k)."""
    y = y / (1 + np.exp(-y))
    return y / np.sqrt(np.sum(y**2, -1, keepdims=True) + 1e-6)


def _projections(m, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """q, k, v ``(B, N, T, depth)`` of the module's kernels, float64."""
    split = lambda y: y.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731
    return tuple(split(x @ ref.f64(getattr(m, w).kernel[...])) for w in ("wq", "wk", "wv"))


def _heads_out(out: np.ndarray, m) -> np.ndarray:
    """``(B, N, T, E)`` -> the output projection's ``(B, T, F)``."""
    return out.transpose(0, 2, 1, 3).reshape(*out.shape[:1], out.shape[2], -1) @ ref.f64(m.wo.kernel[...])


def gated_module(kind: str, m, x) -> np.ndarray:
    """A gated module kind in float64 NumPy: projections (SiLU + L2 for the delta kinds), gates, the loop."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    q, k, v = _projections(m, x)
    if kind in ("deltanet", "gated_deltanet", "kda"):
        q, k = _silu_l2(q), _silu_l2(k)
    out, _ = ref.gated_linear(q, k, v, **_written_gates(kind, p, x))
    return _heads_out(out, m)


@dataclasses.dataclass(frozen=True)
class LowRank(Kind):
    """RWKV-7's diagonal-plus-low-rank transition (``a = -κ̂``, ``b = κ̂ ⊙ α``, ``gk``, and ``g`` per head and step
    adding to it), against ``reference.dplr`` (its hand-written adjoint for gradients)."""

    def inputs(self, r, lead, T):
        q, k, v = (r.standard_normal((*lead, T, x)) for x in (self.D, self.D, self.E))
        kappa = unit_keys(r.standard_normal((*lead, T, self.D)))
        gates = {
            "gk": -r.uniform(0, 1, (*lead, T, self.D)),
            "a": -kappa,
            "b": kappa * r.uniform(0, 1, (*lead, T, self.D)),
        }
        return {"q": q, "k": k, "v": v} | gates | {"g": -r.uniform(0, 0.5, (lead[-1], T))}  # g (N, T): per head

    def reference(self, args, docs):
        a = {n: x for n, x in args.items() if n != "initial_state"}
        return ref.dplr(**a, **docs, state=args.get("initial_state"))

    def reference_grads(self, args, docs, dout, dfinal):
        a = {n: x for n, x in args.items() if n != "initial_state"}
        grads = ref.dplr(**a, **docs, state=args.get("initial_state"), grads_of=(dout, dfinal))
        grads["initial_state"], grads["g"] = grads.pop("state"), np.sum(grads["gk"], axis=-1)  # g adds to gk
        return {n: ref.unbroadcast(grads[n], np.shape(x)) for n, x in args.items()}


def rwkv7_module(kind: str, m, x) -> np.ndarray:
    """The 'rwkv7' kind written out in float64 NumPy from the module's parameters (jattn._linear.kinds)."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    heads = lambda y: y.reshape(*x.shape[:2], HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731  (B, N, T, D)
    q, k, v = _projections(m, x)
    gk = -np.exp(-0.5) * sigmoid(np.tanh(x @ p["w_decay_down"]) @ p["w_decay_up"] + p["b_decay"])
    rate = heads(sigmoid(x @ p["w_iclr_down"] @ p["w_iclr_up"] + p["b_iclr"]))
    k_k, k_a = (p[n].reshape(HEADS, 1, -1) for n in ("k_k", "k_a"))
    kappa = k * k_k / np.sqrt(np.sum((k * k_k) ** 2, -1, keepdims=True))
    out, _ = ref.dplr(q, k * (1 + (rate - 1) * k_a), v, a=-kappa, b=kappa * rate, gk=heads(gk))
    return _heads_out(out, m)


@dataclasses.dataclass(frozen=True)
class Householder(Kind):
    """DeltaProduct: ``householder`` delta steps a token (k, v, beta ``(..., T·n_h, ...)``), with or without a decay
    ``g`` per token, against ``reference.delta_product``'s explicit Householder products (gradients: their
    adjoint, :func:`householder_adjoint`)."""

    householder: int = 3
    gated: bool = True

    def inputs(self, r, lead, T):
        n = self.householder
        q = r.standard_normal((*lead, T, self.D))
        k = unit_keys(r.standard_normal((*lead, T * n, self.D)))
        v = r.standard_normal((*lead, T * n, self.E))
        gates = {"beta": r.uniform(0.05, 0.95, (*lead, T * n))}
        return {"q": q, "k": k, "v": v} | gates | ({"g": -r.uniform(0, 1, (*lead, T))} if self.gated else {})

    def call(self, args, **kw):
        return jattn.gated_linear_attention(**args, num_householder=self.householder, **kw)

    def reference(self, args, docs):
        return ref.delta_product(
            args["q"], args["k"], args["v"], args["beta"], self.householder, g=args.get("g"),
            state=args.get("initial_state"), **docs,
        )  # fmt: skip

    def reference_grads(self, args, docs, dout, dfinal):
        grads = householder_adjoint(
            args["q"], args["k"], args["v"], args["beta"], self.householder, g=args.get("g"),
            state=args.get("initial_state"), **docs, dout=dout, dfinal=dfinal,
        )  # fmt: skip
        return {n: ref.unbroadcast(grads[n], np.shape(x)) for n, x in args.items()}

    def piece(self, args, t0, t1):
        n = self.householder
        steps = {"q": (t0, t1, 2), "g": (t0, t1, 1), "k": (t0 * n, t1 * n, 2), "v": (t0 * n, t1 * n, 2)}
        steps["beta"] = (t0 * n, t1 * n, 1)
        return {name: cut(x, axis, s, e) for name, x in args.items() for s, e, axis in [steps[name]]}


def householder_adjoint(q, k, v, beta, n, g=None, state=None, segment_ids=None, kv_mask=None, *, dout, dfinal):
    """The gradients of ``Σ dout·out + Σ dfinal·final`` of ``reference.delta_product`` by its adjoint, written out.

    float64 NumPy, one leading index at a time, full shapes (``g`` and ``state`` too, zeros where None). Per
    kept token: ``A_0 = exp(g) I``, ``W_0 = 0``; ``A_j = H_j A_{j-1}``, ``W_j = H_j W_{j-1} + β_j k_j v_jᵀ``,
    ``H_j = I - β_j k_j k_jᵀ``; ``S_t = A_n S_{t-1} + W_n``; ``o_t = scale S_tᵀ q_t``. Run backwards through each
    product: ``dH_j = dA_j A_{j-1}ᵀ + dW_j W_{j-1}ᵀ``, ``dβ_j = kᵀ dW_j v - kᵀ dH_j k``,
    ``dk_j = β (dW_j v - (dH_j + dH_jᵀ) k)``, ``dv_j = β dW_jᵀ k``, ``dg = exp(g) tr(dA_0)``.
    """
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], beta.shape[:-1])
    T, D, E = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / np.sqrt(D)
    q, k, v = (np.broadcast_to(x, (*lead, *x.shape[-2:])) for x in (q, k, v))
    beta = np.broadcast_to(beta, (*lead, T * n))
    g = np.broadcast_to(0.0 if g is None else np.asarray(g, np.float64), (*lead, T))
    ids = np.broadcast_to(0 if segment_ids is None else np.asarray(segment_ids), (*lead, T))
    keep = np.broadcast_to(True if kv_mask is None else np.asarray(kv_mask), (*lead, T))
    S0 = np.zeros((*lead, D, E)) if state is None else np.broadcast_to(np.asarray(state, np.float64), (*lead, D, E))
    dout, dfinal = np.broadcast_to(dout, (*lead, T, E)), np.broadcast_to(dfinal, (*lead, D, E))
    d = {"q": np.zeros(q.shape), "k": np.zeros(k.shape), "v": np.zeros(v.shape), "beta": np.zeros(beta.shape)}
    d["g"], d["initial_state"] = np.zeros(g.shape), np.zeros(S0.shape)
    eye = np.eye(D)
    for i in np.ndindex(*lead):
        S, tape = S0[i].copy(), []  # per token: the state before it, A, the products (A_j, W_j, H_j), the state after
        for t in range(T):
            if t and ids[i][t] != ids[i][t - 1]:
                S = np.zeros((D, E))
            if not keep[i][t]:
                tape.append(None)
                continue
            A, W, steps = np.exp(g[i][t]) * eye, np.zeros((D, E)), []
            for j in range(t * n, t * n + n):
                H = eye - beta[i][j] * np.outer(k[i][j], k[i][j])
                steps.append((A, W, H))
                A, W = H @ A, H @ W + beta[i][j] * np.outer(k[i][j], v[i][j])
            tape.append((S, A, steps, A @ S + W))
            S = tape[-1][-1]
        dS = dfinal[i].copy()
        for t in reversed(range(T)):
            if tape[t] is not None:
                before, A, steps, after = tape[t]
                d["q"][i][t] = scale * after @ dout[i][t]
                dS = dS + scale * np.outer(q[i][t], dout[i][t])
                dA, dW = dS @ before.T, dS
                dS = A.T @ dS
                for j, (A_prev, W_prev, H) in zip(reversed(range(t * n, t * n + n)), reversed(steps), strict=True):
                    kj, vj, bj = k[i][j], v[i][j], beta[i][j]
                    dH = dA @ A_prev.T + dW @ W_prev.T
                    d["beta"][i][j] = kj @ dW @ vj - kj @ dH @ kj
                    d["k"][i][j] = bj * (dW @ vj - (dH + dH.T) @ kj)
                    d["v"][i][j] = bj * (dW.T @ kj)
                    dA, dW = H.T @ dA, H.T @ dW
                d["g"][i][t] = np.exp(g[i][t]) * np.trace(dA)
            if t and ids[i][t] != ids[i][t - 1]:
                dS = np.zeros((D, E))
        d["initial_state"][i] = dS
    return d


def householder_module(kind: str, m, x) -> np.ndarray:
    """A DeltaProduct module in float64 NumPy from its parameters: projections ((n h d) layout), SiLU + L2 norm,
    gates, the explicit Householder products."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    nh = {"deltaproduct": 2, "gated_deltaproduct": 3}[kind]  # the rows' num_householder (2: the default)
    assert m.options.num_householder == nh and m.wk.kernel.shape == (F_MODEL, nh * F_MODEL)
    b, t = x.shape[:2]
    q = _silu_l2((x @ ref.f64(m.wq.kernel[...])).reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3))
    k, v = ((x @ ref.f64(getattr(m, w).kernel[...])).reshape(b, t, nh, HEADS, -1) for w in ("wk", "wv"))
    k, v = (y.transpose(0, 3, 1, 2, 4).reshape(b, HEADS, t * nh, -1) for y in (k, v))  # token t's j-th at t·nh + j
    beta = (1 / (1 + np.exp(-(x @ p["w_beta"])))).reshape(b, t, nh, HEADS).transpose(0, 3, 1, 2).reshape(b, HEADS, -1)
    g = None
    if kind == "gated_deltaproduct":
        g = (-np.exp(p["a_log"]) * np.log1p(np.exp(x @ p["w_dt"] + p["dt_bias"]))).transpose(0, 2, 1)
    out, _ = ref.delta_product(q, _silu_l2(k), v, beta, nh, g=g)
    return _heads_out(out, m)


def bucket(t: int, s: int) -> int:
    """The Fenwick bucket of key s for query t >= s, by the paper's recursion (its ``get_level_index_weak``)."""
    if s == t:
        return 0
    top = 1 << (t.bit_length() - 1)  # the highest power of 2 <= t
    return top.bit_length() if s < top else bucket(t - top, s - top)


def quadratic(q, k, v, lam, g=None, beta=None, segment_ids=None, kv_mask=None, *, xp=np):
    """``o_t = Σ_{s<=t} λ_t[bucket(t, s)] (q_t / sqrt(D))ᵀ A_t ⋯ A_{s+1} β_s k_s v_sᵀ`` pair by pair, in ``xp``.

    ``A_r = a_r (I - β_r k_r k_rᵀ)``; a dropped step r has ``A_r = I`` and writes nothing; a change of segment
    id at a step r in (s, t] cuts the pair. ``carried[s]`` is ``A_r ⋯ A_{s+1} β_s k_s`` at the current step r,
    for every source s at once. With ``xp = jnp`` it is differentiable.
    """
    lead, T_ = q.shape[:-2], q.shape[-2]
    ids = np.zeros(T_, int) if segment_ids is None else np.asarray(segment_ids)
    keep = np.ones(T_, bool) if kv_mask is None else np.asarray(kv_mask)
    ids, keep = np.broadcast_to(ids, (*lead, T_)), np.broadcast_to(keep, (*lead, T_))
    ones = xp.ones((*lead, T_), q.dtype)
    a = ones if g is None else xp.exp(xp.broadcast_to(g, (*lead, T_)))
    b = ones if beta is None else xp.broadcast_to(beta, (*lead, T_))
    q = q / np.sqrt(q.shape[-1])
    carried = xp.zeros((*lead, T_, q.shape[-1]), q.dtype)  # (..., S, D)
    sources = np.arange(T_)
    outs = []
    for r in range(T_):
        if r:
            cut = (ids[..., r] != ids[..., r - 1])[..., None, None]
            kr = k[..., r, None, :]
            dot = xp.sum(kr * carried, -1, keepdims=True)
            moved = a[..., r, None, None] * (carried - (0.0 if beta is None else b[..., r, None, None] * kr * dot))
            carried = xp.where(cut, 0.0, xp.where(keep[..., r, None, None], moved, carried))
        write = xp.where(keep[..., r, None], b[..., r, None] * k[..., r, :], 0.0)
        carried = xp.where((sources == r)[:, None], write[..., None, :], carried)
        weights = xp.stack([lam[..., r, bucket(r, s)] if s <= r else lam[..., r, 0] * 0.0 for s in range(T_)], -1)
        coef = xp.where(sources <= r, weights * xp.sum(q[..., r, None, :] * carried, -1), 0.0)  # (..., S)
        o = xp.sum(coef[..., None] * v, -2)
        outs.append(xp.where(keep[..., r, None], o, 0.0))
    return xp.stack(outs, axis=-2)


def quadratic_adjoint(q, k, v, lam, g=None, beta=None, segment_ids=None, kv_mask=None, *, dout) -> dict:
    """The gradients of ``Σ dout·out`` of :func:`quadratic` by its adjoint, written out: float64 NumPy, full shapes.

    Backwards over the steps r with ``dc``, the adjoint of ``carried``: the output ``o_r = Σ_s w_rs (q̂_r·c_s) v_s``
    (``w_rs = λ_r[bucket(r, s)]``) gives ``dv_s += w_rs (q̂_r·c_s) do_r``, ``dλ_r[bucket(r, s)] += (do_r·v_s)
    (q̂_r·c_s)``, ``dq̂_r += Σ_s (do_r·v_s) w_rs c_s`` and ``dc_s += (do_r·v_s) w_rs q̂_r``; the write ``c_r = β_r k_r``
    gives ``dβ_r = k_r·dc_r``, ``dk_r = β_r dc_r`` and clears ``dc_r``; the move ``c_s <- a_r (c_s - β_r k_r (k_r·c_s))``
    (symmetric in c) gives ``da_r = Σ_s dc_s·(c_s - β_r k_r (k_r·c_s))``, then with ``e_s = a_r dc_s``:
    ``dβ_r -= Σ_s (k_r·e_s)(k_r·c_s)``, ``dk_r -= β_r Σ_s (e_s (k_r·c_s) + c_s (k_r·e_s))`` and
    ``dc_s <- e_s - β_r k_r (k_r·e_s)``; a dropped step passes ``dc`` on, a cut clears it. ``dg = a dA``.
    """
    q, k, v, lam = (np.asarray(x, np.float64) for x in (q, k, v, lam))
    lead, T, D = q.shape[:-2], q.shape[-2], q.shape[-1]
    ids = np.broadcast_to(0 if segment_ids is None else np.asarray(segment_ids), (*lead, T))
    keep = np.broadcast_to(True if kv_mask is None else np.asarray(kv_mask), (*lead, T))
    a = np.ones((*lead, T)) if g is None else np.exp(np.broadcast_to(np.asarray(g, np.float64), (*lead, T)))
    b = np.ones((*lead, T)) if beta is None else np.broadcast_to(np.asarray(beta, np.float64), (*lead, T))
    qh, sources = q / np.sqrt(D), np.arange(T)
    levels_of = np.array([[bucket(r, s) if s <= r else 0 for s in range(T)] for r in range(T)])  # (T, S)
    w = np.where(sources <= sources[:, None], lam[..., sources[:, None], levels_of], 0.0)  # (..., T, S)
    carried, before, after = np.zeros((*lead, T, D)), [None], []  # carried before each step's move, after its write
    for r in range(T):
        if r:
            before.append(carried)
            kr = k[..., r, None, :]
            dot = np.sum(kr * carried, -1, keepdims=True)
            moved = a[..., r, None, None] * (carried - (0.0 if beta is None else b[..., r, None, None] * kr * dot))
            cut = (ids[..., r] != ids[..., r - 1])[..., None, None]
            carried = np.where(cut, 0.0, np.where(keep[..., r, None, None], moved, carried))
        write = np.where(keep[..., r, None], b[..., r, None] * k[..., r, :], 0.0)
        carried = np.where((sources == r)[:, None], write[..., None, :], carried)
        after.append(carried)
    d = {n: np.zeros(x.shape) for n, x in (("q", q), ("k", k), ("v", v), ("level_weights", lam))}
    da, db, dc = np.zeros((*lead, T)), np.zeros((*lead, T)), np.zeros((*lead, T, D))
    for r in reversed(range(T)):
        c, do = after[r], np.where(keep[..., r, None], dout[..., r, :], 0.0)
        dcoef = np.sum(do[..., None, :] * v, -1)  # (..., S): do_r·v_s
        dot_q = np.sum(qh[..., r, None, :] * c, -1)  # (..., S): q̂_r·c_s
        d["v"] += (w[..., r, :] * dot_q)[..., None] * do[..., None, :]
        for s in range(r + 1):
            d["level_weights"][..., r, levels_of[r, s]] += dcoef[..., s] * dot_q[..., s]
        d["q"][..., r, :] = np.sum((dcoef * w[..., r, :])[..., None] * c, -2) / np.sqrt(D)
        dc = dc + (dcoef * w[..., r, :])[..., None] * qh[..., r, None, :]
        dwrite, dc[..., r, :] = np.where(keep[..., r, None], dc[..., r, :], 0.0), 0.0
        db[..., r] += np.sum(dwrite * k[..., r, :], -1)
        d["k"][..., r, :] += b[..., r, None] * dwrite
        if r:
            prev, kr = before[r], k[..., r, None, :]
            dot = np.sum(kr * prev, -1, keepdims=True)  # (..., S, 1)
            moves = (keep[..., r] & (ids[..., r] == ids[..., r - 1]))[..., None, None]
            inner = prev - (0.0 if beta is None else b[..., r, None, None] * kr * dot)
            da[..., r] += np.sum(np.where(moves, dc * inner, 0.0), (-2, -1))
            e = a[..., r, None, None] * dc
            ke = np.sum(kr * e, -1, keepdims=True)
            if beta is not None:
                db[..., r] -= np.sum(np.where(moves, ke * dot, 0.0), (-2, -1))
                step_dk = b[..., r, None] * np.sum(np.where(moves, e * dot + prev * ke, 0.0), -2)
                d["k"][..., r, :] -= step_dk
                e = e - b[..., r, None, None] * kr * ke
            cut = (ids[..., r] != ids[..., r - 1])[..., None, None]
            dc = np.where(cut, 0.0, np.where(moves, e, dc))
    return d | ({} if g is None else {"g": a * da}) | ({} if beta is None else {"beta": db})


def levels(T: int) -> int:
    """The Fenwick levels positions 0 .. T-1 use: bit_length(T - 1) + 1."""
    return (T - 1).bit_length() + 1


@dataclasses.dataclass(frozen=True)
class LogLinear(Kind):
    """log_linear_attention over a base kind (its ``gates`` among g, beta), level weights for one level more than
    T needs (not read), against :func:`quadratic` (gradients: its adjoint, :func:`quadratic_adjoint`)."""

    gates: tuple[str, ...] = ()

    def inputs(self, r, lead, T):
        q, k, v = (r.standard_normal((*lead, T, x)) for x in (self.D, self.D, self.E))
        lam = r.uniform(0.2, 2.0, (*lead, T, levels(T) + 1))
        g, beta = -r.uniform(0, 1, (*lead, T)), r.uniform(0.05, 0.95, (*lead, T))
        return {"q": q, "k": unit_keys(k), "v": v, "level_weights": lam} | {
            n: x for n, x in (("g", g), ("beta", beta)) if n in self.gates
        }

    def call(self, args, **kw):
        return jattn.log_linear_attention(**args, **kw)

    def reference(self, args, docs):
        a = args
        return quadratic(a["q"], a["k"], a["v"], a["level_weights"], a.get("g"), a.get("beta"), **docs), None

    def reference_grads(self, args, docs, dout, dfinal):
        a = args
        grads = quadratic_adjoint(
            a["q"], a["k"], a["v"], a["level_weights"], a.get("g"), a.get("beta"), **docs, dout=dout
        )
        return {n: ref.unbroadcast(grads[n], np.shape(x)) for n, x in args.items()}

    def at(self, start):
        return {"start": start}


def log_module(kind: str, m, x) -> np.ndarray:
    """A log kind in float64 NumPy: projections, the kind's gates from its parameters, the paper's level weights,
    :func:`quadratic`."""
    p = {name: ref.f64(getattr(m, name)[...]) for name in m.gate_names}
    x = ref.f64(x)
    b, t = x.shape[:2]
    softplus = lambda z: np.logaddexp(0.0, z)  # noqa: E731
    split = lambda y: y.reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3)  # noqa: E731  (B, T, N·X) -> (B, N, T, X)
    q, k, v = _projections(m, x)
    if kind == "log_gated_deltanet":
        q, k = _silu_l2(q), _silu_l2(k)
    g = np.moveaxis(-np.exp(p["a_log"]) * softplus(x @ p["w_dt"] + p["dt_bias"]), -1, -2)
    beta = np.moveaxis(1 / (1 + np.exp(-(x @ p["w_beta"]))), -1, -2) if kind == "log_gated_deltanet" else None
    lam = split(softplus((x @ p["w_level"]).reshape(b, t, HEADS, -1) * p["level_scale"]).reshape(b, t, -1))
    return _heads_out(quadratic(q, k, v, lam, g, beta), m)


GATED_KINDS = (
    Gated("linear"),
    Gated("retention", gates=_retention, module="retention", module_reference=gated_module),
    Gated("ssd", gates=_scalar_decay, module="ssd", module_reference=gated_module),
    Gated("gla", gates=_feature_decay, module="gla", module_reference=gated_module),
    Gated("deltanet", gates=_beta, module="deltanet", module_reference=gated_module),
    Gated(
        "gated deltanet",
        gates=lambda *a: _scalar_decay(*a) | _beta(*a),
        module="gated_deltanet",
        module_reference=gated_module,
    ),
    Gated("kda", gates=_kda, chunk_sizes=(6, 8, 32), module="kda", module_reference=gated_module),
)
DPLR_KINDS = (
    LowRank(
        "rwkv7", chunk_sizes=(1, 8, 16, 64), grad_chunk_sizes=(8,), module="rwkv7", module_reference=rwkv7_module
    ),  # gradients at every chunk size: tests/test_dplr.py's repeated and correlated keys
)
DELTAPRODUCT_KINDS = (
    Householder(
        "gated deltaproduct",
        T=13,
        chunk_sizes=(8, 16),
        prefix=5,
        pad=4,
        module="gated_deltaproduct",
        module_options=(("num_householder", 3),),
        module_reference=householder_module,
    ),
    Householder(
        "deltaproduct",
        T=13,
        gated=False,
        chunk_sizes=(8, 16),
        prefix=5,
        pad=4,
        module="deltaproduct",
        module_reference=householder_module,  # the module's default num_householder, 2
    ),
)
LOG_KINDS = tuple(
    LogLinear(
        f"log {name}",
        T=29,
        D=4,
        E=5,
        gates=gates,
        chunk_sizes=(4,),
        grad_chunk_sizes=(2,),
        stateful=False,
        module=module,
        module_reference=log_module,
        module_length=13,
        prompt=5,
    )
    for name, gates, module in [
        ("linear", (), None),
        ("ssd", ("g",), "log_ssd"),
        ("deltanet", ("beta",), None),
        ("gated deltanet", ("g", "beta"), "log_gated_deltanet"),
    ]
)


# -- the shared tests -------------------------------------------------------------------------------------------


class LinearFamilyTests:
    """The tests every row passes; a test file subclasses it (``class Test...``) with its rows in ``KINDS``."""

    KINDS: tuple[Kind, ...] = ()

    def pytest_generate_tests(self, metafunc):
        if "kind" in metafunc.fixturenames:
            metafunc.parametrize("kind", self.KINDS, ids=str)
        if "module_kind" in metafunc.fixturenames:
            metafunc.parametrize("module_kind", [k for k in self.KINDS if k.module], ids=lambda k: k.module)

    def test_both_forms_equal_the_float64_reference(self, kind):
        """Each form (chunks of the row's sizes, recurrent) against the float64 reference, with documents, padding,
        a dropped step and an initial state (where the kind takes one): float64 to 1e-12, float32 to float32's
        tolerance; dropped steps output 0."""
        args, docs = kind.example(), documents(kind.T, kind.pad)

        def forms(a):
            return [kind.call(a, **docs, **form, return_state=kind.stateful) for form in kind.forms()]

        with jax.enable_x64(True):
            want, want_final = kind.reference(args, docs)
            assert not np.allclose(want, kind.reference(args, {})[0])  # the documents matter
            wide = jax.jit(forms)(as_jax(args))
        dropped = ~np.broadcast_to(docs["kv_mask"], want.shape[:-1])
        for dtype, results in ((jnp.float64, wide), (jnp.float32, jax.jit(forms)(as_jax(args, jnp.float32)))):
            for form, got in zip(kind.forms(), results, strict=True):
                out, final = got if kind.stateful else (got, None)
                msg = f"{_form_name(form)}, {jnp.dtype(dtype).name}"
                assert out.dtype == dtype and out.shape == want.shape, msg
                np.testing.assert_allclose(out, want, **ref.tol(dtype), err_msg=msg)
                if kind.stateful:
                    np.testing.assert_allclose(final, want_final, **ref.tol(dtype), err_msg=msg)
                assert np.all(np.asarray(out)[dropped] == 0), msg

    def test_gradients_equal_the_float64_reference(self, kind):
        """Every input's gradient (gates and initial state included) of each form against the reference's: float64
        to 1e-12, float32 (first chunks, recurrent) to float32's tolerance; central differences of the reference's
        loop, one direction per input, confirm the reference's gradients."""
        T = kind.T
        args, docs = kind.example(seed=7), documents(T, kind.pad)
        r = np.random.default_rng(8)
        dout = exact32(r.standard_normal((B, N, T, kind.E)))
        dfinal = exact32(r.standard_normal((B, N, kind.D, kind.E))) if kind.stateful else None
        forms = kind.forms(kind.grad_chunk_sizes)

        def loss(a, form):
            got = kind.call(a, **docs, **form, return_state=kind.stateful)
            out, final = got if kind.stateful else (got, None)
            return jnp.sum(dout.astype(out.dtype) * out) + (
                0 if final is None else jnp.sum(dfinal.astype(out.dtype) * final)
            )

        def grads(a, forms):
            return [jax.grad(loss)(a, form) for form in forms]

        with jax.enable_x64(True):
            want = kind.reference_grads(args, docs, dout, dfinal)
            wide = jax.jit(lambda a: grads(a, forms))(as_jax(args))
            for form, got in zip(forms, wide, strict=True):
                for name in args:
                    err = f"{_form_name(form)}, d{name}"
                    np.testing.assert_allclose(got[name], want[name], **ref.tol(jnp.float64), err_msg=err)
            # the reference's gradient is its loop's derivative: central differences, one direction per input
            eps, r = 1e-6, np.random.default_rng(9)
            for name, x in args.items():
                u = r.standard_normal(np.shape(x)) * (0.01 if name in GATE_NAMES else 1.0)

                def ref_loss(sign, name=name, x=x, u=u):
                    out, final = kind.reference(args | {name: x + sign * eps * u}, docs)
                    return np.sum(dout * out) + (0.0 if final is None else np.sum(dfinal * final))

                numeric = (ref_loss(1) - ref_loss(-1)) / (2 * eps)
                analytic = np.sum(np.asarray(want[name]) * u)
                np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8, err_msg=name)
        narrow = [forms[0], forms[-1]]  # float32: the first chunks and the recurrent form
        for form, got in zip(narrow, jax.jit(lambda a: grads(a, narrow))(as_jax(args, jnp.float32)), strict=True):
            for name in args:
                assert got[name].dtype == jnp.float32, (form, name)
                ref.assert_grad_close(got[name], want[name], jnp.float32)

    def test_float32_at_2048_steps_is_within_1e_3_of_float64(self, kind):
        """Two examples over 2048 steps (one in short documents, one long document ending in padding), an initial
        state where the kind takes one: float32 chunk (default chunks) and recurrent forms, outputs and final states,
        within 1e-3 (relative to the largest) of float64, whose chunk form equals the reference (log-linear: the
        recurrent form, the quadratic reference being too slow here)."""
        T = 2048
        args, docs = kind.example(seed=11, lead=(2, 1), T=T), long_documents(T)
        forms = [{"mode": "chunk"}, {"mode": "recurrent"}]

        def run(a):
            return [kind.call(a, **docs, **form, return_state=True) for form in forms]

        with jax.enable_x64(True):
            (want, want_final), recurrent = jax.jit(run)(as_jax(args))
            if isinstance(kind, LogLinear):
                for x, y in zip(recurrent, (want, want_final), strict=True):
                    np.testing.assert_allclose(x, y, **ref.tol(jnp.float64))
            else:
                out, final = kind.reference(args, docs)
                np.testing.assert_allclose(want, out, **ref.tol(jnp.float64))
                np.testing.assert_allclose(want_final, final, **ref.tol(jnp.float64))
        for form, (out, final) in zip(forms, jax.jit(run)(as_jax(args, jnp.float32)), strict=True):
            assert out.dtype == jnp.float32
            for got, x in ((out, want), (final, want_final)):
                err = np.max(np.abs(ref.f64(got) - np.asarray(x)))
                assert err <= 1e-3 * np.max(np.abs(np.asarray(x))), (form, err)

    def test_decoding_in_pieces_equals_the_full_pass(self, kind):
        """float32: the state after a chunked prefix, passed back, continues the sequence one step at a time
        (recurrent form); the outputs and the final state equal one call's."""
        args = as_jax(kind.example(), jnp.float32)
        state = args.pop("initial_state", None)
        full, final = jax.jit(lambda a: kind.call(a, initial_state=state, return_state=True))(args)
        first = jax.jit(lambda a: kind.call(a, initial_state=state, return_state=True, **kind.at(0)))
        out, state = first(kind.piece(args, 0, kind.prefix))
        step = jax.jit(lambda a, s, t: kind.call(a, initial_state=s, return_state=True, mode="recurrent", **kind.at(t)))
        outs = [out]
        for t in range(kind.prefix, kind.T):
            out, state = step(kind.piece(args, t, t + 1), state, jnp.asarray(t))
            outs.append(out)
        np.testing.assert_allclose(jnp.concatenate(outs, axis=-2), full, **ref.tol(jnp.float32))
        np.testing.assert_allclose(state, final, **ref.tol(jnp.float32))

    def test_jit_and_vmap_equal_the_eager_call_and_a_loop(self, kind):
        """float32: jit equals the eager call; vmap over the batch equals it and a loop of calls, one example each."""
        args = as_jax(kind.example(state=False), jnp.float32)

        def f(a):
            return kind.call(a, chunk_size=kind.chunk_sizes[0])

        eager = f(args)  # op by op, on purpose
        np.testing.assert_allclose(jax.jit(f)(args), eager, **ref.tol(jnp.float32))
        batched = {n: 0 if x.ndim >= 3 and x.shape[0] == B else None for n, x in args.items()}  # (N, 1) gates: per head
        mapped = jax.vmap(f, in_axes=(batched,))(args)
        one = jax.jit(f)
        looped = [one({n: x[i] if batched[n] == 0 else x for n, x in args.items()}) for i in range(B)]
        np.testing.assert_allclose(mapped, jnp.stack(looped), **ref.tol(jnp.float32))
        np.testing.assert_allclose(mapped, eager, **ref.tol(jnp.float32))

    def test_the_module_kind_equals_its_gates_written_out(self, module_kind):
        """NNX in float32 (to 1e-4), with float64 parameters and input and with dtype=float64 (float64 out, to 1e-12)
        against the kind written out in float64 NumPy from its parameters; Linen with the same parameters equals
        NNX in float32 and in float64."""
        from flax import nnx

        kind = module_kind
        options = dict(num_heads=HEADS, kind=kind.module, **dict(kind.module_options))
        shape = (2, kind.module_length, F_MODEL)
        call = nnx.jit(lambda m, x: m(x))
        m = jattn.nnx.SelfAttention(F_MODEL, **options, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), shape)
        got = call(m, x)
        np.testing.assert_allclose(got, kind.module_reference(kind.module, m, x), rtol=1e-4, atol=1e-5)
        linen = jattn.linen.SelfAttention(F_MODEL, **options)
        np.testing.assert_allclose(
            jax.jit(linen.apply)({"params": ref.linen_params(m)}, x), got, **ref.tol(jnp.float32)
        )
        with jax.enable_x64(True):
            for opts, dtype in (({"param_dtype": jnp.float64}, jnp.float64), ({"dtype": jnp.float64}, jnp.float32)):
                m = jattn.nnx.SelfAttention(F_MODEL, **options, **opts, rngs=nnx.Rngs(0))
                x = jax.random.normal(jax.random.key(1), shape, dtype)
                got = call(m, x)
                assert got.dtype == jnp.float64, opts
                np.testing.assert_allclose(
                    got, kind.module_reference(kind.module, m, x), **ref.tol(jnp.float64), err_msg=str(opts)
                )
                if "param_dtype" in opts:
                    linen = jattn.linen.SelfAttention(F_MODEL, **options, **opts)
                    wide = jax.jit(linen.apply)({"params": ref.linen_params(m)}, x)
                    np.testing.assert_allclose(wide, got, **ref.tol(jnp.float64))

    def test_module_decoding_from_the_cache_equals_the_full_pass(self, module_kind):
        """NNX: a prompt, then one token at a time from the cache; Linen: token by token; both equal the full pass."""
        from flax import nnx

        kind, L = module_kind, module_kind.module_length
        options = dict(num_heads=HEADS, kind=kind.module, **dict(kind.module_options))
        m = jattn.nnx.SelfAttention(F_MODEL, **options, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, L, F_MODEL))
        full = nnx.jit(lambda m, x: m(x))(m, x)
        m.init_cache(2, L)
        decode = nnx.jit(lambda m, x: m(x, decode=True))
        pieces = [decode(m, x[:, : kind.prompt])] + [decode(m, x[:, t : t + 1]) for t in range(kind.prompt, L)]
        np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, **ref.tol(jnp.float32))
        linen = jattn.linen.SelfAttention(F_MODEL, **options)
        cache = linen.init(jax.random.key(0), 2, L, method="init_cache")["cache"]
        step = jax.jit(
            lambda cache, x: linen.apply(
                {"params": ref.linen_params(m), "cache": cache}, x, decode=True, mutable=["cache"]
            )
        )
        outs = []
        for t in range(L):
            y, state = step(cache, x[:, t : t + 1])
            outs.append(y)
            cache = state["cache"]
        np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, **ref.tol(jnp.float32))
