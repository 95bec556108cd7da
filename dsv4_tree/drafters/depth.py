"""Adaptive draft depth: before each draft step, does one more step pay, for the whole batch?

The drafter asks `DepthPolicy.more` before every step s >= 1 with the host copies of the
candidate pool's cumulative scores so far, the frontier's scores and the sorted top-k child
probabilities the last step produced. Two rules, in order:

1. exact stop: every request's frontier scores lie strictly below its (N-1)-th best
   candidate so far. No descendant outscores its ancestor (scores are products of
   probabilities <= 1) and new candidates have higher ids than old ones (the stable sort
   ranks them after equal old scores), so no later step can change the selection: the tree
   equals the full-depth tree.
2. cost: expected extra accepted tokens of one more step, over the batch, times the measured
   seconds per committed token, against the measured seconds of one draft step. The extra
   tokens: each frontier node's children are predicted as frontier score x the last step's
   mean sorted child probabilities; the selection (best N-1) with and without them is valued
   with the per-depth calibration (accepted / predicted score mass, from what verify
   accepted in earlier rounds). Unmeasured costs (a batch size not seen yet) -> the step runs.

Costs are measured with `clock` (injectable: tests drive it) per batch size: one draft step
(s >= 1) and a whole round (draft start -> `end_round`, i.e. draft + verify + accept +
commit) per committed token. `end_round(requests)` (generate / generate_batch call it after
commit) reads how far each request advanced and updates both. Verify is exact whatever the
tree shape, so the policy changes speed only (design_notes/adaptive-depth.md)."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..diagnostics import host_values

TIME_DECAY = 0.8  # weight of the old estimate per new timing sample (recent rounds count most)
MASS_DECAY = 0.98  # per round, on the calibration sums (slow: acceptance is a noisy 0/1 signal)
PRIOR_MASS = 1.0  # score mass of the prior: depth d starts at depth d-1's calibration (d=1: 1.0)
REMEASURE_ROUNDS = 32  # a step not run for this many rounds at a batch size runs once, to re-time it


@dataclass(frozen=True)
class DepthState:
    """The policy's measurements (a snapshot, for GenerateResult.stats.depth)."""

    step_seconds: dict  # batch size -> seconds of one draft step s >= 1 (decayed mean)
    seconds_per_token: dict  # batch size -> round seconds per committed token (decayed)
    calibration: tuple  # per depth 1..num_steps: accepted / predicted score mass
    predicted_mass: tuple  # per depth: the (decayed) score mass the calibration rests on
    rounds_observed: int


@dataclass(frozen=True)
class DraftRound:
    """What one draft call did: steps run of steps allowed, and why it stopped."""

    steps: int
    allowed: int
    stop: str  # "max" (all steps) | "exact" | "cost"


@dataclass
class _Pending:
    """A draft whose verify outcome is not known yet."""

    start: float
    request_ids: list  # ids, not requests: a drafter keeps no request alive
    seq_lens: list  # each request's seq_len when drafted
    mass: np.ndarray  # [B, num_steps] float64: selected score mass per depth


@dataclass
class DepthPolicy:
    """One drafter's depth decisions and measurements (see the module docstring)."""

    topk: int
    num_steps: int
    num_draft_tokens: int
    clock: object = time.perf_counter  # () -> seconds
    step_seconds: dict = field(default_factory=dict)
    round_seconds: dict = field(default_factory=dict)  # batch size -> decayed round seconds
    round_tokens: dict = field(default_factory=dict)  # batch size -> decayed committed tokens
    accepted_mass: list = field(default_factory=list)  # per depth
    predicted_mass: list = field(default_factory=list)
    rounds_observed: int = 0
    step_timed_at: dict = field(default_factory=dict)  # batch size -> rounds_observed when last timed
    _pending: _Pending | None = None
    _start: float = 0.0  # clock at the current draft's start
    _step_start: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_mass = [0.0] * self.num_steps
        self.predicted_mass = [0.0] * self.num_steps

    # ------------------------------------------------------------------ decisions
    def calibration(self) -> list:
        return calibrate(self.accepted_mass, self.predicted_mass)

    # The decisions run on host copies a few dozen scores wide, once or twice a round: numpy,
    # whose calls on arrays this small cost a tenth of torch's (the policy's whole cost per
    # round is then well under 1% of a round on a CPU).
    def exact_stop(self, pool, frontier) -> bool:
        """pool [B, P], frontier [B, K] host scores: no later step can change any selection."""
        m = self.num_draft_tokens - 1
        if pool.shape[1] < m or m == 0:
            return m == 0
        pool = _host(pool)
        kth = -np.partition(-pool, m - 1, axis=1)[:, m - 1 : m]  # each row's m-th largest
        return bool((_host(frontier) < kth).all())

    def gain(self, pool, frontier, child_probs, depth: int) -> float:
        """Expected extra accepted tokens, summed over the batch, of drafting depth `depth`
        (1-based) from `frontier` [B, K]; child_probs [B, K]: predicted sorted child probabilities."""
        pool, frontier, child_probs = _host(pool), _host(frontier), _host(child_probs)
        b, p = pool.shape
        cal = np.asarray(self.calibration(), dtype=pool.dtype)
        depths = _depths_of(p, self.topk) - 1  # 0-based
        new = (frontier[:, :, None] * child_probs[:, None, :]).reshape(b, -1)
        m = self.num_draft_tokens - 1
        old_value = np.broadcast_to(cal[depths], (b, p))
        before = _best_value(pool, old_value, m)
        both = np.concatenate([pool, new], 1)
        value = np.concatenate([old_value, np.full((b, new.shape[1]), cal[depth - 1], dtype=pool.dtype)], 1)
        return float((_best_value(both, value, m) - before).sum())

    def more(self, step: int, pool, frontier, child_probs) -> str | None:
        """Before draft step `step` (>= 1; depth step + 1): None to run it, else the stop reason."""
        if self.exact_stop(pool, frontier):
            return "exact"
        b = pool.shape[0]
        cost, per_token = self.step_seconds.get(b), self._seconds_per_token(b)
        if cost is None or per_token is None:
            return None  # not measured at this batch size yet: run it (and measure it)
        if self.rounds_observed - self.step_timed_at.get(b, 0) >= REMEASURE_ROUNDS:
            return None  # its timing is stale (the machine's load or the batch mix moved): re-time it
        return None if self.gain(pool, frontier, child_probs, step + 1) * per_token > cost else "cost"

    def _seconds_per_token(self, b: int) -> float | None:
        tokens = self.round_tokens.get(b)
        return None if not tokens else self.round_seconds[b] / tokens

    # ------------------------------------------------------------------ measurements
    def begin(self) -> None:
        self._pending = None  # a draft nobody reported on is not measured
        self._start = self.clock()

    def step_begin(self) -> None:
        self._step_start = self.clock()

    def step_end(self, b: int) -> None:
        _decay(self.step_seconds, b, self.clock() - self._step_start)
        self.step_timed_at[b] = self.rounds_observed

    def drafted(self, requests, selected, depths) -> None:
        """selected [B, M] scores of the chosen candidates, depths [B, M] (1-based)."""
        selected, depths = _host(selected).astype(np.float64), _host(depths)
        mass = np.zeros((len(requests), self.num_steps))
        np.add.at(mass, (np.arange(len(requests))[:, None], depths - 1), selected)
        self._pending = _Pending(self._start, [r.request_id for r in requests], [r.seq_len for r in requests], mass)

    def end_round(self, requests, cut=()) -> None:
        """After commit: learn from the requests of the last draft (others are ignored). `cut`:
        ids of requests whose round was cut short of its draft (the tree trimmed to the token
        budget, the emission cut at EOS or the budget): their tokens count toward the round's
        time per token, but not toward calibration (drafted mass they could never accept)."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        now = self.clock()
        where = {rid: i for i, rid in enumerate(pend.request_ids)}
        seen = [(where[r.request_id], r.seq_len) for r in requests if r.request_id in where]
        if not seen:
            return
        keep = [i for i, _ in seen]
        committed = [seq_len - pend.seq_lens[i] for i, seq_len in seen]
        if min(committed) < 1:
            return  # not a commit of this draft (the request did not advance)
        b = len(pend.request_ids)
        _decay(self.round_seconds, b, now - pend.start)
        _decay(self.round_tokens, b, sum(committed) * b / len(keep))
        cut = set(cut)
        whole = [(i, c) for (i, _), c in zip(seen, committed) if pend.request_ids[i] not in cut]
        add_mass(self.accepted_mass, self.predicted_mass, pend.mass, whole)
        self.rounds_observed += 1

    def state(self) -> DepthState:
        per_token = {b: self._seconds_per_token(b) for b in sorted(self.round_seconds)}
        return DepthState(dict(sorted(self.step_seconds.items())), per_token, tuple(self.calibration()),
                          tuple(self.predicted_mass), self.rounds_observed)


def calibrate(accepted: list, predicted: list) -> list:
    """Per depth: accepted / predicted score mass, one unit of prior mass pulling depth d toward
    depth d - 1's value (depth 1 toward 1.0)."""
    out, prev = [], 1.0
    for a, p in zip(accepted, predicted):
        prev = (a + PRIOR_MASS * prev) / (p + PRIOR_MASS)
        out.append(prev)
    return out


def add_mass(accepted: list, predicted: list, mass: np.ndarray, whole) -> None:
    """One round into the decayed per-depth sums (in place): mass [B, depths] the drafted score
    mass per request and depth; whole [(row in mass, tokens committed)] of the requests whose
    round was not cut (a request committing c tokens accepted depths 1 .. c - 1)."""
    drafted = mass[[i for i, _ in whole]].sum(0)
    for d in range(len(accepted)):
        accepted[d] = MASS_DECAY * accepted[d] + sum(c - 1 > d for _, c in whole)
        predicted[d] = MASS_DECAY * predicted[d] + float(drafted[d])


def _decay(table: dict, key, sample: float) -> None:
    old = table.get(key)
    table[key] = sample if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * sample


def _host(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@functools.lru_cache(maxsize=64)
def _depths_of(p: int, topk: int) -> np.ndarray:
    """1-based depths of candidate ids 0..p-1 (candidate_depths, once per pool width)."""
    out = host_values(candidate_depths(torch.arange(p), topk)).copy()  # host data, not a device read
    out.flags.writeable = False  # shared by every call with this width
    return out


def _best_value(scores, value, m: int):
    """[B] sum of calibrated value (value x score) over each row's best m scores; equal scores
    rank by position (a stable descending sort, as organize_draft_results selects)."""
    m = min(m, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :m]
    return (np.take_along_axis(scores, top, 1) * np.take_along_axis(value, top, 1)).sum(1)


def candidate_depths(ids: torch.Tensor, topk: int) -> torch.Tensor:
    """1-based depth of EAGLE candidate ids (organize_draft_results' numbering)."""
    return torch.where(ids < topk, 1, 2 + torch.div(ids - topk, topk * topk, rounding_mode="floor"))

