"""Toy sequence tasks, generated on the device from a PRNG key (so inside the jitted step).

Every task is next-token prediction over one sequence ``seq`` of ``length + 1`` tokens: the model
reads ``inputs = seq[:-1]`` and predicts ``targets = seq[1:]``, and the loss counts only the
positions in ``mask`` (the part of the sequence the task defines as the answer).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array


class Batch(NamedTuple):
    """``inputs``, ``targets`` int32 ``(B, L)`` and the loss ``mask`` bool ``(B, L)``."""

    inputs: Array
    targets: Array
    mask: Array


class LayerRole(NamedTuple):
    """What one layer of a model that solves a task is expected to attend to (for attention pictures).

    ``title`` is a short phrase that titles each of the layer's panels; ``detail`` is the sentence
    the picture's text gives for the layer.
    """

    title: str
    detail: str


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its sizes, its chance level, and a sampler of one sequence."""

    name: ClassVar[str]

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def length(self) -> int:
        """L, the model's input length."""
        raise NotImplementedError

    @property
    def chance(self) -> float:
        """Per-token accuracy of the best guess that ignores the context."""
        raise NotImplementedError

    @property
    def pattern(self) -> str:
        """What attention that solves the task looks like, all layers together (for attention pictures)."""
        raise NotImplementedError

    @property
    def rule(self) -> str:
        """What the task asks, in one line that names its positions (the title of attention pictures)."""
        raise NotImplementedError

    @property
    def layer_roles(self) -> dict[int, tuple[LayerRole, ...]]:
        """Per number of layers, what each layer of a model that solves the task is expected to do.

        ``{num_layers: (role of layer 0, role of layer 1, ...)}``, the first layer first; only the
        depths written here are described (:meth:`roles` says so for others).
        """
        raise NotImplementedError

    def roles(self, num_layers: int) -> tuple[LayerRole, ...]:
        """``layer_roles[num_layers]``, or for a depth not described a role per layer saying so."""
        described = self.layer_roles
        if num_layers in described:
            return described[num_layers]
        depths = ", ".join(map(str, sorted(described)))
        role = LayerRole(
            "no expected role written",
            f"no expected roles are written for a {num_layers}-layer model (only for {depths} layers)",
        )
        return (role,) * num_layers

    def sequence(self, key: Array) -> tuple[Array, Array]:
        """One sequence ``(L + 1,)`` int32 and its answer mask over targets ``(L,)``."""
        raise NotImplementedError

    def token_names(self) -> list[str]:
        """Short labels of the vocabulary, for pictures and examples."""
        return [str(i) for i in range(self.vocab_size)]

    def scaled(self, factor: int) -> Task:
        """The same rule over about ``factor`` times the length (for evaluating past the training length)."""
        raise NotImplementedError(f"task {self.name!r} has no longer version")

    def batch(self, key: Array, size: int) -> Batch:
        """A batch of ``size`` independent sequences drawn from ``key``."""
        seq, mask = jax.vmap(self.sequence)(jax.random.split(key, size))
        return Batch(seq[:, :-1], seq[:, 1:], mask)


@dataclasses.dataclass(frozen=True)
class MQAR(Task):
    """Multi-query associative recall (Zoology): ``k1 v1 .. kP vP  q1 a1 .. qQ aQ``.

    Keys are distinct within a sequence and drawn from ``num_keys`` key tokens; values from
    ``num_values`` value tokens. Each query is one of the sequence's keys (distinct, in random
    order) and its answer is that key's value: the loss is on the answers only. Without looking
    back, the best guess is right once in ``num_values``.
    """

    name: ClassVar[str] = "mqar"
    num_pairs: int = 8
    num_queries: int = 8
    num_keys: int = 32
    num_values: int = 32

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def length(self) -> int:
        return 2 * (self.num_pairs + self.num_queries) - 1

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    @property
    def pattern(self) -> str:
        return (
            f"each query key (positions {self._queries}) reads a position 1 to 3 after the same key's "
            "earlier occurrence, where a layer before has put that key together with its value"
        )

    @property
    def _queries(self) -> str:
        """The query positions, e.g. ``"16, 18, ..., 30"``."""
        shown = [str(p) for p in range(2 * self.num_pairs, self.length, 2)]
        return ", ".join(shown if len(shown) <= 3 else [*shown[:2], "...", shown[-1]])

    @property
    def rule(self) -> str:
        return (
            f"{self.num_pairs} key-value pairs (positions 0-{2 * self.num_pairs - 1}), then {self.num_queries} of "
            f"the keys again, each followed by its value: at each query key (positions {self._queries}) the "
            "answer is the value that followed that key before"
        )

    @property
    def layer_roles(self) -> dict[int, tuple[LayerRole, ...]]:
        one = LayerRole(
            "cannot solve it: finds the key, not its value",
            "one layer is not expected to solve MQAR: a query can find its key's earlier occurrence, but no "
            "position holds a key together with its value yet (that takes a layer before)",
        )
        pair = LayerRole(
            "looks 1-3 back: puts each key with its value",
            "looks 1 to 3 positions back, so that a position at or just after each value (often the next key) "
            "holds the key together with its value",
        )
        recall = LayerRole(
            "a query reads 1-3 after its key's earlier occurrence",
            f"each query (rows {self._queries}) reads such a position, 1 to 3 after its key's earlier "
            "occurrence (not the key itself, which does not know the value); the other rows have nothing to find",
        )
        return {1: (one,), 2: (pair, recall)}

    def sequence(self, key: Array) -> tuple[Array, Array]:
        kk, kv, kq = jax.random.split(key, 3)
        keys = jax.random.choice(kk, self.num_keys, (self.num_pairs,), replace=False)
        values = self.num_keys + jax.random.randint(kv, (self.num_pairs,), 0, self.num_values)
        asked = jax.random.permutation(kq, self.num_pairs)[: self.num_queries]
        context = jnp.stack([keys, values], axis=1).reshape(-1)
        queries = jnp.stack([keys[asked], values[asked]], axis=1).reshape(-1)
        seq = jnp.concatenate([context, queries]).astype(jnp.int32)
        target_pos = jnp.arange(self.length) + 1  # targets[i] = seq[i + 1]
        mask = (target_pos >= 2 * self.num_pairs) & (target_pos % 2 == 1)
        return seq, mask

    def token_names(self) -> list[str]:
        return [f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]


@dataclasses.dataclass(frozen=True)
class _TwoHalves(Task):
    """Tasks of ``size`` tokens over ``vocab`` symbols followed by a transformed copy."""

    size: int = 6
    vocab: int = 3

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def length(self) -> int:
        return 2 * self.size - 1

    @property
    def chance(self) -> float:
        return 1.0 / self.vocab

    def scaled(self, factor: int) -> Task:
        """``factor`` times ``size`` tokens over the same vocabulary (about ``factor`` times the length)."""
        return dataclasses.replace(self, size=self.size * factor)


@dataclasses.dataclass(frozen=True)
class Sort(_TwoHalves):
    """minGPT's sort demo: ``x1..xn`` then the same tokens sorted; loss on the sorted half."""

    name: ClassVar[str] = "sort"
    size: int = 6
    vocab: int = 3

    @property
    def pattern(self) -> str:
        return (
            f"answers (positions {self.size - 1}-{self.length - 1}) spread over the unsorted first {self.size} "
            "tokens, a little more on those holding the next value in order: blurred rows, not one bright cell"
        )

    @property
    def rule(self) -> str:
        return (
            f"{self.size} tokens over {self.vocab} symbols (positions 0-{self.size - 1}), then the same tokens "
            f"sorted: from position {self.size - 1} on, the answer is the next token of the sorted copy"
        )

    @property
    def layer_roles(self) -> dict[int, tuple[LayerRole, ...]]:
        count = LayerRole(
            "answers spread over the unsorted tokens (counting)",
            f"answers spread their weight over the unsorted tokens (positions 0-{self.size - 1}), which counts "
            "each symbol; with the answer's position that fixes the next sorted token, so one layer is enough",
        )
        again = LayerRole(
            "spread again, some weight on the answers so far",
            "spreads again over the unsorted tokens (a little more on those equal to the next answer) and over "
            f"the answers so far: sorting {self.vocab} symbols is counting, not copying one position",
        )
        return {1: (count,), 2: (count, again)}

    def sequence(self, key: Array) -> tuple[Array, Array]:
        x = jax.random.randint(key, (self.size,), 0, self.vocab)
        seq = jnp.concatenate([x, jnp.sort(x)]).astype(jnp.int32)
        return seq, jnp.arange(self.length) >= self.size - 1


@dataclasses.dataclass(frozen=True)
class Reverse(_TwoHalves):
    """``x1..xn | xn..x1``: the tokens, a separator, then the tokens reversed (loss on those)."""

    name: ClassVar[str] = "reverse"
    size: int = 8
    vocab: int = 10

    @property
    def vocab_size(self) -> int:
        return self.vocab + 1  # + the separator

    @property
    def length(self) -> int:
        return 2 * self.size

    @property
    def pattern(self) -> str:
        return f"an anti-diagonal: answer position t reads position {self.length - 1}-t"

    @property
    def rule(self) -> str:
        return (
            f"{self.size} tokens (positions 0-{self.size - 1}), '|', then the tokens reversed: from the '|' "
            f"(position {self.size}) on, position t's answer is the token at position {self.length - 1}-t"
        )

    @property
    def layer_roles(self) -> dict[int, tuple[LayerRole, ...]]:
        t = self.length - 1
        lookup = LayerRole(
            f"answer t reads position {t}-t (anti-diagonal)",
            f"answer t reads position {t}-t, an anti-diagonal: the lookup depends on positions only, so one "
            "layer is enough",
        )
        first = lookup._replace(detail=lookup.detail + " (it may sit in layer 1 instead)")
        free = LayerRole(
            "nothing left to look up: any pattern",
            "nothing is left to look up once layer 0 has copied: any pattern (or the anti-diagonal, if layer 0 "
            "did not)",
        )
        return {1: (lookup,), 2: (first, free)}

    def sequence(self, key: Array) -> tuple[Array, Array]:
        x = jax.random.randint(key, (self.size,), 0, self.vocab)
        seq = jnp.concatenate([x, jnp.array([self.vocab]), x[::-1]]).astype(jnp.int32)
        return seq, jnp.arange(self.length) >= self.size

    def token_names(self) -> list[str]:
        return [*map(str, range(self.vocab)), "|"]


@dataclasses.dataclass(frozen=True)
class Induction(_TwoHalves):
    """A random block ``b`` of ``size`` tokens, then ``b`` again; loss on the repeat.

    Solved by an induction head: at each token of the repeat, find the same token in the first
    copy and copy its successor, which makes clean attention pictures. The offset is always
    ``size - 1``, so with a learned position table one layer can also copy by position alone
    (the default config's model does, in layer 0); ALiBi's relative positions need the circuit.
    """

    name: ClassVar[str] = "induction"
    size: int = 12
    vocab: int = 16

    @property
    def pattern(self) -> str:
        return (
            f"each token of the repeat reads the token after its previous occurrence: position t reads "
            f"t-{self.size - 1} (a stripe {self.size - 1} positions below the diagonal)"
        )

    @property
    def rule(self) -> str:
        return (
            f"a random block of {self.size} tokens (positions 0-{self.size - 1}), then the block again: from "
            f"position {self.size - 1} on, position t's answer is the token at position t-{self.size - 1}"
        )

    @property
    def layer_roles(self) -> dict[int, tuple[LayerRole, ...]]:
        k = self.size - 1
        direct = LayerRole(
            f"t reads t-{k} by position",
            f"with learned positions one layer is enough: the offset is always {k}, so position t reads t-{k} "
            f"by position alone (a stripe {k} below the diagonal)",
        )
        first = LayerRole(
            f"t reads t-{k} (by position), or t-1 (previous token)",
            f"either copies by position (t reads t-{k}; one layer is enough with learned positions) or is a "
            "previous-token head (t reads t-1), so that each position also holds the token before it",
        )
        induction = LayerRole(
            f"induction: t reads t-{k}, if layer 0 did not",
            f"after a previous-token layer 0, an induction head: each token of the repeat reads the token after "
            f"its earlier occurrence (t-{k}); if layer 0 already copied, nothing is left: any pattern",
        )
        return {1: (direct,), 2: (first, induction)}

    def sequence(self, key: Array) -> tuple[Array, Array]:
        b = jax.random.randint(key, (self.size,), 0, self.vocab)
        return jnp.concatenate([b, b]).astype(jnp.int32), jnp.arange(self.length) >= self.size - 1


TASKS: dict[str, type[Task]] = {t.name: t for t in (MQAR, Sort, Reverse, Induction)}
