"""Measure an engine's verify-step prices for the batch budget: `profile_costs` -> a LineTable.

SGLang prices its DSpark budget with a steps-per-second table profiled offline per server
(`benchmark/dspark_sps_profiler.py`). Ours is measured on the engine and drafter that will use
it, at start-up, on whole rounds (draft, verify, greedy accept, commit: what the budget trades
tokens against): for each batch size R, R prompts are prefilled on free request rows, and
rounds run with the drafter's budget forced to each of a few node counts per request (the
counts taking turns, `rounds` each); a least-squares line through each count's median round
seconds against total nodes gives that size's base and per-node seconds. The requests are
released afterwards; the drafter keeps what the rounds taught its value model."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..errors import ConfigError, InputError, StateError
from .cost_table import LineTable


def _forced_round(engine, drafter, requests, clock) -> tuple:
    """One whole greedy round -> (total nodes verified, seconds)."""
    t0 = clock()
    trees = drafter.draft(engine, requests)
    out = engine.verify(requests, trees)
    accs = engine.accept_greedy(requests, trees, out)
    engine.commit(requests, accs, out)
    drafter.end_round(requests)
    return sum(t.num_nodes for t in trees), clock() - t0


def profile_costs(engine, drafter, prompts, batch_sizes=(1, 4, 16), nodes=None, rounds: int = 5,
                  clock=time.perf_counter) -> LineTable:
    """A LineTable of `drafter`'s rounds on `engine` (an adaptive DSpark drafter: chain or tree).
    prompts: at least max(batch_sizes) token-id sequences; nodes: the per-request node counts
    timed (default 1, the middle and num_draft_tokens); rounds: per count and batch size."""
    policy = getattr(drafter, "policy", None)
    if policy is None or getattr(drafter, "size", None) == "fixed":
        raise InputError("profile_costs needs an adaptive DSpark drafter (DSparkDrafter(..., size='adaptive')): "
                         "it times rounds at forced budgets")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"profile_costs: rounds must be an int >= 1, got {rounds!r}")
    if (isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__iter__")
            or not (batch_sizes := tuple(batch_sizes))
            or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 1 for r in batch_sizes)):
        raise ConfigError(f"profile_costs: batch_sizes must be one or more ints >= 1, got {batch_sizes!r}")
    top = engine.spec.num_draft_tokens
    nodes = sorted(set(nodes or (1, (1 + top) // 2, top)))
    if not all(isinstance(n, int) and 1 <= n <= top for n in nodes) or len(nodes) < 2:
        raise InputError(f"nodes must hold at least two ints in [1, num_draft_tokens={top}], got {nodes}")
    sizes = sorted(set(batch_sizes))
    if len(prompts) < sizes[-1]:
        raise InputError(f"profile_costs needs {sizes[-1]} prompts for batch size {sizes[-1]}, got {len(prompts)}")
    free = engine.runtime.pages.free_rows
    if sizes[-1] > free:
        raise StateError(f"profile_costs needs {sizes[-1]} free request rows, the engine has {free}")
    engine.register_drafter(drafter)
    base, per_node = [], []
    try:
        for r in sizes:
            reqs = engine.prefill_batch(list(prompts[:r]))
            try:
                samples = {n: [] for n in nodes}
                for _ in range(rounds):
                    for n in nodes:
                        policy.forced_nodes = n
                        total, secs = _forced_round(engine, drafter, reqs, clock)
                        samples[n].append((total, secs))
            finally:
                for req in reqs:
                    engine.release(req)
            totals = np.array([statistics.median(t for t, _ in v) for v in samples.values()], dtype=np.float64)
            secs = np.array([statistics.median(s for _, s in v) for v in samples.values()])
            slope, intercept = np.polyfit(totals, secs, 1) if np.ptp(totals) > 0 else (0.0, float(secs.mean()))
            per_node.append(max(float(slope), 0.0))
            base.append(max(float(secs.mean() - per_node[-1] * totals.mean()), 0.0))
    finally:
        policy.forced_nodes = None
    return LineTable(tuple(sizes), tuple(base), tuple(per_node),
                     note=f"profile_costs: nodes {nodes}, {rounds} rounds each, whole greedy rounds")
