"""DSpark tree size from value and cost: how many nodes each request's tree gets this round.

The Markov expansion (drafters/dspark_tree.py) offers every request a candidate pool whose
nodes carry confidence-based values v (the chance the accepted path reaches the node, as the
draft's heads estimate it; no child outvalues its parent). The policy picks one node count n
(root included, at most num_draft_tokens) for the whole batch; each request's tree is then its
best n - 1 candidates by value, an ancestor-closed set (ties: lower candidate id, i.e. the
parent, first). The count maximises

    expected committed tokens (n) / round seconds (n)
    = sum over requests of (1 + sum of its best n - 1 calibrated values) / (a_B + b_B n)

where the calibration per depth is accepted / predicted value mass from what verify accepted in
earlier rounds (drafters/depth.py's `calibrate`, as the adaptive depth policy calibrates MTP
scores), and a_B + b_B n is a least-squares line through the measured seconds of whole rounds
(draft start -> end_round: draft, verify, accept, commit) at batch size B, each sample decayed
by COST_DECAY per new one. Until the line at a batch size rests on two sizes (its first
rounds, or when one size has held so long that the other's samples have decayed away), the
policy probes: the full tree, or a half-size one. Verify is exact for any tree, so the choice
changes speed only; on several ranks rank 0's choice is every rank's (the drafter broadcasts it)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .depth import _Pending, add_mass, calibrate

COST_DECAY = 0.95  # weight of the older samples per new one on a batch size's cost line
MIN_SPREAD = 0.05  # variance of the sizes behind a line (nodes^2) below which it is re-probed


@dataclass
class CostLine:
    """Decayed least squares of round seconds against nodes per request, at one batch size."""

    sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # w, w n, w n^2, w t, w n t

    def add(self, nodes: int, seconds: float) -> None:
        self.sums = COST_DECAY * self.sums + np.array([1.0, nodes, nodes * nodes, seconds, nodes * seconds])

    def mean_nodes(self) -> float:
        return float(self.sums[1] / self.sums[0]) if self.sums[0] else 0.0

    def line(self) -> tuple | None:
        """(seconds at 0 nodes, seconds per node), or None while the samples sit at one size."""
        w, sn, snn, st, snt = self.sums
        if w == 0:
            return None
        spread = snn / w - (sn / w) ** 2
        if spread < MIN_SPREAD:
            return None
        slope = (w * snt - sn * st) / (w * snn - sn * sn)
        slope = max(slope, 0.0)  # a noisy fit may tilt down: extra rows are never cheaper than none
        return max((st - slope * sn) / w, 0.0), slope


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
        cost = self.costs.get(b)
        line = None if cost is None else cost.line()
        if line is None:  # probe: the full tree, then (or when it has held long) half of it
            if cost is None or cost.mean_nodes() < (most + 1) / 2:
                return most
            return max(1, (most + 1) // 2)
        cal = np.asarray(self.calibration())[depths - 1]
        order = np.argsort(-values, axis=1, kind="stable")[:, : most - 1]
        gain = np.take_along_axis(values * cal, order, 1).sum(0)  # [most - 1] per rank, summed over requests
        tokens = b + np.concatenate([[0.0], np.cumsum(gain)])  # [most]: 1 .. most nodes
        seconds = line[0] + line[1] * np.arange(1, most + 1)
        rate = tokens / np.maximum(seconds, 1e-12)
        return int(np.argmax(rate)) + 1

    def drafted(self, requests, nodes: int, selected: np.ndarray, depths: np.ndarray) -> None:
        """The round's choice: selected [B, nodes - 1] values of the chosen candidates, depths [B, nodes - 1]."""
        mass = np.zeros((len(requests), self.num_steps))
        np.add.at(mass, (np.arange(len(requests))[:, None], depths - 1), selected.astype(np.float64))
        self._pending = _Pending(self._start, [r.request_id for r in requests], [r.seq_len for r in requests], mass)
        self._nodes = self.last_nodes = nodes

    def end_round(self, requests, cut=()) -> None:
        """After commit: time the round at its size, calibrate on the requests not cut short."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        now = self.clock()
        where = {rid: i for i, rid in enumerate(pend.request_ids)}
        seen = [(where[r.request_id], r.seq_len) for r in requests if r.request_id in where]
        committed = [seq_len - pend.seq_lens[i] for i, seq_len in seen]
        if not seen or min(committed) < 1:
            return  # not a commit of this draft
        self.costs.setdefault(len(pend.request_ids), CostLine()).add(self._nodes, now - pend.start)
        cut = set(cut)
        whole = [(i, c) for (i, _), c in zip(seen, committed) if pend.request_ids[i] not in cut]
        add_mass(self.accepted_mass, self.predicted_mass, pend.mass, whole)
        self.rounds_observed += 1

    def state(self) -> SizeState:
        lines = {b: c.line() for b, c in sorted(self.costs.items())}
        return SizeState(tuple(self.calibration()), lines, self.last_nodes, self.rounds_observed)
