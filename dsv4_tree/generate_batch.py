"""Batched speculative generation: many prompts, one draft pass and one verify per round.

Every round drafts for all live requests at once, verifies them in one call, accepts and
commits them together; a request that reaches its budget or an EOS token is released
(its state and its drafter state dropped) while the others go on.

Scheduling (design_notes/generation.md, "generate_batch scheduling"):
* Admission: prompts wait in a queue, in order, and are prefilled as request rows
  (SpecConfig.max_requests) free up, so any number of prompts can be given.
* Out of pool pages: a round whose verify (or an admission whose prefill) finds too few free
  pages preempts the most recently admitted live request: it is released, keeps the tokens it
  generated, and goes back to the front of the queue to be prefilled again later from its prompt
  plus those tokens (recompute). No admission happens until a request finishes. A request
  that cannot run even alone (the pools are too small for its context) finishes with
  stop_reason "out_of_pages" and the tokens it has; the others are not affected.
Greedy results equal per-prompt `generate` token for token (tests/test_generate_batch.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters.base import check_drafted
from .drafters.registry import resolve_drafter
from .errors import InputError
from .generate import (GenerateResult, GenerateStats, check_room, check_stop_args, eos_set, fit_tree,
                       resolve_sampling, truncate)
from .progress import token_bar
from .round_stats import end_round, note_round, timed_draft, timed_verify
from .serving.allocator import PoolExhausted


def _budgets(prompts, max_new_tokens) -> list:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of prompts (each a sequence of token ids)")
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if len(budgets) != len(prompts):
        raise InputError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    for i, n in enumerate(budgets):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"max_new_tokens[{i}] must be a positive int, got {n!r}")
    return budgets


@dataclass(eq=False)  # jobs are compared by identity (live.remove)
class _Job:
    """One prompt's progress: its ids, its budget, its result so far and its live request."""

    index: int  # the prompt's position in the call
    prompt: torch.Tensor  # [L] the prompt as given
    budget: int
    result: GenerateResult
    req: object = None  # the live Request, None while queued or finished

    @property
    def left(self) -> int:
        return self.budget - len(self.result.tokens)

    def context(self) -> torch.Tensor:
        """What a (re-)prefill starts from: the prompt and every token generated so far."""
        return torch.cat([self.prompt, torch.tensor(self.result.tokens, dtype=torch.int64)])


def generate_batch(engine, prompts, max_new_tokens, drafter=None, temperature=None, top_p=1.0,
                   eos_token_id=None, generator=None, progress=None, hooks=None) -> list:
    """One GenerateResult per prompt, in order. max_new_tokens: one int or one per prompt.
    Greedy results equal per-prompt `generate` token for token.

    hooks (optional; hf_generate uses it): hooks.accept(indices, requests, trees, out) returns
    the round's acceptances in place of the temperature / top_p rule (indices: the prompts'
    positions), and hooks.emitted(index, tokens, done) sees each request's kept tokens (done
    once it has finished, for any stop reason)."""
    budgets = _budgets(prompts, max_new_tokens)
    check_stop_args(eos_token_id, generator, engine.model.vocab_size)
    temperature = resolve_sampling(engine.spec.accept, temperature, top_p)
    ids = [engine._as_prompt(p) for p in prompts]
    for i, (x, n) in enumerate(zip(ids, budgets)):
        check_room(engine, x.numel() - 1, n, f"max_new_tokens[{i}]")
    drafter = resolve_drafter(engine, drafter)
    jobs = [_Job(i, x, n, GenerateResult([], GenerateStats())) for i, (x, n) in enumerate(zip(ids, budgets))]
    try:
        with token_bar(sum(budgets), progress, f"generate_batch[{len(jobs)}]") as bar:
            _run(engine, jobs, drafter, temperature, top_p, eos_token_id, generator, bar, hooks)
    finally:
        for job in jobs:
            if job.req is not None and not job.req.released:
                engine.release(job.req)
    return [job.result for job in jobs]


def _run(engine, jobs, drafter, temperature, top_p, eos, generator, bar, hooks) -> None:
    queue, live, blocked = list(jobs), [], False
    while queue or live:
        if not blocked:
            _admit(engine, queue, live)
        if not live:  # the head of the queue cannot be prefilled even alone
            _finish(queue.pop(0), "out_of_pages", hooks)
            continue
        try:
            done = _round(engine, live, drafter, temperature, top_p, eos, generator, bar, hooks)
        except PoolExhausted:
            job = live.pop()  # the newest admitted: the least work lost
            engine.release(job.req)
            job.req = None
            if live:
                job.result.stats.preemptions += 1
                queue.insert(0, job)
                blocked = True
            else:
                _finish(job, "out_of_pages", hooks)
            continue
        for job in done:
            live.remove(job)
            engine.release(job.req)
            job.req = None
            blocked = False


def _finish(job, reason: str, hooks) -> None:
    job.result.stop_reason = reason
    if hooks is not None:
        hooks.emitted(job.index, [], True)


def _admit(engine, queue, live) -> None:
    """Prefill as many queued jobs as free rows allow (fewer if the pages run out)."""
    k = min(len(queue), engine.runtime.pages.free_rows)
    while k:
        try:
            reqs = engine.prefill_batch([job.context() for job in queue[:k]])
        except PoolExhausted:  # prefill_batch released what it had made
            k = k // 2 if live or k > 1 else 0
            continue
        for job, req in zip(queue[:k], reqs):
            job.req = req
            live.append(job)
        del queue[:k]
        return


def _round(engine, live, drafter, temperature, top_p, eos, generator, bar, hooks) -> list:
    """One draft / verify / accept / commit round; the jobs that finished."""
    batch = [job.req for job in live]
    drafted, draft_seconds = timed_draft(drafter, engine, batch)
    check_drafted(drafter, batch, drafted)
    trees = [fit_tree(t, job.left) for t, job in zip(drafted, live)]
    out, seconds = timed_verify(engine, batch, trees)
    if hooks is not None:
        accs = hooks.accept([job.index for job in live], batch, trees, out)
    elif temperature is not None:
        accs = engine.accept_sampling(batch, trees, out, temperature, top_p, generator)
    else:
        accs = engine.accept_greedy(batch, trees, out)
    kept, emitted_all, done = [], [], []
    for job, acc, tree in zip(live, accs, trees):
        acc, emitted, stop = truncate(acc, acc.emitted(tree), job.left, eos)
        kept.append(acc)
        emitted_all.append((job, emitted, stop))
    engine.commit(batch, kept, out)
    cut = [job.req.request_id for (job, _, stop), t, d in zip(emitted_all, trees, drafted) if stop or t.num_nodes < d.num_nodes]
    end_round(drafter, batch, cut)
    for job, emitted, stop in emitted_all:
        res = job.result
        res.tokens.extend(emitted)
        res.stats.rounds += 1
        res.stats.accept_lengths.append(len(emitted))
        res.stats.verify_seconds += seconds
        note_round(res.stats, drafter, draft_seconds, seconds)
        bar.update(len(emitted))
        finished = stop or job.left == 0
        if finished:
            res.stop_reason = "eos" if res.tokens[-1] in eos_set(eos) else "length"
            done.append(job)
        if hooks is not None:
            hooks.emitted(job.index, emitted, finished)
    return done
