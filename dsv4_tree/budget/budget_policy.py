"""One DSpark drafter's verify budget across rounds (design_notes/verify-budget.md).

Chains (`chain`): SGLang 0.5.23's rule. The batch budget b comes from each request's survival
of LAG rounds before (its confidences then; survival 1 for a request with fewer rounds behind
it), so b never depends on this round's drafts; the shape is the b best of this round's
survival over the batch. A position's inclusion then depends on the drafts before it only,
which keeps speculative sampling of a drawn chain lossless; with b from this round's survival
it would depend on the draft itself (tests/test_budget_policy.py shows the bias).

Trees (`tree`): the same pick over tree nodes by value (budget/node_values.py), budget and
shape from this round's values: a tree is never drawn (top-K), so its values depend on committed
state and earlier rounds only, never on a draw verify compares against.

The budget maximises theta(b) against the cost table given (budget/cost_table.py) or, with
none, the lines `MeasuredCosts` learns from this drafter's own rounds (probing the full and the
half budget until a batch size's line rests on two totals, then the far end every PROBE_EVERY
rounds). `forced_nodes` (nodes per request on average, root included) replaces the choice: what
`profile_costs` times and what an equal-nodes comparison runs. On several ranks rank 0's budget
is every rank's (ranks.agree_choice)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..ranks import agree_choice
from .cost_table import MeasuredCosts
from .verify_budget import (SURVIVAL_EPS, BudgetChoice, budget_fixed, budget_from_sorted, chosen_fixed,
                            eligible_fixed, lagged_pick, survival, verify_lens, verify_lens_fixed)

LAG = 2  # rounds between a chain's confidences and the budget they set (SGLang's default relay lag)


@dataclass(frozen=True)
class BudgetState:
    """A snapshot for GenerateResult.stats.depth."""

    last_budget: int | None  # extra nodes the last round's batch verified (beyond its roots)
    last_choice: BudgetChoice | None  # None: forced, probing, or no draft yet
    lines: dict  # batch size -> (seconds at 0 nodes, seconds per node) learnt online, or None
    table: object  # the cost table given, or None
    value_weights: tuple | None  # the fitted node-value model (trees), None: the prior
    rounds_observed: int
    kind: str | None = None  # "chain" or "tree": what the last budget was for

    def describe(self) -> str:
        fit = "" if self.kind != "tree" else f"; node values {'prior' if self.value_weights is None else 'fitted'}"
        return f"{self.kind or 'no'} budget {self.last_budget} extra nodes last round{fit}; " \
               f"{self.rounds_observed} rounds observed"


@dataclass
class BudgetPolicy:
    cap: int  # extra nodes a request may get: num_draft_tokens - 1
    table: object = None  # a cost table; None: MeasuredCosts
    lag: int = LAG
    clock: object = time.perf_counter
    costs: MeasuredCosts = field(default_factory=MeasuredCosts)
    forced_nodes: float | None = None
    value_weights: tuple | None = None  # set by the drafter after each round (for the state)
    last_budget: int | None = None
    last_choice: BudgetChoice | None = None
    rounds_observed: int = 0
    kind: str | None = None  # "chain" or "tree", set by the last decision
    _history: dict = field(default_factory=dict)  # request id -> deque of its last `lag` confidence rows
    _pending: tuple | None = None  # (start, request ids, seq lens, total nodes)
    _start: float = 0.0
    _unsettled: tuple | None = None  # the last tree budget's (budget, seconds, theta) tensors, before `settle`

    def __post_init__(self) -> None:
        if not isinstance(self.lag, int) or self.lag < 1:
            raise ValueError(f"BudgetPolicy.lag must be an int >= 1, got {self.lag!r}")

    def begin(self) -> None:
        self._pending = None  # a draft nobody reported on is not timed
        self._start = self.clock()

    def forget(self, request_id: int) -> None:
        self._history.pop(request_id, None)

    # ------------------------------------------------------------------ decisions
    def _budget(self, model, values: torch.Tensor, num_requests: int) -> int:
        """values [n] float64 in pick order (best first) -> b in [0, n], rank 0's on every rank."""
        n = values.numel()
        self.last_choice = None
        if self.forced_nodes is not None:
            b = round((self.forced_nodes - 1) * num_requests)
        elif self.table is not None:
            self.last_choice = budget_from_sorted(values, num_requests, self.table)
            b = self.last_choice.budget
        else:
            b = self._online(values, num_requests)
        return agree_choice(model, max(0, min(n, b)))

    def _online(self, values: torch.Tensor, r: int) -> int:
        n, half = values.numel(), values.numel() // 2
        line = self.costs.lines.get(r)
        if not self.costs.ready(r):  # probe: the full budget, then half of it
            return half if line is not None and r + n in line.samples else n
        self.last_choice = budget_from_sorted(values, r, self.costs)
        best = self.last_choice.budget
        if line.probe_due():  # the far end, so the line stays anchored at both
            line.last_probe = line.rounds
            return half if best > half else n
        return best

    def chain(self, model, request_ids: list, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [R, gamma] of this round's drafted chains (host) -> verify lengths [R]
        (root included): budget from the survival LAG rounds back, shape from this round's."""
        conf = confidence.detach().to("cpu", torch.float32)
        window = survival(self.lagged(request_ids, conf.device, conf.shape[1])).reshape(-1)
        values = torch.sort(window[window >= SURVIVAL_EPS].to(torch.float64), descending=True).values
        budget = self._budget(model, values, len(request_ids))
        self.remember(request_ids, conf)
        self.last_budget, self.kind = budget, "chain"
        return verify_lens(conf, budget)

    def chain_fixed(self, model, request_ids: list, confidence: torch.Tensor) -> torch.Tensor:
        """`chain` at a fixed shape on the confidences' device (a drawn tree's spine: no host read
        with a cost table or forced nodes): confidence [R, D] -> verify lengths [R] int64 on that
        device; the budget is read with the draft (`unsettled` / `settle`), as a tree's is."""
        conf = confidence.detach().to(torch.float32)
        pick = lagged_pick(self.lagged(request_ids, conf.device, conf.shape[1]))
        self.kind = "chain"
        budget = self._fixed_budget(model, pick, conf.shape[0])
        self.remember(request_ids, conf)
        return verify_lens_fixed(conf, budget)

    def lagged(self, request_ids: list, device, width: int) -> torch.Tensor:
        """[R, width] fp32 on `device`: each request's confidences `lag` rounds back (ones for a
        request with fewer rounds behind it), what the chain budget is set from."""
        ones = torch.ones(width, device=device)
        return torch.stack([h[0].to(device) if len(h := self._history.get(rid, ())) == self.lag else ones
                            for rid in request_ids])

    def remember(self, request_ids: list, confidence: torch.Tensor) -> None:
        """This round's confidences [R, D] (fp32), for the budget `lag` rounds on."""
        for rid, row in zip(request_ids, confidence):
            self._history.setdefault(rid, deque(maxlen=self.lag)).append(row)

    def tree(self, model, values: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """values [R, P] float64 pool values, depths [P] -> the chosen candidates [R, P] bool.

        At a fixed shape on the values' device: with a cost table or forced nodes no host read
        (the budget stays a tensor until `settle` gets its host copy from the draft's one read);
        learning lines online, the eligible count is read (the probes are host decisions)."""
        pick = eligible_fixed(values, depths, self.cap)
        self.kind = "tree"
        return chosen_fixed(pick, tuple(values.shape), self._fixed_budget(model, pick, values.shape[0]))

    def _fixed_budget(self, model, pick, r: int) -> torch.Tensor:
        """`_budget` over a FixedPick of r requests: forced, the table's or the online lines'
        choice as a 0-dim tensor (rank 0's on every rank), kept unsettled until the draft's read."""
        self.last_choice = None
        if self.forced_nodes is not None:
            budget = torch.clamp(pick.count, max=max(0, round((self.forced_nodes - 1) * r)))
            choice = None
        elif self.table is not None:
            choice = budget_fixed(pick, r, self.table)
            budget = choice[0]
        else:
            budget, choice = self._online_fixed(pick, r)
        budget = agree_choice(model, budget)
        self._unsettled = (budget, choice)
        return budget

    def _online_fixed(self, pick, r: int) -> tuple:
        """`_online` over a FixedPick: the eligible count is read (the probes are host decisions),
        the lines' choice stays on the device. -> (budget, (b, seconds, theta) or None)."""
        n = int(pick.count)
        half = n // 2
        line = self.costs.lines.get(r)
        if not self.costs.ready(r):  # probe: the full budget, then half of it
            return pick.count.new_tensor(half if line is not None and r + n in line.samples else n), None
        choice = budget_fixed(pick, r, self.costs)
        if line.probe_due():  # the far end, so the line stays anchored at both
            line.last_probe = line.rounds
            return torch.where(choice[0] > half, half, n), choice
        return choice[0], choice

    def unsettled(self) -> torch.Tensor:
        """[4] float64 (budget, the table's b, seconds, theta; NaN: no table choice) of the last
        `tree` or `chain_fixed`, read with the trees (the draft's one read)."""
        budget, choice = self._unsettled
        nan = torch.full((), float("nan"), dtype=torch.float64, device=budget.device)
        parts = [budget] + (list(choice) if choice is not None else [nan] * 3)
        return torch.stack([nan if x is None else x.to(budget.device, torch.float64) for x in parts])

    def settle(self, host: list) -> None:
        """The last `tree`'s (or `chain_fixed`'s) unsettled() values, read on the host."""
        budget, b, seconds, theta = host
        self.last_budget = int(budget)
        self.last_choice = None if b != b else BudgetChoice(int(b), seconds, theta)  # NaN: forced or probing
        self._unsettled = None

    # ------------------------------------------------------------------ measurements
    def drafted(self, requests, total_nodes: int) -> None:
        self._pending = (self._start, [r.request_id for r in requests], [r.seq_len for r in requests], total_nodes)

    def end_round(self, requests, cut=()) -> None:
        """After commit: time the round at its total unless a request of it was cut short."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        start, ids, lens, total = pend
        where = {rid: i for i, rid in enumerate(ids)}
        seen = [(where[r.request_id], r.seq_len) for r in requests if r.request_id in where]
        if not seen or min(s - lens[i] for i, s in seen) < 1:
            return  # not a commit of this draft
        if not set(cut) & set(ids):
            self.costs.add(len(ids), total, self.clock() - start)
        self.rounds_observed += 1

    def state(self) -> BudgetState:
        return BudgetState(self.last_budget, self.last_choice, self.costs.state(), self.table, self.value_weights,
                           self.rounds_observed, self.kind)
