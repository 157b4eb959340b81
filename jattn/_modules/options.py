"""The options of the attention modules, declared once, documented once, and their checks.

:class:`ModuleOptions` is the one declaration of the options :mod:`jattn.nnx` and
:mod:`jattn.linen` share: each option's name, type and default; :data:`OPTION_DOCS` is the one
documentation of each. The NNX constructors and the Linen fields take them under these names, in
this order, with these defaults and annotations (tests/test_modules.py fails where they drift
apart), and :func:`document_options` writes each option's entry from :data:`OPTION_DOCS` into
the public classes' docstrings at import (so ``help()`` and the API reference show them). An NNX
constructor builds its options from its arguments, each passed by name, a Linen module from its
fields of these names. :func:`configure` checks them (a ValueError or TypeError naming the
option, and for an option the kind does not take, the kinds that do) and resolves their defaults
against the module's feature sizes into a :class:`ModuleConfig`, which the module call
(:mod:`jattn._modules.call`) reads. Dimension key: :mod:`jattn._core`.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import Array

from jattn._checks import check_block_size, check_score_mod
from jattn._linear import feature_fn
from jattn._modules.kinds import ModuleKind, kind_names, module_kind
from jattn._paths import check_implementation
from jattn._scalars import check_bool, check_dtype, check_int, check_real
from jattn.score_mods import ScoreMod

__all__ = [
    "OPTION_DOCS",
    "SELF_ATTENTION_ONLY",
    "ModuleConfig",
    "ModuleOptions",
    "check_heads",
    "check_kind",
    "check_path",
    "configure",
    "document_options",
    "refuse_path",
]

SELF_ATTENTION_ONLY = ("rope", "rope_base", "decode", "causal", "num_householder")  # cross-attention takes none
SOFTMAX_ONLY = (
    "dropout_rate",
    "implementation",
    "block_size",
    "score_mod",
    "sinks",
    "sequence_axis",
)  # the other kinds form no scores
OPTIONS_MARKER = "{options}"  # the docstring line :func:`document_options` replaces

# Each option's documentation, in the declaration's order: the one text the public modules' docstrings
# show (document_options). A dict {"nnx": ..., "linen": ...} where the two frameworks differ.
OPTION_DOCS: dict[str, str | dict[str, str]] = {
    "num_heads": "query heads N.",
    "num_kv_heads": (
        "key/value heads K (default N); N/K query heads share one kv head (grouped-query attention; K=1 is "
        "multi-query). Must divide N."
    ),
    "qkv_features": "total query features N*D (default d_model); kv heads have the same head depth D.",
    "out_features": "output features; setting it implies an output projection.",
    "out_proj": (
        "add the output projection ``wo``; default True when ``num_heads > 1`` or ``out_features`` is set. "
        "Without it the output has qkv_features features."
    ),
    "use_bias": "biases on the projections.",
    "kind": (
        "``'softmax'`` (default, :func:`jattn.attention`), ``'linear'`` (:func:`jattn.linear_attention`, whose "
        "only masks are None and ``masks.causal()``), or a recurrent kind of :func:`jattn.gated_linear_attention` "
        "(:data:`jattn.RECURRENT_KINDS`: ``'retention'``, ``'ssd'``, ``'gla'``, ``'deltanet'``, "
        "``'gated_deltanet'``, ``'kda'``, ``'rwkv7'``, ``'deltaproduct'``, ``'gated_deltaproduct'``, and "
        ":func:`jattn.log_linear_attention` over SSD and Gated DeltaNet, ``'log_ssd'`` and ``'log_gated_deltanet'``; causal self-attention with N = K and the papers' gate parameters, listed in the "
        "linear-attention guide). Only the softmax kind forms scores: the others refuse ``dropout_rate``, "
        "``implementation``, ``block_size``, ``score_mod`` and ``sinks``, and the recurrent kinds "
        "``num_kv_heads != num_heads`` and ``sequence_axis``. Cross-attention takes ``'softmax'`` and "
        "``'linear'``."
    ),
    "feature_map": (
        "the feature map of ``kind='linear'`` (``'elu'``, ``'relu'``, ... or a callable); the other kinds refuse "
        "any but the default."
    ),
    "dropout_rate": (
        "dropout on the attention weights, in ``[0, 1)`` (softmax kind only: the other kinds form no weights to "
        "drop, and refuse it)."
    ),
    "deterministic": {
        "nnx": (
            "the default of the call-time switch; dropout is off when True. It is the module's attribute "
            "``deterministic``, Flax's convention as ``nnx.MultiHeadAttention``: ``model.eval()`` sets it True "
            "and ``model.train()`` False in every nested module, and ``nnx.view(model, deterministic=...)`` gives "
            "a view with it set (:meth:`set_view`)."
        ),
        "linen": (
            "the default of the call-time switch; dropout is off when True. The call's ``deterministic`` overrides it."
        ),
    },
    "dtype": "computation dtype (default: inferred from input and params).",
    "param_dtype": "parameter dtype.",
    "precision": "matmul precision for projections and attention.",
    "sequence_axis": (
        "a mesh axis the sequence is sharded over; when the current mesh (``jax.set_mesh``) has it with more "
        "than one device, softmax attention runs as ring attention over it "
        "(:func:`jattn.sequence_parallel_attention`; masks: None or a position-only predicate, no dropout). "
        "Decoding uses the plain core."
    ),
    "implementation": (
        "the path of :func:`jattn.attention` (``'dense'``, ``'blockwise'``, ``'xla'``, ``'cudnn'``, "
        "``'pallas'``; default None: chosen per call). Mask predicates reach the core as they are, so the "
        "blockwise path skips their empty tiles; overridable per call. Softmax kind only (the other kinds have "
        "one path each, and refuse it)."
    ),
    "block_size": (
        "the blockwise tiles ``(block_q, block_kv)`` or one int (default: chosen from the mask); overridable "
        "per call. Softmax kind only, as ``implementation``."
    ),
    "normalize_qk": (
        "QK normalisation as Flax's ``MultiHeadAttention(normalize_qk=True)``: a bias-free LayerNorm over the "
        "head depth D (``query_ln``, ``key_ln``; scale shared by the heads, epsilon 1e-6) on queries and keys "
        "after their projections."
    ),
    "rope": (
        "rotary position embeddings (:func:`jattn.rope`) on queries and keys (after the QK norm) at their "
        "absolute positions: ``0..T-1``, or the cache's positions when decoding (so decoding equals the full "
        "pass). Needs an even head depth D."
    ),
    "rope_base": "the wavelength base of ``rope`` (> 0).",
    "decode": "default for the call-time ``decode`` switch (Flax's field of that name).",
    "causal": (
        "True: every call is causal, ``masks.causal()`` and-ed into the call's mask (``mask=None`` included) "
        "in a full pass and when decoding, so a decoder cannot look ahead through a forgotten mask. False (the "
        "default, Flax's convention): the mask is the call's alone, and ``mask=None`` is bidirectional in a "
        "full pass (every token sees the later ones) but causal with ``decode=True``. The recurrent kinds are "
        "causal either way."
    ),
    "score_mod": (
        "a score modification ``(score, batch, head, q_pos, kv_pos) -> score`` (:mod:`jattn.score_mods`: "
        "``softcap``, ``alibi``, ...) that :func:`jattn.attention` applies on every call (softmax kind). "
        "``head`` is the query head n (kv head ``n // (N/K)``); ``q_pos``, ``kv_pos`` are absolute positions: "
        "``0..T-1`` in a full pass, the cache's positions when decoding (so decoding equals the full pass). "
        "Arrays it closes over are constants of the module (not parameters): hold learned ones yourself and "
        "build the module's mod from them."
    ),
    "sinks": (
        "a learned sink logit per query head, the parameter ``sinks (N,)`` (zeros at init, head "
        "n = k·(N/K) + g as the heads are split), passed as :func:`jattn.attention`'s ``sinks``: each row's "
        "softmax denominator gains ``e^sink`` (softmax kind)."
    ),
    "num_householder": (
        "``n_h``, the delta (Householder) steps a token of ``kind='deltaproduct'`` and ``'gated_deltaproduct'`` "
        "(:func:`jattn.gated_linear_attention`'s ``num_householder``; default None: 2): ``wk`` and ``wv`` project "
        "to ``n_h·N·D`` features, ``n_h`` keys and values a token. The other kinds take none (leave it None)."
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleOptions:
    """The options of :class:`jattn.nnx.SelfAttention` and :class:`jattn.linen.SelfAttention`.

    Each is documented in :data:`OPTION_DOCS`, which the public classes' docstrings show
    (:func:`document_options`). Cross-attention (:class:`jattn.nnx.CrossAttention`,
    :class:`jattn.linen.CrossAttention`) takes all of them but :data:`SELF_ATTENTION_ONLY`
    (:meth:`cross`). Each constructor passes every option by name (a misspelt one is a
    ``TypeError``; tests/test_modules.py fails on a missing one).
    """

    num_heads: int = 1
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    out_proj: bool | None = None
    use_bias: bool = False
    kind: str = "softmax"
    feature_map: str | Callable[[Array], Array] = "elu"
    dropout_rate: float = 0.0
    deterministic: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: jax.lax.PrecisionLike = None
    sequence_axis: str | None = None
    implementation: str | None = None
    block_size: int | tuple[int, int] | None = None
    normalize_qk: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    decode: bool = False
    causal: bool = False
    score_mod: ScoreMod | None = None
    sinks: bool = False
    num_householder: int | None = None

    @classmethod
    def cross(cls, **options: Any) -> ModuleOptions:
        """A cross-attention module's options: every option but :data:`SELF_ATTENTION_ONLY`, which keep their defaults."""
        fixed = {f.name: f.default for f in dataclasses.fields(cls) if f.name in SELF_ATTENTION_ONLY}
        return cls(**options, **fixed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleConfig(ModuleOptions):
    """A module's options, checked and resolved for its feature sizes (what the module call reads).

    Every default is resolved: ``num_kv_heads`` is K, ``qkv_features`` is N*D, ``out_proj`` a
    bool and ``out_features`` the features of ``wo`` (None: no output projection).
    ``deterministic`` is the constructor's value; the switch a call reads is the module's own
    (the NNX attribute that ``.eval()``/``.train()``/``nnx.view`` set, the Linen field).
    """

    d_model: int
    kv_features: int  # the features keys and values are projected from: d_model, or context_features
    head_depth: int  # D


Class = TypeVar("Class", bound=type)


def _entry(name: str, framework: str, indent: str) -> str:
    """One option's docstring entry ``name: text`` from :data:`OPTION_DOCS`, wrapped at 100 columns."""
    text = OPTION_DOCS[name]
    text = text[framework] if isinstance(text, dict) else text
    return textwrap.fill(
        f"{name}: {text}",
        width=100,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def document_options(framework: str) -> Callable[[Class], Class]:
    """A class decorator: the line ``{options}`` of the class's docstring becomes its options' entries.

    The options are those of :class:`ModuleOptions` the class takes (its constructor's
    parameters: NNX arguments, Linen fields), in the declaration's order, each with its text
    from :data:`OPTION_DOCS` (``framework``: ``'nnx'`` or ``'linen'``), at the marker's indentation.
    """

    def document(cls: Class) -> Class:
        taken = inspect.signature(cls.__init__).parameters  # NNX: the constructor's; Linen: the fields
        names = [f.name for f in dataclasses.fields(ModuleOptions) if f.name in taken]
        doc = (cls.__doc__ or "").split("\n")
        markers = [i for i, line in enumerate(doc) if line.strip() == OPTIONS_MARKER]
        if len(markers) != 1 or not names:
            raise ValueError(f"{cls.__qualname__} needs one {OPTIONS_MARKER} line in its docstring and options")
        line = doc[markers[0]]
        indent = line[: len(line) - len(line.lstrip())]
        doc[markers[0]] = "\n".join(_entry(name, framework, indent) for name in names)
        cls.__doc__ = "\n".join(doc)
        return cls

    return document


def check_heads(d_model: int, num_heads: int, num_kv_heads: int | None, qkv_features: int | None) -> tuple[int, int]:
    """Validates the head configuration; returns ``(num_kv_heads, head_depth)``."""
    d_model, num_heads = check_int("d_model", d_model, min=1), check_int("num_heads", num_heads, min=1)
    kv = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, min=1)
    features = d_model if qkv_features is None else check_int("qkv_features", qkv_features, min=1)
    if num_heads % kv:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of num_heads={num_heads}")
    if features % num_heads:
        raise ValueError(f"qkv_features={features!r} must be a positive multiple of num_heads={num_heads}")
    return kv, features // num_heads


def check_kind(kind: str, feature_map: object, *, cross: bool = False) -> ModuleKind:
    """The record of the attention kind (``cross``: of a cross-attention module); checks a feature map it reads."""
    record = module_kind(kind)
    if cross and not record.cross:
        takes = [name for name in kind_names() if module_kind(name).cross]
        raise ValueError(
            f"kind={kind!r} is causal self-attention (a recurrence along x's own sequence, with gates computed "
            f"from x): CrossAttention takes kind {' or '.join(map(repr, takes))}; use SelfAttention for it"
        )
    if record.feature_map:
        feature_fn(feature_map)
    elif not (isinstance(feature_map, str) and feature_map == "elu"):
        raise ValueError(
            f"feature_map={feature_map!r} is the feature map of kind='linear' (linear attention); kind={kind!r} "
            "takes none (leave it at its default)"
        )
    return record


def check_path(implementation: str | None, block_size: int | tuple[int, int] | None) -> None:
    """Validates a module's ``implementation`` and ``block_size`` (as :func:`jattn.attention` takes them)."""
    check_implementation(implementation)
    check_block_size(block_size)


def refuse_path(kind: ModuleKind, implementation: str | None, block_size: int | tuple[int, int] | None) -> None:
    """Raises unless ``implementation`` and ``block_size`` are None for a kind that forms no scores (they choose its path)."""
    if not kind.scores and (implementation is not None or block_size is not None):
        raise ValueError(
            f"implementation and block_size choose the path of softmax attention (jattn.attention, "
            f"kind='softmax'); kind={kind.name!r} has one path and takes neither, got implementation={implementation!r}, "
            f"block_size={block_size!r}"
        )


def _check_types(o: ModuleOptions) -> None:
    """Validates the options that stand on their own (types, ranges and dtypes), in their order."""
    if o.out_features is not None:
        check_int("out_features", o.out_features, min=1)
    if o.out_proj is not None:
        check_bool("out_proj", o.out_proj)
    check_bool("use_bias", o.use_bias)
    check_bool("deterministic", o.deterministic)
    check_real("dropout_rate", o.dropout_rate, low=0.0, high=1.0)
    check_dtype("dtype", o.dtype, optional=True)
    check_dtype("param_dtype", o.param_dtype)
    if o.sequence_axis is not None and not isinstance(o.sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {o.sequence_axis!r}")
    check_path(o.implementation, o.block_size)
    check_bool("normalize_qk", o.normalize_qk)
    check_bool("rope", o.rope)
    check_bool("decode", o.decode)
    check_bool("causal", o.causal)
    check_score_mod(o.score_mod)
    check_bool("sinks", o.sinks)


def _check_scores(o: ModuleOptions, kind: ModuleKind, kv_heads: int) -> None:
    """A kind that forms no scores refuses what acts on them (:data:`SOFTMAX_ONLY`), and a state a head fewer kv heads."""
    if kind.scores:
        return
    refused = {
        "num_kv_heads": kind.same_heads and kv_heads != o.num_heads,
        "score_mod": o.score_mod is not None,
        "sinks": o.sinks,
        "dropout_rate": o.dropout_rate != 0,
        "sequence_axis": o.sequence_axis is not None,
        "implementation": o.implementation is not None,
        "block_size": o.block_size is not None,
    }
    names = [name for name, bad in refused.items() if bad]
    if not names:
        return
    got = ", ".join(f"{name}={getattr(o, name)!r}" for name in names)
    if kind.same_heads:
        raise ValueError(
            f"kind={o.kind!r} ({kind.what}) takes num_kv_heads = num_heads and no score_mod, sinks, dropout_rate, "
            f"sequence_axis, implementation or block_size (those are softmax attention's: kind='softmax'); got {got}"
        )
    raise ValueError(
        f"kind={o.kind!r} ({kind.what}) forms no attention weights and has one path: dropout_rate, implementation, "
        f"block_size, sequence_axis (ring attention), score_mod and sinks need kind='softmax'; got {got}"
    )


def _householder(o: ModuleOptions, kind: ModuleKind) -> int:
    """The DeltaProduct kinds' ``n_h`` (default 2), 1 for the other kinds, which refuse any but None."""
    if kind.householder:
        return 2 if o.num_householder is None else check_int("num_householder", o.num_householder, min=1)
    if o.num_householder is not None:
        takes = " or ".join(repr(name) for name in kind_names() if module_kind(name).householder)
        raise ValueError(
            f"num_householder is DeltaProduct's (kind={takes}): kind={o.kind!r} takes "
            f"none (leave it None), got num_householder={o.num_householder!r}"
        )
    return 1


def configure(d_model: int, kv_features: int, options: ModuleOptions, *, cross: bool = False) -> ModuleConfig:
    """Checks ``options`` (a ValueError or TypeError naming the option) and resolves their defaults.

    ``d_model``: the query features; ``kv_features``: the features of the keys' and values'
    input (``d_model`` for self-attention, ``context_features`` for cross-attention, ``cross``).
    """
    o = options
    kv_heads, depth = check_heads(d_model, o.num_heads, o.num_kv_heads, o.qkv_features)
    kind = check_kind(o.kind, o.feature_map, cross=cross)
    check_int("context_features (kv features)", kv_features, min=1)
    _check_types(o)
    _check_scores(o, kind, kv_heads)
    householder = _householder(o, kind)
    rope_base = check_real("rope_base", o.rope_base, low=0.0, open_low=True)
    if o.rope and depth % 2:
        raise ValueError(f"rope=True needs an even head depth D = qkv_features / num_heads, got D={depth}")
    out_proj = (o.num_heads > 1 or o.out_features is not None) if o.out_proj is None else o.out_proj
    if o.out_features is not None and not out_proj:
        raise ValueError(f"out_features={o.out_features} needs out_proj=True")
    resolved = dict(
        d_model=int(d_model),
        kv_features=int(kv_features),
        head_depth=depth,
        num_heads=int(o.num_heads),
        num_kv_heads=kv_heads,
        qkv_features=int(o.num_heads) * depth,
        out_proj=bool(out_proj),
        out_features=int(o.out_features or d_model) if out_proj else None,
        dropout_rate=float(o.dropout_rate),
        block_size=tuple(o.block_size) if isinstance(o.block_size, list) else o.block_size,
        rope_base=rope_base,
        num_householder=householder,
        **{
            flag: bool(getattr(o, flag))
            for flag in ("use_bias", "deterministic", "normalize_qk", "rope", "decode", "causal", "sinks")
        },
    )
    return ModuleConfig(**{f.name: getattr(o, f.name) for f in dataclasses.fields(ModuleOptions)} | resolved)
