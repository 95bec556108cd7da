"""DSpark tree size from value and cost: how many nodes each request's tree gets this round.

The Markov expansion (drafters/dspark_tree.py) offers every request a candidate pool whose
nodes carry confidence-based values v (the chance the accepted path reaches the node, as the
draft's heads estimate it; no child outvalues its parent). The policy picks one node count n
(root included, at most num_draft_tokens) for the whole batch; each request's tree is then its
best n - 1 candidates by value, an ancestor-closed set (ties: lower candidate id, i.e. the
parent, first). The count maximises

    expected committed tokens (n) / round seconds (n)
    = sum over requests of (1 + calibrated value of its best n - 1 candidates) / (a_B + b_B n)

(best by raw value, which keeps the selection ancestor-closed; each summed at its depth's
calibration)
where the calibration per depth is accepted / predicted value mass from what verify accepted in
earlier rounds (drafters/depth.py's `calibrate`, as the adaptive depth policy calibrates MTP
scores), and a_B + b_B n is a least-squares line through the median measured seconds of whole
rounds (draft start -> end_round: draft, verify, accept, commit) per size at batch size B (the
last WINDOW samples of each size, none older than STALE rounds). Until the line rests on two
sizes the policy probes (the full tree, then half of it), and every PROBE_EVERY rounds it
drafts the end of the range far from its choice once, so both ends of the line stay
measured. Verify is exact for any tree, so the choice
changes speed only; on several ranks rank 0's choice is every rank's (the drafter broadcasts it)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from .depth import _Pending, add_mass, calibrate

WINDOW = 8  # samples kept per size: the line goes through each size's median
STALE = 64  # rounds (at a batch size) after which a sample no longer counts
PROBE_EVERY = 16  # rounds between probes of the size far from the choice (keeps the line's two ends fresh)


@dataclass
class CostLine:
    """Round seconds against nodes per request at one batch size: a least-squares line through
    the median of each size's recent samples (weighted by their count). Medians, because a
    shared machine's load only ever adds time, in spikes that a mean would follow. The line is
    refitted when a sample arrives (once a round), not when it is read."""

    samples: dict = field(default_factory=dict)  # nodes -> [(round, seconds)], newest last
    rounds: int = 0
    last_probe: int = 0
    _fit: tuple | None = None

    def add(self, nodes: int, seconds: float) -> None:
        self.rounds += 1
        self.samples.setdefault(nodes, []).append((self.rounds, seconds))
        for n in list(self.samples):
            kept = [x for x in self.samples[n][-WINDOW:] if self.rounds - x[0] < STALE]
            if kept:
                self.samples[n] = kept
            else:
                del self.samples[n]
        self._fit = self._refit()

    def probe_due(self) -> bool:
        return self.rounds - self.last_probe >= PROBE_EVERY

    def line(self) -> tuple | None:
        """(seconds at 0 nodes, seconds per node), or None while fewer than two sizes are measured."""
        return self._fit

    def _refit(self) -> tuple | None:
        if len(self.samples) < 2:
            return None
        n = np.array(list(self.samples), dtype=np.float64)
        t = np.array([statistics.median(x[1] for x in v) for v in self.samples.values()])
        w = np.array([len(v) for v in self.samples.values()], dtype=np.float64)
        nm, tm = (w * n).sum() / w.sum(), (w * t).sum() / w.sum()
        slope = (w * (n - nm) * (t - tm)).sum() / (w * (n - nm) ** 2).sum()
        slope = max(float(slope), 0.0)  # a noisy fit may tilt down: extra rows are never cheaper than none
        return max(float(tm - slope * nm), 0.0), slope


@dataclass(frozen=True)
class SizeState:
    """The policy's measurements (a snapshot, for GenerateResult.stats.depth)."""

    calibration: tuple  # per depth 1..num_steps: accepted / predicted value mass
    lines: dict  # batch size -> (seconds at 0 nodes, seconds per node) or None (probing)
    last_nodes: int | None  # the last round's choice
    rounds_observed: int


@dataclass
class SizePolicy:
    """One DSpark tree drafter's size decisions (see the module docstring)."""

    num_steps: int
    num_draft_tokens: int
    clock: object = time.perf_counter  # () -> seconds
    costs: dict = field(default_factory=dict)  # batch size -> CostLine
    accepted_mass: list = field(default_factory=list)  # per depth
    predicted_mass: list = field(default_factory=list)
    rounds_observed: int = 0
    last_nodes: int | None = None
    _pending: _Pending | None = None
    _nodes: int = 0  # the pending draft's node count
    _start: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_mass = [0.0] * self.num_steps
        self.predicted_mass = [0.0] * self.num_steps

    def calibration(self) -> list:
        return calibrate(self.accepted_mass, self.predicted_mass)

    def begin(self) -> None:
        self._pending = None  # a draft nobody reported on is not measured
        self._start = self.clock()

    def choose(self, values: np.ndarray, depths: np.ndarray) -> int:
        """values [B, P] host candidate values, depths [P] their depths (1-based) -> nodes per
        request, root included, in [1, min(num_draft_tokens, P + 1)]."""
        b, p = values.shape
        most = min(self.num_draft_tokens, p + 1)
        half = max(1, (most + 1) // 2)
        cost = self.costs.get(b)
        line = None if cost is None else cost.line()
        if line is None:  # probe: the full tree, then half of it
            return half if cost is not None and most in cost.samples else most
        cal = np.asarray(self.calibration())[depths - 1]
        order = np.argsort(-values, axis=1, kind="stable")[:, : most - 1]
        gain = np.take_along_axis(values * cal, order, 1).sum(0)  # [most - 1] per rank, summed over requests
        tokens = b + np.concatenate([[0.0], np.cumsum(gain)])  # [most]: 1 .. most nodes
        seconds = line[0] + line[1] * np.arange(1, most + 1)
        best = int(np.argmax(tokens / np.maximum(seconds, 1e-12))) + 1
        if cost.probe_due():  # the end of the range far from the choice, so the line stays anchored
            cost.last_probe = cost.rounds
            return half if best > (most + 1) / 2 else most
        return best

    def drafted(self, requests, nodes: int, selected: np.ndarray, depths: np.ndarray) -> None:
        """The round's choice: selected [B, nodes - 1] values of the chosen candidates, depths [B, nodes - 1]."""
        mass = np.zeros((len(requests), self.num_steps))
        np.add.at(mass, (np.arange(len(requests))[:, None], depths - 1), selected.astype(np.float64))
        self._pending = _Pending(self._start, [r.request_id for r in requests], [r.seq_len for r in requests], mass)
        self._nodes = self.last_nodes = nodes

    def end_round(self, requests, cut=()) -> None:
        """After commit: time the round at its size unless a request's round was cut short (its
        tree trimmed to the budget, its emission cut at EOS), calibrate on the requests not cut."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        now = self.clock()
        where = {rid: i for i, rid in enumerate(pend.request_ids)}
        seen = [(where[r.request_id], r.seq_len) for r in requests if r.request_id in where]
        committed = [seq_len - pend.seq_lens[i] for i, seq_len in seen]
        if not seen or min(committed) < 1:
            return  # not a commit of this draft
        cut = set(cut)
        if not cut & set(pend.request_ids):  # a round cut short (a trimmed tree, EOS) is not timed at its size
            self.costs.setdefault(len(pend.request_ids), CostLine()).add(self._nodes, now - pend.start)
        whole = [(i, c) for (i, _), c in zip(seen, committed) if pend.request_ids[i] not in cut]
        add_mass(self.accepted_mass, self.predicted_mass, pend.mass, whole)
        self.rounds_observed += 1

    def state(self) -> SizeState:
        lines = {b: c.line() for b, c in sorted(self.costs.items())}
        return SizeState(tuple(self.calibration()), lines, self.last_nodes, self.rounds_observed)
