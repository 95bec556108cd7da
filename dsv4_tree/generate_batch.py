"""Batched speculative generation: many prompts, one draft pass and one verify per round.

Every round drafts for all live requests at once, verifies them in one call, accepts and
commits them together; a request that reaches its budget or an EOS token is released
(its state and its drafter state dropped) while the others go on."""
from __future__ import annotations

import time

from .drafters.registry import resolve_drafter
from .errors import InputError
from .generate import GenerateResult, GenerateStats, check_room, check_stop_args, resolve_sampling, truncate
from .progress import token_bar
from .round_stats import end_round, note_round, timed_draft


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


def generate_batch(engine, prompts, max_new_tokens, drafter=None, temperature=None, top_p=1.0,
                   eos_token_id=None, generator=None, progress=None) -> list:
    """One GenerateResult per prompt, in order. max_new_tokens: one int or one per prompt.
    Greedy results equal per-prompt `generate` token for token."""
    budgets = _budgets(prompts, max_new_tokens)
    check_stop_args(eos_token_id, generator)
    temperature = resolve_sampling(engine.spec.accept, temperature, top_p)
    drafter = resolve_drafter(engine, drafter)
    reqs = []
    try:
        reqs = engine.prefill_batch(list(prompts))  # one forward per prefill chunk for all prompts
        for req, n in zip(reqs, budgets):
            check_room(engine, req, n)
        with token_bar(sum(budgets), progress, f"generate_batch[{len(reqs)}]") as bar:
            return _rounds(engine, reqs, budgets, drafter, temperature, top_p, eos_token_id, generator, bar)
    finally:
        for req in reqs:
            if not req.released:
                engine.release(req)


def _rounds(engine, reqs, budgets, drafter, temperature, top_p, eos, generator, bar) -> list:
    results = [GenerateResult([], GenerateStats()) for _ in reqs]
    live = list(range(len(reqs)))
    while live:
        batch = [reqs[i] for i in live]
        trees, draft_seconds = timed_draft(drafter, engine, batch)
        t0 = time.perf_counter()
        out = engine.verify(batch, trees)
        seconds = time.perf_counter() - t0
        if temperature is not None:
            accs = engine.accept_sampling(batch, trees, out, temperature, top_p, generator)
        else:
            accs = engine.accept_greedy(batch, trees, out)
        kept, still = [], []
        for i, acc, tree in zip(live, accs, trees):
            res = results[i]
            acc, emitted, stop = truncate(acc, acc.emitted(tree), budgets[i] - len(res.tokens), eos)
            kept.append(acc)
            res.tokens.extend(emitted)
            res.stats.rounds += 1
            res.stats.accept_lengths.append(len(emitted))
            res.stats.verify_seconds += seconds
            note_round(res.stats, drafter, draft_seconds, seconds)
            bar.update(len(emitted))
            if not stop and len(res.tokens) < budgets[i]:
                still.append(i)
        engine.commit(batch, kept, out)
        end_round(drafter, batch)
        for i in live:
            if i not in still:
                engine.release(reqs[i])
        live = still
    return results
