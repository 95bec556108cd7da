"""Which captured DSpark draft serves a round, the function a drafter's graphs capture, and the
replay (drafters/dspark_graphs.py: greedy trees; drafters/dspark_spine_graphs.py: sampled
drafts and the greedy budgeted chain)."""
from __future__ import annotations

from .base import graphed_batch
from .dspark_graphs import budget_draft, fixed_draft, replay_budget, replay_fixed
from .dspark_spine_graphs import chain_budget_draft, drawn_draft, replay_chain_budget, replay_drawn


def replay_form(drafter, engine, size: str, b: int) -> str | None:
    """Which captured draft serves the DSparkDrafter's draft of b requests at `size`: "fixed"
    (greedy, a fixed size), "budget" (greedy, a budgeted tree priced by a cost table), "chain
    budget" (greedy, a chain under the chain budget priced by a cost table), "drawn" (sampling, a
    fixed size) or "drawn budget" (sampling, the chain budget priced by a cost table) or None
    (eager: no graphs, recording, a budget learnt online or forced, a batch base.graphed_batch
    refuses, or a drawn tree off the Markov head, which the eager path refuses by name)."""
    d = drafter
    if d.graphs is None or d.record or not graphed_batch(engine, b):
        return None
    p = d.policy
    priced = p is not None and p.table is not None and p.forced_nodes is None
    if d.sampling is not None:
        if d.shape.topk > 1 and d.branching != "markov":
            return None
        return "drawn" if size == "fixed" else "drawn budget" if priced else None
    if size == "fixed":
        return "fixed"
    return None if not priced else "budget" if d.shape.topk > 1 else "chain budget"


def captured(drafter, key, anchors, starts, tables, lengths, *extra):
    """The function a DSparkDrafter's graphs capture: key ("fixed",), ("budget", fitted),
    ("chain budget",) or ("drawn", adaptive, temperature, top_p)."""
    d = drafter
    if key[0] == "fixed":
        return fixed_draft(d.model, d.module, d.shape, d.branching, d.temperatures, d.model.window,
                           anchors, starts, tables, lengths)
    if key[0] == "drawn":
        return drawn_draft(d.model, d.module, d.shape, d.temperatures, d.model.window, key[2], key[3], key[1],
                           anchors, starts, tables, lengths, *extra)
    if key[0] == "chain budget":
        return chain_budget_draft(d.model, d.module, d.temperatures, d.model.window, anchors, starts, tables, lengths,
                                  *extra)
    return budget_draft(d.model, d.module, d.shape, d.branching, d.temperatures, d.model.window, d.policy.cap,
                        key[1], anchors, starts, tables, lengths, *extra)


def replay(drafter, form: str, requests, anchors, starts, tables, lengths) -> list:
    """The draft of `form` (replay_form) replayed, then its one read."""
    args = (drafter, requests, anchors, starts, tables, lengths)
    if form == "fixed":
        return replay_fixed(*args)
    if form == "budget":
        return replay_budget(*args)
    if form == "chain budget":
        return replay_chain_budget(*args)
    return replay_drawn(*args, adaptive=form == "drawn budget")
