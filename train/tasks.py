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
        """What attention that solves the task looks like (for the title of attention pictures)."""
        raise NotImplementedError

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
            f"each query key (positions {2 * self.num_pairs}, {2 * self.num_pairs + 2}, ...) reads the value "
            "right after the same key in the context"
        )

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
            f"answers (positions {self.size - 1}-{self.length - 1}) read the unsorted first {self.size} tokens "
            "holding the next value in order"
        )

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
    copy and copy its successor, which makes clean attention pictures.
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

    def sequence(self, key: Array) -> tuple[Array, Array]:
        b = jax.random.randint(key, (self.size,), 0, self.vocab)
        return jnp.concatenate([b, b]).astype(jnp.int32), jnp.arange(self.length) >= self.size - 1


TASKS: dict[str, type[Task]] = {t.name: t for t in (MQAR, Sort, Reverse, Induction)}
