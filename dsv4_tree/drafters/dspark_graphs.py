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

Drafts along a spine (sampled drafts and the greedy budgeted chain) are in
drafters/dspark_spine_graphs.py; which form serves a draft, and the capture's function, in
drafters/dspark_replay.py.

The drafter captures such a function once per bucket (executor/graphs.BucketGraphs: B rounded
up to a power of two; padding requests have no context and an anchor of 0, their rows attend to
their own block only and their trees are dropped) and replays it: the inputs are copied into
the bucket's static buffers (`padded_inputs`), the graph replays, and the drafter takes the
real rows of its static outputs. What stays eager: bring_up, the packing, and the one host read
of the trees (the budget's host side through dspark_budget.read_trees, as the eager
budget_trees)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget.node_values import FEATURES, PoolValues, pool_values, share_with
from ..budget.verify_budget import budget_fixed, chosen_fixed, eligible_fixed
from ..executor.graphs import pad_rows
from ..hooks import candidate_pool_size
from ..serving.buckets import pow2
from ..tree.build import local_parents, organize_draft_results
from ..tree.tree_batch import TreeBatch
from .dspark_budget import batch_of, read_trees
from .dspark_rows import block_ids, block_rows, markov_walk, padded_block_index
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
    return batch.contiguous()  # own memory: a graph's static outputs


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
    return BudgetDraft(batch.contiguous(), sel.contiguous(), unsettled, tokens.contiguous(), own)


def padded_inputs(bp: int, width: int, anchors, starts, tables, lengths) -> tuple:
    """The four inputs padded to bp requests (padding: anchor 0, no context)."""
    return pad_rows(anchors, bp), pad_rows(starts, bp), pad_rows(tables, bp * width, dim=1), pad_rows(lengths, bp)


def replay_fixed(drafter, requests, anchors, starts, tables, lengths) -> list:
    """A fixed-size draft replayed in its bucket's graph, then the one read."""
    b = len(requests)
    bp = pow2(b)
    out = drafter.graphs.run(bp, padded_inputs(bp, drafter.model.window, anchors, starts, tables, lengths), key=("fixed",))
    return out.first(b).trees()


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
    out = d.graphs.run(bp, padded_inputs(bp, d.model.window, anchors, starts, tables, lengths) + extra,
                       key=("budget", weights is not None))
    batch = out.batch.first(b)
    rows = PoolValues(out.pool.values[:b], out.pool.depths, out.pool.parents[:b], out.pool.features[:b])
    return read_trees(policy, d.values, requests, batch, out.unsettled, out.tokens[:b], rows)  # read before the next replay
