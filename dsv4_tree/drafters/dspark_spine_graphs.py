"""DSpark drafts along a spine, captured per batch bucket: sampled drafts and the greedy
budgeted chain (drafters/dspark_graphs.py holds the greedy trees and the shared pieces).

`drawn_draft` is a sampled draft's (dspark_drawn.py): the backbone pass, then the drawn spine
with its chosen siblings, inverting uniforms the drafter draws from the run's generator before
the replay (draw_uniforms: one call, depth-major, the draws the eager walk takes) and passes as a
static input; temperature and top-p are constants of the graph (part of its key). Fixed size, or
the chain budget priced by a cost table with the siblings worth its last spine node: then the
real request count, the table's seconds, each request's lagged confidences
(BudgetPolicy.lagged, padding rows 0) and the sibling rates are inputs too, and padding
requests' spines are zeroed before the budget, so real rows get the eager draft's lengths and
prices. `chain_budget_draft` is the greedy budgeted chain's (SGLang's confidence-scheduled
lengths): the Markov walk and its confidences cut by the same chain budget (`_chain_budget`).
After the replay the budget keeps this round's confidences and the read follows
(dspark_budget.read_chain_budget, as the eager drafts)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget.verify_budget import budget_fixed, lagged_pick, verify_lens_fixed
from ..executor.graphs import pad_rows
from ..serving.buckets import pow2
from ..tree.tree_batch import TreeBatch
from .dspark_budget import read_chain_budget
from .dspark_drawn import budget_select, draw_tree, draw_uniforms, drawn_parent_rows, spine_confidences
from .dspark_graphs import StepTable, padded_block, padded_inputs, table_seconds
from .dspark_rows import confidences, markov_walk


@dataclass
class SpineDraft:
    """A drawn draft's (or a greedy budgeted chain's) device results, [B, ...] rows first."""

    batch: TreeBatch  # [B, N]; adaptive: with node counts
    rows: torch.Tensor | None  # [B, N - 1, V] float64: each node's draw row (None: a greedy chain)
    unsettled: torch.Tensor | None  # adaptive: [4] float64 (BudgetPolicy.unsettled)
    confidence: torch.Tensor | None  # adaptive: [B, D] the spine's confidences (the budget's history)


def drawn_draft(model, module, shape, temperatures, width: int, temperature: float, top_p: float, adaptive: bool,
                anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                uniforms: torch.Tensor, *budget) -> SpineDraft:
    """A sampled draft (dspark_drawn.py): uniforms [B, D] (draw_uniforms, padding rows 0); fixed
    size, or adaptive with budget = (live 0-dim int64, seconds [B * D + 1] float64 (table_seconds
    for live requests), lagged [B, D] fp32 (BudgetPolicy.lagged, padding rows 0: never eligible),
    rates [K - 1] float64 (SiblingRate.rates)). Padding requests' spines are zeroed before the
    budget, so the real rows' lengths and prices are what the eager draft of the live requests
    gives at this batch's shapes."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    drawn = draw_tree(module, blk, anchors, shape.topk, shape.num_steps, shape.num_draft_tokens, temperature, top_p,
                      uniforms)
    b = anchors.shape[0]
    if not adaptive:
        return SpineDraft(TreeBatch(drawn.tokens, drawn_parent_rows(drawn.counts, b, anchors.device)).contiguous(),
                          drawn.draw_probs.contiguous(), None, None)
    live, seconds, lagged, rates = budget
    conf, best, lens, unsettled = _chain_budget(spine_confidences(module, blk, drawn, temperatures), live, seconds,
                                                lagged)
    batch, rows = budget_select(drawn, conf, lens, best, rates, anchors)
    return SpineDraft(batch.contiguous(), rows.contiguous(), unsettled, conf.contiguous())


def _chain_budget(conf: torch.Tensor, live: torch.Tensor, seconds: torch.Tensor, lagged: torch.Tensor) -> tuple:
    """BudgetPolicy.chain_fixed priced by a table, at a bucket's shape: conf [B, D] this round's
    confidences (padding requests' zeroed here, so they never take a slot), lagged [B, D] (padding
    rows 0) -> (conf, the budget, verify lengths [B], unsettled [4] float64)."""
    real = torch.arange(conf.shape[0], device=conf.device) < live
    conf = torch.where(real.unsqueeze(1), conf.to(torch.float32), torch.zeros_like(conf, dtype=torch.float32))
    best, secs, theta = budget_fixed(lagged_pick(lagged), live, StepTable(seconds))
    f64 = torch.float64
    unsettled = torch.stack([best.to(f64), best.to(f64), secs.to(f64), theta.to(f64)])
    return conf, best, verify_lens_fixed(conf, best), unsettled


def chain_budget_draft(model, module, temperatures, width: int, anchors: torch.Tensor, starts: torch.Tensor,
                       tables: torch.Tensor, lengths: torch.Tensor, live: torch.Tensor, seconds: torch.Tensor,
                       lagged: torch.Tensor) -> SpineDraft:
    """The greedy budgeted chain (SGLang's confidence-scheduled lengths, priced by a cost table):
    the Markov walk, its confidences, and each chain cut to the length the chain budget gives;
    live, seconds [B * gamma + 1] and lagged [B, gamma] as in drawn_draft. No draw rows."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    tokens = markov_walk(module, blk, anchors)[0]
    conf, _, lens, unsettled = _chain_budget(confidences(module, blk.hidden, tokens[:, :-1], temperatures), live,
                                             seconds, lagged)
    batch = TreeBatch.chains(tokens, lens)
    return SpineDraft(batch.contiguous(), None, unsettled, conf.contiguous())


def replay_drawn(drafter, requests, anchors, starts, tables, lengths, adaptive: bool) -> list:
    """A sampled draft replayed in its bucket's graph: the uniforms drawn first from the run's
    generator (the eager draft's draws), then the read; adaptive, the chain budget's host side as
    the eager draft does it (the lagged confidences in, this round's kept for later rounds)."""
    d = drafter
    b, dev = len(requests), d.model.device
    bp, depth = pow2(b), d.spine_depth
    temperature, top_p, generator = d.sampling
    inputs = padded_inputs(bp, d.model.window, anchors, starts, tables, lengths) + (
        pad_rows(draw_uniforms(generator, b, depth, dev), bp),)
    if adaptive:
        inputs += _chain_budget_inputs(d, requests, depth, bp) + (d.sibling_rate.rates(dev),)
    out = d.graphs.run(bp, inputs, key=("drawn", adaptive, temperature, top_p))
    rows = out.rows[:b].clone()  # the trees keep their rows past the next replay
    if not adaptive:
        return out.batch.first(b).trees(rows)
    return _read_chain_budget(d, requests, out, rows, d.sibling_rate if d.shape.topk > 1 else None)


def _chain_budget_inputs(drafter, requests, depth: int, bp: int) -> tuple:
    """The chain budget's host state as inputs: the live count, the table's seconds at every
    budget over bp x depth candidates, each request's lagged confidences (padding rows 0)."""
    policy, dev, b = drafter.policy, drafter.model.device, len(requests)
    policy.kind = "chain"
    return (torch.tensor(b, device=dev), table_seconds(policy.table, b, bp * depth).to(dev),
            pad_rows(policy.lagged([r.request_id for r in requests], dev, depth), bp))


def _read_chain_budget(drafter, requests, out: SpineDraft, rows, sibling_rate) -> list:
    """After a chain-budget replay: this round's confidences kept for later budgets, then the read."""
    b = len(requests)
    drafter.policy.remember([r.request_id for r in requests], out.confidence[:b].clone())
    batch = out.batch.first(b)
    return read_chain_budget(drafter.policy, sibling_rate, requests, batch, rows, out.unsettled)


def replay_chain_budget(drafter, requests, anchors, starts, tables, lengths) -> list:
    """The greedy budgeted chain replayed in its bucket's graph, then the read (adaptive_chains'
    host side)."""
    d = drafter
    b, bp, gamma = len(requests), pow2(len(requests)), d.module.block_size
    inputs = padded_inputs(bp, d.model.window, anchors, starts, tables, lengths) + _chain_budget_inputs(d, requests, gamma, bp)
    return _read_chain_budget(d, requests, d.graphs.run(bp, inputs, key=("chain budget",)), None, None)
