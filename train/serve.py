"""``python -m train.serve --run runs/<name>``: serve a trained run from a paged KV pool, continuous batching.

Requests are held-out examples of the run's task cut to prompts of mixed lengths, each continued by
``--max-new-tokens`` tokens (``--samples`` completions of each prompt, which share its pages), greedy or sampled
(``--temperature``; each token from its own key, so a request's tokens do not depend on the batch). The engine
(:mod:`train.engine`) runs ragged steps of prefill chunks and decode tokens under ``--token-budget``; the report
gives tokens/s and the pool's use (peak pages, pages reused, shared prompt pages). With ``--batch-invariant`` (the
default) every matmul runs on fixed row tiles, so a request's tokens and logprobs are bitwise those of serving it
alone and of the training forward. Ctrl-C stops between steps and prints what finished.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from train import loop
from train.engine import Engine, EngineConfig, Group, Request
from train.model import make_batch_invariant
from train.pages import pages_for
from train.rundir import RunError, positive_int


def requests(exp: loop.Experiment, args: argparse.Namespace, max_len: int) -> list[Request]:
    """``args.requests`` prompts (held-out inputs cut at mixed lengths), ``args.samples`` requests each."""
    inputs = np.asarray(exp.task.batch(jax.random.fold_in(exp.eval_key, 1000), args.requests).inputs)
    rng = np.random.default_rng(args.seed)
    longest = min(inputs.shape[1], max_len - args.max_new_tokens)
    if longest < 1:
        raise RunError(
            f"--max-new-tokens={args.max_new_tokens} leaves no prompt within the model's {max_len} positions"
        )
    out = []
    for i in range(args.requests):
        prompt = inputs[i, : rng.integers(1, longest + 1)]
        group = Group(shared=(len(prompt) - 1) // args.page_size, waiting=args.samples) if args.samples > 1 else None
        for _ in range(args.samples):
            n = len(out)
            out.append(Request(id=n, prompt=prompt, max_new=args.max_new_tokens, seed=n, group=group))
    return out


def _stats(engine: Engine, generated: int, seconds: float) -> str:
    pool = engine.pages
    return (
        f"{generated / max(seconds, 1e-9):.0f} tok/s · {len(engine.running)} running · "
        f"pages {pool.in_use}/{pool.num_pages} (peak {pool.stats.peak})"
    )


def serve(engine: Engine, total: int, *, progress: bool) -> tuple[float, bool]:
    """Steps ``engine`` to the end (or a Ctrl-C) under a progress bar; returns the seconds and whether interrupted."""
    start, interrupted = time.perf_counter(), False
    with loop.progress_bar(progress) as bar, loop.StopOnSignal(None) as stop:  # the CLI's Ctrl-C: stop between steps
        job = bar.add_task("serve", total=total, stats="")
        while not engine.idle:
            if stop(engine.steps):
                interrupted = True
                break
            if not engine.step() and not engine.running:
                raise RunError(f"{len(engine.waiting)} requests cannot be admitted: raise --num-pages")
            generated = sum(len(r.generated) for r in (*engine.finished, *engine.running))
            bar.update(job, completed=generated, stats=_stats(engine, generated, time.perf_counter() - start))
    return time.perf_counter() - start, interrupted


def report(engine: Engine, seconds: float, total: int, names: list[str], show: int) -> str:
    """The finished requests (the first ``show``), tokens/s and the pool's use."""
    lines = []
    for r in sorted(engine.finished, key=lambda r: r.id)[:show]:
        lines.append(f"request {r.id}: {' '.join(names[t] for t in r.prompt)} -> "
                     f"{' '.join(names[t] for t in r.generated)} (logprob {float(np.sum(r.logprobs)):.3f})")  # fmt: skip
    generated = sum(len(r.generated) for r in (*engine.finished, *engine.running))
    s, pool = engine.pages.stats, engine.pages
    lines.append(
        f"{len(engine.finished)}/{total} requests finished, {generated} tokens in {seconds:.2f} s "
        f"({generated / max(seconds, 1e-9):.1f} tokens/s, compiling included; {engine.steps} steps); pages: peak "
        f"{s.peak}/{pool.num_pages} of {pool.page_size} tokens, {s.allocated} allocated, {s.reused} reused, "
        f"{s.shared} shared references; {pool.in_use} in use at the end"
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--run", required=True, help="run directory, e.g. runs/mqar (mixer='attention')")
    parser.add_argument("--requests", type=positive_int, default=64, help="prompts")
    parser.add_argument("--samples", type=positive_int, default=1, help="completions of each prompt (shared pages)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="prompt lengths and sampling keys")
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--num-pages", type=int, default=0, help="0: enough for --max-running full requests")
    parser.add_argument("--token-budget", type=positive_int, default=256, help="tokens a step")
    parser.add_argument("--max-running", type=positive_int, default=32, help="requests at once")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="XLA's matmuls as they come (faster; a row's bits then depend on the batch)")  # fmt: skip
    parser.add_argument("--show", type=int, default=4, help="finished requests to print")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (130 when interrupted)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        exp, params, _ = loop.restore(args.run)
        model = exp.model(params)
        if exp.cfg.model.mixer != "attention" or exp.cfg.model.short_conv:
            raise RunError(f"{args.run}: serving needs mixer='attention' without short_conv")
        if args.batch_invariant:
            make_batch_invariant(model)
        max_len = model.pos.shape[0] if model.pos is not None else exp.task.length
        reqs = requests(exp, args, max_len)
    except RunError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    pages = args.num_pages or args.max_running * pages_for(max_len, args.page_size)
    cfg = EngineConfig(num_pages=pages, page_size=args.page_size, max_len=max_len, token_budget=args.token_budget,
                       max_running=min(args.max_running, args.token_budget), temperature=args.temperature,
                       seed=args.seed)  # fmt: skip
    engine = Engine(model, cfg)
    for r in reqs:
        engine.add(r)
    try:
        seconds, interrupted = serve(engine, sum(r.max_new for r in reqs), progress=not args.quiet)
    except RunError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    print(report(engine, seconds, len(reqs), exp.task.token_names(), args.show))
    if interrupted:
        print(f"interrupted: {len(engine.finished)} requests finished (above), {len(reqs) - len(engine.finished)} not")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
