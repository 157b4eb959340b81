"""A small serving engine: continuous batching of requests over a paged KV pool (:mod:`train.pages`).

Every step runs one jitted call of :meth:`train.model.Decoder.paged` on a flat ragged batch: decoding requests
give one token each, then requests in prefill give a chunk of their prompt, under a token budget a step. Requests
are admitted as pages allow (each reserves its worst case), take pages as they grow and give them back when they
end; the requests of one prompt (``samples`` completions) share its whole pages. Shapes are padded to buckets
(powers of two) so jit compiles a handful of programs, not one a step. Sampling draws each token from its own key,
``fold_in(fold_in(key(seed), request.seed), position)``, so a request's tokens do not depend on the batch.

``static=True`` is the baseline of a static padded batch: a batch of requests is admitted only when the previous
one has ended, its prompts are padded to the longest (one prefill step) and it decodes until its longest request
ends (ended requests ride along as padding).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jattn.nnx
from train.model import Decoder
from train.pages import PagePool, pages_for

__all__ = ["Engine", "EngineConfig", "Group", "Request"]


@dataclasses.dataclass(eq=False)
class Group:
    """The requests of one prompt: its whole pages (all but the one with its last token) are shared once computed."""

    shared: int  # pages shared: (prompt length - 1) // page_size
    waiting: int  # members not yet admitted
    leader: Request | None = None
    pages: list[int] | None = None  # the group's own references, from the leader's prefill until all are admitted


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt to continue by ``max_new`` tokens; ``seed`` picks its sampling keys."""

    id: int
    prompt: np.ndarray
    max_new: int
    seed: int
    group: Group | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt then generated
    logprobs: list[float] = dataclasses.field(default_factory=list)  # of each generated token (float32)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys are in the pool
    reserved: int = 0  # pages promised and not yet taken

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.prompt]

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new

    @property
    def pending(self) -> int:
        """Tokens not yet in the pool (the rest of the prompt, or the last sampled token)."""
        return 0 if self.done else len(self.tokens) - self.computed


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The pool (``num_pages`` of ``page_size``), a step's ``token_budget``, the ``max_running`` requests, sampling.

    ``max_len``: the longest request (prompt + new tokens; the page table's width). ``temperature`` 0: greedy.
    """

    num_pages: int
    page_size: int
    max_len: int
    token_budget: int = 256
    max_running: int = 64
    temperature: float = 0.0
    seed: int = 0
    static: bool = False
    min_bucket: int = 16


def _bucket(n: int, smallest: int) -> int:
    """The padded size of ``n``: the next power of two, at least ``smallest``."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


def _device_step(graphdef, temperature: float, seed: int, params, pool, tokens, batch, rows, seeds, positions):
    """Logits at ``rows``, the sampled tokens ``(R,)``, their logprobs ``(R,)`` float32, and the pool after the step."""
    model = nnx.merge(graphdef, params, pool)
    logits = model.paged(tokens, batch, rows).astype(jnp.float32)  # (R, vocab)
    pool = nnx.state(model, nnx.Cache)
    logp = jax.nn.log_softmax(logits, axis=-1)
    if temperature > 0:
        base = jax.random.key(seed)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(seeds, positions)
        tok = jax.vmap(lambda k, x: jax.random.categorical(k, x / temperature))(keys, logits)
    else:
        tok = jnp.argmax(logits, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], pool


@functools.cache
def _compiled(graphdef, temperature: float, seed: int):
    """The jitted step of a model structure (shared by engines of one model: their programs compile once)."""
    return jax.jit(functools.partial(_device_step, graphdef, temperature, seed), donate_argnums=1)


class Engine:
    """Continuous batching of :class:`Request` s on ``model`` (a :class:`~train.model.Decoder` with attention)."""

    def __init__(self, model: Decoder, cfg: EngineConfig) -> None:
        if cfg.token_budget < cfg.max_running and not cfg.static:
            raise ValueError(f"token_budget={cfg.token_budget} must fit a decode token of each of max_running="
                             f"{cfg.max_running} requests")  # fmt: skip
        self.cfg = cfg
        model.init_paged_cache(cfg.num_pages, cfg.page_size)
        graphdef, self.params, self.pool = nnx.split(model, nnx.Param, nnx.Cache)
        self.width = pages_for(cfg.max_len, cfg.page_size)  # M: the page table's columns
        self.pages = PagePool(cfg.num_pages, cfg.page_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.steps = self.tokens_computed = self.tokens_padded = 0
        self._step = _compiled(graphdef, cfg.temperature, cfg.seed)

    def add(self, request: Request) -> None:
        """Queues ``request`` (it runs when pages and ``max_running`` allow)."""
        if len(request.prompt) < 1 or request.max_new < 1 or len(request.prompt) + request.max_new > self.cfg.max_len:
            raise ValueError(f"request {request.id}: prompt of {len(request.prompt)} tokens + {request.max_new} new "
                             f"must be 1 + 1 .. max_len={self.cfg.max_len}")  # fmt: skip
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _need(self, request: Request, shared: int) -> int:
        """Pages ``request`` may take besides ``shared`` ones: its keys (the last new token's is never written)."""
        length = self._static_len if self.cfg.static else len(request.prompt) + request.max_new
        return pages_for(length, self.cfg.page_size) - shared

    def _admit(self) -> None:
        """Moves waiting requests to running while ``max_running`` and the pool allow (a static batch: all at once)."""
        if self.cfg.static and self.running:
            return
        if self.cfg.static:  # padded to the batch's longest prompt and longest request
            batch = list(self.waiting)[: self.cfg.max_running]
            self._static_len = max(len(r.prompt) for r in batch) + max(r.max_new for r in batch) if batch else 0
        kept: collections.deque[Request] = collections.deque()
        while self.waiting and len(self.running) < self.cfg.max_running:
            request = self.waiting.popleft()
            group = None if self.cfg.static else request.group
            if group is not None and group.shared and group.leader is not None and group.pages is None:
                kept.append(request)  # the leader has not computed the shared pages yet
                continue
            shared = group.pages if group is not None and group.pages else []
            need = self._need(request, len(shared))
            if not self.pages.can_reserve(need):
                kept.append(request)
                break
            self.pages.reserve(need)
            request.reserved = need
            request.pages = [self.pages.share(p) for p in shared]
            request.computed = len(shared) * self.cfg.page_size
            if group is not None:
                group.leader = group.leader or request
                group.waiting -= 1
                self._settle(group)
            self.running.append(request)
        self.waiting.extendleft(reversed(kept))

    def _settle(self, group: Group) -> None:
        """The group's references: taken once its leader computed the shared pages, dropped once all are admitted."""
        leader = group.leader
        if group.pages is None and leader is not None and leader.computed >= group.shared * self.cfg.page_size:
            group.pages = [self.pages.share(p) for p in leader.pages[: group.shared]]
        if group.waiting == 0 and group.pages:
            self.pages.release(group.pages)
            group.pages = []

    def _schedule(self) -> list[tuple[Request, int, int]]:
        """The step's ``(request, real tokens, padding tokens)``: decodes first, then prefill chunks in order."""
        if self.cfg.static:
            longest = max(r.pending for r in self.running)
            return [(r, r.pending, longest - r.pending) for r in self.running]
        budget, plan = self.cfg.token_budget, []
        for r in sorted(self.running, key=lambda r: r.pending > 1):  # stable: decodes, then prefills in order
            n = min(r.pending, budget)
            if n > 0:
                plan.append((r, n, 0))
                budget -= n
        return plan

    def _grow(self, request: Request, length: int) -> None:
        """Pages for ``length`` keys of ``request``, taken from its reservation."""
        while len(request.pages) < pages_for(length, self.cfg.page_size):
            request.pages.append(self.pages.allocate())
            request.reserved -= 1

    def _arrays(self, plan: list[tuple[Request, int, int]]) -> tuple:
        """The step's padded inputs: tokens ``(Q,)``, the :class:`jattn.nnx.PagedBatch`, rows, seeds, positions."""
        z, total = self.cfg.page_size, sum(n + pad for _, n, pad in plan)
        q, r = _bucket(total, self.cfg.min_bucket), _bucket(len(plan), 4)
        tokens, pages = np.zeros(q, np.int32), np.full(q, self.cfg.num_pages, np.int32)  # page P: not written
        slots, positions = np.zeros(q, np.int32), np.zeros(q, np.int32)
        table, kv_lens, cu = np.zeros((r, self.width), np.int32), np.zeros(r, np.int32), np.zeros(r + 1, np.int32)
        rows, seeds, sample_at = np.zeros(r, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
        start = 0
        for i, (req, n, pad) in enumerate(plan):
            length = req.computed + n + pad
            self._grow(req, length)
            pos = np.arange(req.computed, length)
            tokens[start : start + n] = req.tokens[req.computed : req.computed + n]
            page_of = np.asarray(req.pages, np.int32)
            pages[start : start + n + pad], slots[start : start + n + pad] = page_of[pos // z], pos % z
            positions[start : start + n + pad] = pos
            table[i, : len(req.pages)] = page_of
            kv_lens[i], cu[i + 1] = length, start + n + pad
            rows[i], seeds[i], sample_at[i] = start + max(n, 1) - 1, req.seed, req.computed + n
            start += n + pad
        cu[len(plan) + 1 :] = start
        batch = jattn.nnx.PagedBatch(table, kv_lens, cu, pages, slots, positions)
        return tokens, batch, rows, seeds, sample_at

    def step(self) -> int:
        """Admits, runs one ragged step, samples, retires; returns the real tokens computed (0: nothing to do)."""
        self._admit()
        plan = self._schedule() if self.running else []
        if not plan:
            return 0
        tokens, batch, rows, seeds, sample_at = self._arrays(plan)
        tok, logp, self.pool = self._step(self.params, self.pool, tokens, batch, rows, seeds, sample_at)
        tok, logp = np.asarray(tok), np.asarray(logp)  # the one host sync a step
        for i, (req, n, pad) in enumerate(plan):
            req.computed += n
            self.tokens_computed += n
            self.tokens_padded += pad
            if n and req.computed == len(req.tokens) and not req.done:
                req.tokens.append(int(tok[i]))
                req.logprobs.append(logp[i])
            if req.group is not None and not self.cfg.static:
                self._settle(req.group)
        self._retire()
        self.steps += 1
        return sum(n for _, n, _ in plan)

    def _retire(self) -> None:
        """Ended requests give their pages and what is left of their reservation back (a static batch: together)."""
        ended = [r for r in self.running if r.done]
        if self.cfg.static and len(ended) < len(self.running):
            return
        for r in ended:
            self.pages.release(r.pages)
            self.pages.unreserve(r.reserved)
            r.pages, r.reserved = [], 0
            self.running.remove(r)
            self.finished.append(r)

    def run(self) -> list[Request]:
        """Steps until every request has ended; returns them in the order they ended."""
        while not self.idle:
            if not self.step() and not self.running:
                raise RuntimeError(f"{len(self.waiting)} requests cannot be admitted: the pool is too small")
        return self.finished
