"""A DSpark draft's device half at a fixed shape, captured per batch bucket.

Once every request's context holds the target's features (`bring_up`: eager, its rows per
request vary with what the last round accepted), a greedy draft of a fixed size is a function of
four tensors: the anchors [B], their positions [B], the contexts padded to the window
[S, B * W, head_dim] (`pack_contexts`) and their lengths [B]. `fixed_draft` computes the round's
TreeBatch from them: one backbone pass, then the Markov walk (a chain) or the Markov expansion
and organize_draft_results' pick (a tree), every shape fixed by (B, W, the tree shape) and no
host read (tests/test_dspark_graphs.py runs it under forbid_host_sync and on the meta device).

`budget_draft` is the budgeted tree's (a cost table, no forced nodes, one rank): the same pass
and expansion, node values, the batch's pick under one budget and each request's tree, with
what changes on the host between rounds as three more inputs: the real request count (padding
requests' candidates are worth 0, so never eligible), the table's seconds at every budget for
that count (`table_seconds`: theta = tau / seconds, the table's own rule) and the value
model's weights (a fitted model and the prior are separate graphs).

`drawn_draft` is a sampled draft's (dspark_drawn.py): the same pass, then the drawn spine with its
chosen siblings, inverting uniforms the drafter draws from the run's generator before the replay
(draw_uniforms: one call, depth-major, the draws the eager walk takes) and passes as a static
input; temperature and top-p are constants of the graph (part of its key). Fixed size, or the
chain budget priced by a cost table with the siblings worth its last spine node: then the real
request count, the table's seconds, each request's lagged confidences (BudgetPolicy.lagged,
padding rows 0) and the sibling rates are inputs too, and padding requests' spines are zeroed
before the budget, so real rows get the eager draft's lengths and prices.

The drafter captures such a function once per bucket (executor/graphs.BucketGraphs: B rounded
up to a power of two; padding requests have no context and an anchor of 0, their rows attend to
their own block only and their trees are dropped) and replays it: the inputs are copied into
the bucket's static buffers, the graph replays, and the drafter takes the real rows of its
static outputs. What stays eager: bring_up, the packing, and the one host read
of the trees. `replay_form` says which form serves a DSparkDrafter's draft; `replay` pads its
inputs, replays and reads (the budgets' host side through dspark_budget.read_trees and
read_chain_budget, as the eager drafts). `chain_budget_draft` is the greedy budgeted chain's:
the Markov walk and its confidences cut by the same chain budget as the drawn tree's spine.
Not captured: a budget learnt online (its probes are host decisions) or forced, or a recorded
draft: they run the same padded forward eagerly."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget.node_values import FEATURES, PoolValues, pool_values, share_with
from ..budget.verify_budget import budget_fixed, chosen_fixed, eligible_fixed, lagged_pick, verify_lens_fixed
from ..executor.graphs import pad_rows
from ..hooks import candidate_pool_size
from ..serving.buckets import pow2
from ..tree.build import local_parents, organize_draft_results
from ..tree.tree_batch import TreeBatch
from .base import graphed_batch
from .dspark_budget import batch_of, read_chain_budget, read_trees
from .dspark_drawn import budget_select, draw_tree, draw_uniforms, drawn_parent_rows, spine_confidences
from .dspark_rows import block_ids, block_rows, confidences, markov_walk, padded_block_index
from .dspark_tree import expand_markov

def padded_block(model, module, anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, width: int):
    """The backbone pass over contexts padded to `width` rows (pack_contexts) -> DSparkBlock."""
    index = padded_block_index(lengths, module.settings.block_rows, width)
    return block_rows(model, module, block_ids(module, anchors), starts, tables, index)


def fixed_tree(module, blk, anchors: torch.Tensor, shape, branching: str, temperatures=None, keep_logits=False):
    """The Markov tree of num_draft_tokens nodes of every request -> (TreeBatch, the expansion,
    organize_draft_results' pick)."""
    exp = expand_markov(module, blk, anchors, shape.topk, shape.num_steps, branching, keep_logits=keep_logits,
                        temperatures=temperatures)
    pool = sum(x[0].numel() for x in exp.score_list)
    org = organize_draft_results(exp.score_list, exp.token_list, exp.parents_list, min(shape.num_draft_tokens, pool + 1))
    local = local_parents(org.parent_list, org.top_scores_index, shape.topk, check=False)  # connected by construction
    return TreeBatch(torch.cat([anchors.unsqueeze(1), org.draft_tokens], 1), local), exp, org


def fixed_draft(model, module, shape, branching: str, temperatures, width: int, anchors: torch.Tensor,
                starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor) -> TreeBatch:
    """A greedy draft of a fixed size, from its four input tensors (module docstring)."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    if shape.topk == 1:
        batch = TreeBatch.chains(markov_walk(module, blk, anchors)[0])
    else:
        batch = fixed_tree(module, blk, anchors, shape, branching, temperatures)[0]
    return TreeBatch(batch.tokens.contiguous(), batch.parents.contiguous())  # own memory: a graph's static outputs


@dataclass
class BudgetDraft:
    """A budgeted tree draft's device results, [B, ...] rows first."""

    batch: TreeBatch  # [B, cap + 1] with node counts
    sel: torch.Tensor  # [B, cap] each tree's pool ids, valid for its first count - 1
    unsettled: torch.Tensor  # [4] float64: budget, the table's b, seconds, theta (BudgetPolicy.unsettled)
    tokens: torch.Tensor  # [B, P] the pool's tokens
    pool: PoolValues


class StepTable:
    """A cost table's seconds at every budget for one round's request count, as a tensor:
    theta = tau / seconds, what LineTable and SGLang's tables compute from their host numbers."""

    def __init__(self, seconds: torch.Tensor):
        self.seconds = seconds

    def theta(self, tau: torch.Tensor, num_requests):
        return tau / self.seconds, self.seconds


def table_seconds(table, num_requests: int, budgets: int) -> torch.Tensor:
    """[budgets + 1] float64 on the host: the table's seconds of a round at budgets 0 .. budgets."""
    return table.theta(torch.zeros(budgets + 1, dtype=torch.float64), num_requests)[1].to(torch.float64)


class _Weights:
    def __init__(self, weights):
        self.weights = weights

    def share(self, probs, conf, feats=None):
        return share_with(self.weights, probs, conf, feats)


def budget_draft(model, module, shape, branching: str, temperatures, width: int, cap: int, fitted: bool,
                 anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                 live: torch.Tensor, seconds: torch.Tensor, weights: torch.Tensor) -> BudgetDraft:
    """The budgeted tree (module docstring): live 0-dim int64, the real requests (rows first);
    seconds [B * P + 1] float64 (table_seconds for live requests); weights [F] float64, read when
    fitted (else the prior)."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    exp = expand_markov(module, blk, anchors, shape.topk, shape.num_steps, branching, temperatures=temperatures)
    pool = pool_values(exp, _Weights(weights if fitted else None), shape.topk)
    b = anchors.shape[0]
    real = torch.arange(b, device=anchors.device) < live
    values = torch.where(real.unsqueeze(1), pool.values, torch.zeros_like(pool.values))
    pick = eligible_fixed(values, pool.depths, cap)
    best, secs, theta = budget_fixed(pick, live, StepTable(seconds))
    chosen = chosen_fixed(pick, tuple(values.shape), best)
    tokens = torch.cat([t.reshape(b, -1) for t in exp.token_list], 1)
    batch, sel = batch_of(anchors, tokens, pool.parents, chosen, cap)
    f64 = torch.float64
    unsettled = torch.stack([best.to(f64), best.to(f64), secs.to(f64), theta.to(f64)])
    own = PoolValues(*(x.contiguous() for x in (pool.values, pool.depths, pool.parents, pool.features)))
    return BudgetDraft(TreeBatch(batch.tokens.contiguous(), batch.parents.contiguous(), batch.counts.contiguous()),
                       sel.contiguous(), unsettled, tokens.contiguous(), own)


@dataclass
class DrawnDraft:
    """A drawn draft's (or a greedy budgeted chain's) device results, [B, ...] rows first."""

    batch: TreeBatch  # [B, N]; adaptive: with node counts
    rows: torch.Tensor | None  # [B, N - 1, V] float64: each node's draw row (None: a greedy chain)
    unsettled: torch.Tensor | None  # adaptive: [4] float64 (BudgetPolicy.unsettled)
    confidence: torch.Tensor | None  # adaptive: [B, D] the spine's confidences (the budget's history)


def drawn_draft(model, module, shape, temperatures, width: int, temperature: float, top_p: float, adaptive: bool,
                anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                uniforms: torch.Tensor, *budget) -> DrawnDraft:
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
        return DrawnDraft(TreeBatch(drawn.tokens.contiguous(), drawn_parent_rows(drawn.counts, b, anchors.device)
                                    .contiguous()), drawn.draw_probs.contiguous(), None, None)
    live, seconds, lagged, rates = budget
    conf, best, lens, unsettled = _chain_budget(spine_confidences(module, blk, drawn, temperatures), live, seconds,
                                                lagged)
    batch, rows = budget_select(drawn, conf, lens, best, rates, anchors)
    return DrawnDraft(TreeBatch(batch.tokens.contiguous(), batch.parents.contiguous(), batch.counts.contiguous()),
                      rows.contiguous(), unsettled, conf.contiguous())


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
                       lagged: torch.Tensor) -> DrawnDraft:
    """The greedy budgeted chain (SGLang's confidence-scheduled lengths, priced by a cost table):
    the Markov walk, its confidences, and each chain cut to the length the chain budget gives;
    live, seconds [B * gamma + 1] and lagged [B, gamma] as in drawn_draft. No draw rows."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    tokens = markov_walk(module, blk, anchors)[0]
    conf, _, lens, unsettled = _chain_budget(confidences(module, blk.hidden, tokens[:, :-1], temperatures), live,
                                             seconds, lagged)
    batch = TreeBatch.chains(tokens, lens)
    return DrawnDraft(TreeBatch(batch.tokens.contiguous(), batch.parents.contiguous(), batch.counts.contiguous()),
                      None, unsettled, conf.contiguous())


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


def _padded(bp: int, width: int, anchors, starts, tables, lengths) -> tuple:
    """The four inputs padded to bp requests (padding: anchor 0, no context)."""
    return pad_rows(anchors, bp), pad_rows(starts, bp), pad_rows(tables, bp * width, dim=1), pad_rows(lengths, bp)

def replay_fixed(drafter, requests, anchors, starts, tables, lengths) -> list:
    """A fixed-size draft replayed in its bucket's graph, then the one read."""
    b = len(requests)
    bp = pow2(b)
    out = drafter.graphs.run(bp, _padded(bp, drafter.model.window, anchors, starts, tables, lengths), key=("fixed",))
    return TreeBatch(out.tokens[:b], out.parents[:b]).trees()

def replay_budget(drafter, requests, anchors, starts, tables, lengths) -> list:
    """The budgeted tree replayed in its bucket's graph, then the read and the budget's and the
    learner's host side as budget_trees does it (read_trees)."""
    d = drafter
    b, dev, policy = len(requests), d.model.device, d.policy
    bp = pow2(b)
    pool = candidate_pool_size(d.shape.topk, d.shape.num_steps)
    weights = d.values.model.weights
    extra = (torch.tensor(b, device=dev), table_seconds(policy.table, b, bp * pool).to(dev),
             torch.tensor(weights if weights is not None else [0.0] * len(FEATURES), dtype=torch.float64, device=dev))
    out = d.graphs.run(bp, _padded(bp, d.model.window, anchors, starts, tables, lengths) + extra,
                       key=("budget", weights is not None))
    batch = TreeBatch(out.batch.tokens[:b], out.batch.parents[:b], out.batch.counts[:b])
    rows = PoolValues(out.pool.values[:b], out.pool.depths, out.pool.parents[:b], out.pool.features[:b])
    return read_trees(policy, d.values, requests, batch, out.unsettled, out.tokens[:b], rows)  # read before the next replay


def replay_drawn(drafter, requests, anchors, starts, tables, lengths, adaptive: bool) -> list:
    """A sampled draft replayed in its bucket's graph: the uniforms drawn first from the run's
    generator (the eager draft's draws), then the read; adaptive, the chain budget's host side as
    the eager draft does it (the lagged confidences in, this round's kept for later rounds)."""
    d = drafter
    b, dev = len(requests), d.model.device
    bp, depth = pow2(b), d.spine_depth
    temperature, top_p, generator = d.sampling
    inputs = _padded(bp, d.model.window, anchors, starts, tables, lengths) + (
        pad_rows(draw_uniforms(generator, b, depth, dev), bp),)
    if adaptive:
        inputs += _chain_budget_inputs(d, requests, depth, bp) + (d.sibling_rate.rates(dev),)
    out = d.graphs.run(bp, inputs, key=("drawn", adaptive, temperature, top_p))
    rows = out.rows[:b].clone()  # the trees keep their rows past the next replay
    if not adaptive:
        return TreeBatch(out.batch.tokens[:b], out.batch.parents[:b]).trees(rows)
    return _read_chain_budget(d, requests, out, rows, d.sibling_rate if d.shape.topk > 1 else None)


def _chain_budget_inputs(drafter, requests, depth: int, bp: int) -> tuple:
    """The chain budget's host state as inputs: the live count, the table's seconds at every
    budget over bp x depth candidates, each request's lagged confidences (padding rows 0)."""
    policy, dev, b = drafter.policy, drafter.model.device, len(requests)
    policy.kind = "chain"
    return (torch.tensor(b, device=dev), table_seconds(policy.table, b, bp * depth).to(dev),
            pad_rows(policy.lagged([r.request_id for r in requests], dev, depth), bp))


def _read_chain_budget(drafter, requests, out: DrawnDraft, rows, sibling_rate) -> list:
    """After a chain-budget replay: this round's confidences kept for later budgets, then the read."""
    b = len(requests)
    drafter.policy.remember([r.request_id for r in requests], out.confidence[:b].clone())
    batch = TreeBatch(out.batch.tokens[:b], out.batch.parents[:b], out.batch.counts[:b])
    return read_chain_budget(drafter.policy, sibling_rate, requests, batch, rows, out.unsettled)


def replay_chain_budget(drafter, requests, anchors, starts, tables, lengths) -> list:
    """The greedy budgeted chain replayed in its bucket's graph, then the read (adaptive_chains'
    host side)."""
    d = drafter
    b, bp, gamma = len(requests), pow2(len(requests)), d.module.block_size
    inputs = _padded(bp, d.model.window, anchors, starts, tables, lengths) + _chain_budget_inputs(d, requests, gamma, bp)
    return _read_chain_budget(d, requests, d.graphs.run(bp, inputs, key=("chain budget",)), None, None)


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
