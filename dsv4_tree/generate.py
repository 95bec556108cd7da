"""Speculative generation: rounds of draft -> verify -> accept -> commit."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from .drafters.base import check_drafted
from .drafters.registry import resolve_drafter, tell_sampling
from .errors import InputError
from .progress import token_bar
from .round_stats import end_round, note_round, timed_draft, timed_verify
from .verify.accept import Acceptance


@dataclass
class GenerateStats:
    accept_lengths: list = field(default_factory=list)  # tokens emitted per verify (accepted + bonus)
    verify_seconds: float = 0.0  # wall time inside engine.verify
    rounds: int = 0
    preemptions: int = 0  # generate_batch: times the request was preempted for lack of pool pages
    # per round (round_stats.py): draft call and engine.verify wall time, draft steps run
    round_draft_seconds: list = field(default_factory=list)
    round_verify_seconds: list = field(default_factory=list)
    draft_steps: list = field(default_factory=list)  # None where the drafter has no steps
    steps_allowed: int | None = None  # the drafter's num_steps (a maximum when adaptive)
    depth: object = None  # the adaptive policy's state after the last round (MTP DepthState, DSpark BudgetState)
    round_nodes: list = field(default_factory=list)  # nodes verified per round (this request's tree, root included)

    @property
    def histogram(self) -> dict:
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def mean_tokens_per_verify(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def mean_nodes_per_round(self) -> float:
        return sum(self.round_nodes) / max(1, len(self.round_nodes))


@dataclass
class GenerateResult:
    tokens: list  # new tokens only
    stats: GenerateStats
    # why it ended: "length" (the budget), "eos", or "out_of_pages" (generate_batch: the pools
    # could not hold this request's context even alone; `tokens` holds what it generated)
    stop_reason: str = "length"


def eos_set(eos) -> set:
    """eos_token_id (None, an int or several) as a set."""
    return set(eos) if isinstance(eos, (list, tuple, set)) else ({eos} if eos is not None else set())


def truncate(acc: Acceptance, emitted: list, budget: int, eos) -> tuple[Acceptance, list, bool]:
    """Cut an acceptance at the token budget or at the first EOS (inclusive).

    Keeping k emitted tokens commits path[:k] (rows of the first k nodes) with emitted[k-1]
    as the next root, exactly the state k serial decode steps would leave."""
    stops = eos_set(eos)
    k = min(len(emitted), budget)
    stop = k < len(emitted)
    for j, tok in enumerate(emitted[:k]):
        if tok in stops:
            k, stop = j + 1, True
            break
    if k == len(emitted):
        return acc, emitted, stop
    cut = Acceptance(acc.path[:k], emitted[k - 1], acc.request_id, acc.verify_id)
    return cut, emitted[:k], True


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise InputError(f"{name} must be a real number, got {value!r}")
    return float(value)


def resolve_sampling(accept: str, temperature, top_p) -> float | None:
    """The temperature generate samples at, or None for greedy acceptance.

    SpecConfig.accept decides the acceptance rule; arguments that contradict it are refused
    rather than silently ignored: accept="greedy" takes temperature None or 0 and top_p 1;
    accept="sampling" takes temperature None (meaning 1.0) or a finite value > 0."""
    top_p = _real("top_p", top_p)
    if not 0 < top_p <= 1:
        raise InputError(f"top_p must lie in (0, 1], got {top_p}")
    if temperature is not None:
        temperature = _real("temperature", temperature)
        if temperature < 0 or math.isinf(temperature):
            raise InputError(f"temperature must be finite and >= 0, got {temperature}")
    if accept == "greedy":
        if temperature not in (None, 0.0) or top_p != 1.0:
            raise InputError(
                f"temperature={temperature} top_p={top_p} ask for sampling, but SpecConfig.accept='greedy' "
                "accepts by argmax; use SpecConfig(accept='sampling') to sample"
            )
        return None
    if temperature == 0.0:
        raise InputError("temperature=0 with SpecConfig.accept='sampling': sampling needs temperature > 0; "
                         "use SpecConfig(accept='greedy') for greedy decoding")
    return 1.0 if temperature is None else temperature


def _check_args(max_new_tokens, eos_token_id, generator, vocab_size: int) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    check_stop_args(eos_token_id, generator, vocab_size)


def check_stop_args(eos_token_id, generator, vocab_size: int) -> None:
    """eos_token_id and generator of generate and generate_batch."""
    eos = eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]
    if eos_token_id is not None and not all(_is_int(t) for t in eos):
        raise InputError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    if eos_token_id is not None and not all(0 <= t < vocab_size for t in eos):
        raise InputError(f"eos_token_id {eos_token_id!r} lies outside the vocabulary [0, {vocab_size}): "
                         "generation could never stop on it")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def generate(engine, prompt_ids, max_new_tokens, drafter=None, temperature=None, top_p=1.0,
             eos_token_id=None, generator=None, progress=None) -> GenerateResult:
    """Greedy or sampled per engine.spec.accept (see resolve_sampling for temperature/top_p)."""
    _check_args(max_new_tokens, eos_token_id, generator, engine.model.vocab_size)
    temperature = resolve_sampling(engine.spec.accept, temperature, top_p)
    drafter = resolve_drafter(engine, drafter)
    ids = engine._as_prompt(prompt_ids)
    check_room(engine, ids.numel() - 1, max_new_tokens)
    tell_sampling(drafter, temperature, top_p, generator)
    req = engine.prefill(ids)
    try:
        with token_bar(max_new_tokens, progress, "generate") as bar:
            return _rounds(engine, req, max_new_tokens, drafter, temperature, top_p, eos_token_id, generator, bar)
    finally:
        engine.release(req)


def check_room(engine, seq_len: int, max_new_tokens: int, what: str = "max_new_tokens") -> None:
    """The k-th new token sits at position seq_len + k, which must be < max_position_embeddings
    (draft trees are trimmed to what can still be emitted: fit_tree)."""
    room = engine.limits.max_positions - 1 - seq_len
    if max_new_tokens > room:
        raise InputError(f"{what}={max_new_tokens} exceeds the {room} positions left after a prompt of "
                         f"{seq_len + 1} tokens: max_position_embeddings={engine.limits.max_positions}")


def fit_tree(tree, budget: int):
    """The drafted tree without nodes that can never be emitted: a path of depth d emits d + 1
    tokens, so with `budget` tokens left nodes deeper than budget - 1 only waste rows (and near
    max_position_embeddings they would sit past it)."""
    return tree.up_to_depth(budget - 1)


def _rounds(engine, req, max_new_tokens, drafter, temperature, top_p, eos_token_id, generator, bar) -> GenerateResult:
    stats, new = GenerateStats(), []
    while len(new) < max_new_tokens:
        trees, draft_seconds = timed_draft(drafter, engine, [req])
        check_drafted(drafter, [req], trees)
        tree = fit_tree(trees[0], max_new_tokens - len(new))
        out, verify_seconds = timed_verify(engine, [req], [tree])
        stats.verify_seconds += verify_seconds
        if temperature is not None:
            acc = engine.accept_sampling([req], [tree], out, temperature, top_p, generator)[0]
        else:
            acc = engine.accept_greedy([req], [tree], out)[0]
        acc, emitted, stop = truncate(acc, acc.emitted(tree), max_new_tokens - len(new), eos_token_id)
        engine.commit([req], [acc], out)
        end_round(drafter, [req], cut=[req.request_id] if stop or tree.num_nodes < trees[0].num_nodes else [])
        note_round(stats, drafter, draft_seconds, verify_seconds)
        new.extend(emitted)
        stats.rounds += 1
        stats.accept_lengths.append(len(emitted))
        stats.round_nodes.append(tree.num_nodes)
        bar.update(len(emitted))
        if stop:
            break
    return GenerateResult(new, stats, "eos" if new[-1] in eos_set(eos_token_id) else "length")
