"""Batched speculative generation: many prompts, one draft pass and one verify per round.

Every round drafts for all live requests at once, verifies them in one call, accepts and
commits them together; a request that reaches its budget or an EOS token is released
(its state and its drafter state dropped) while the others go on.

Scheduling (design_notes/generation.md, "generate_batch scheduling"):
* Admission: prompts wait in a queue, in order, and are prefilled as request rows
  (SpecConfig.max_requests) free up, so any number of prompts can be given. A prompt is
  prefilled only when the free token pages hold its context and a full draft tree beside
  what the live requests' next round needs (checked before any compute).
* Out of pool pages: a round whose verify finds too few free pages preempts the most recently
  admitted live request: it is released, keeps the tokens it generated, and goes back to the
  front of the queue to be prefilled again later from its prompt plus those tokens
  (recompute). No admission happens until a request leaves (finished, or out of pages). A
  request running alone has its tree cut to the draft slots the pools can still hold; one
  whose context alone does not fit finishes with stop_reason "out_of_pages" and the tokens it
  has; the others are not affected.
Greedy results equal per-prompt `generate` token for token up to the first near tie (the
target's two best logits, or an indexer top-k boundary: design_notes/generation.md, "Batch
invariance"); the batch sums its rows in another order, within the same verify bound."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters.base import check_drafted
from .drafters.registry import resolve_drafter, tell_sampling
from .errors import InputError, StateError
from .generate import (GenerateResult, GenerateStats, check_room, check_stop_args, eos_set, fit_tree,
                       resolve_sampling, truncate)
from .progress import token_bar
from .round_stats import end_round, note_round, timed_draft, timed_verify
from .serving.allocator import PoolExhausted
from .tree.draft_tree import DraftTree


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


def _check_free_row(engine) -> None:
    """generate_batch admits its prompts on rows of its own: with every row held by the
    caller's live requests nothing could ever run."""
    pages = engine.runtime.pages
    if pages.free_rows == 0:
        raise StateError(f"generate_batch needs a free request row: all {pages.max_requests} rows "
                         "(SpecConfig.max_requests) are held by live requests; release one or raise max_requests")


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

    def context_len(self) -> int:
        """len(context()) without building it (admission checks it every round)."""
        return self.prompt.numel() + len(self.result.tokens)


def generate_batch(engine, prompts, max_new_tokens, drafter=None, temperature=None, top_p=1.0,
                   eos_token_id=None, generator=None, progress=None, hooks=None) -> list:
    """One GenerateResult per prompt, in order. max_new_tokens: one int or one per prompt.
    Greedy results equal per-prompt `generate` token for token up to the first near tie
    (module docstring).

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
    _check_free_row(engine)
    drafter = resolve_drafter(engine, drafter)
    # a drafter that draws its drafts (DSpark) draws by this run's rule; with hooks (custom_generate)
    # the acceptance is the caller's, so it drafts its argmax chain, which any exact acceptance takes
    tell_sampling(drafter, temperature if hooks is None else None, top_p, generator)
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
        if not blocked or not live:
            blocked = not _admit(engine, queue, live)
        if not live:  # the head of the queue cannot be prefilled even alone
            _finish(queue.pop(0), "out_of_pages", hooks)
            blocked = False
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
            else:  # alone, with its tree cut to the free slots: its context no longer fits
                _finish(job, "out_of_pages", hooks)
                blocked = False
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


def _pages(engine, slots: int) -> int:
    """Token pages that hold slots 0 .. slots - 1 of a request."""
    return -(-slots // engine.runtime.pages.page_size)


def _free_pages(engine) -> int:
    tokens = engine.runtime.pages.tokens
    return tokens.num_pages - tokens.used_pages


def _admit(engine, queue, live) -> bool:
    """Prefill, in queue order, the jobs that free rows and free token pages allow: each needs
    pages for its context and a full tree (engine.limits.max_nodes draft slots) beside the
    pages the live requests' next round may map. With nothing live, the head is tried when
    its context alone fits. False when a prefill still ran out of pages (a pool this check
    does not count): admission then waits for a request to leave."""
    pages, tree = engine.runtime.pages, engine.limits.max_nodes
    room = _free_pages(engine) - sum(max(0, _pages(engine, j.req.seq_len + tree) - pages.mapped[j.req.row])
                                     for j in live)
    jobs = []
    for job in queue[: pages.free_rows]:
        need = _pages(engine, job.context_len() - 1 + tree)
        if need > room:
            break
        jobs.append(job)
        room -= need
    if not jobs and not live and queue[: pages.free_rows] and _pages(engine, queue[0].context_len()) <= room:
        jobs = queue[:1]  # alone, its trees are cut to the slots left (_fit_pages)
    while jobs:
        try:
            reqs = engine.prefill_batch([job.context() for job in jobs])
        except PoolExhausted:  # prefill_batch released what it had made
            if live or len(jobs) == 1:
                return False
            jobs = jobs[:1]
            continue
        for job, req in zip(jobs, reqs):
            job.req = req
            live.append(job)
        del queue[: len(jobs)]
        break
    return True


def _fit_pages(engine, req, tree: DraftTree) -> DraftTree:
    """A request alone in the pools: its tree's first nodes (parents come first, so they form a
    tree) whose draft slots, P + node index, the free token pages can still back. With not even
    the root's slot left, the tree as it was (verify then raises PoolExhausted)."""
    pages = engine.runtime.pages
    slots = (pages.mapped[req.row] + _free_pages(engine)) * pages.page_size - req.seq_len
    if not 1 <= slots < tree.num_nodes:
        return tree
    return tree.first_nodes(slots)


def _round(engine, live, drafter, temperature, top_p, eos, generator, bar, hooks) -> list:
    """One draft / verify / accept / commit round; the jobs that finished."""
    batch = [job.req for job in live]
    drafted, draft_seconds = timed_draft(drafter, engine, batch)
    check_drafted(drafter, batch, drafted)
    trees = [fit_tree(t, job.left) for t, job in zip(drafted, live)]
    if len(live) == 1:
        trees = [_fit_pages(engine, batch[0], trees[0])]
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
    for (job, emitted, stop), tree in zip(emitted_all, trees):
        res = job.result
        res.tokens.extend(emitted)
        res.stats.rounds += 1
        res.stats.accept_lengths.append(len(emitted))
        res.stats.round_nodes.append(tree.num_nodes)
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
