"""Adaptive DSpark drafts: the batch's verify budget picks each request's chain length or tree.

`adaptive_chains`: the drafted chains cut to the lengths SGLang's rule gives (budget_policy.chain_fixed).
`budget_trees`: every request's Markov expansion valued (node_values.pool_values), the batch's
best candidates picked under one budget (budget_policy.tree), each request's picked candidates
made a DraftTree. Both are exact for verify like any tree; trees are never drawn."""
from __future__ import annotations

import torch

from ..budget.node_values import pool_values
from ..tree.draft_tree import DraftTree
from ..tree.tree_batch import TreeBatch


def adaptive_chains(policy, model, requests, tokens: torch.Tensor, confidence: torch.Tensor) -> list:
    """tokens [R, gamma + 1] (the anchor, then the drafted chain), confidence [R, gamma] -> each
    chain's first verify-length nodes, the lengths SGLang's rule gives (budget_policy.chain_fixed)
    decided on the device; the chains and the budget reach the host in the draft's one read."""
    lens = policy.chain_fixed(model, [r.request_id for r in requests], confidence)
    return read_chain_budget(policy, None, requests, TreeBatch.chains(tokens, lens), None, policy.unsettled())


def trees_of(anchors: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, chosen: torch.Tensor) -> tuple:
    """anchors [R], pool tokens [R, P], parent pool ids [R, P] (-1: the root), chosen [R, P] bool
    (ancestor-closed) -> (one DraftTree per request, each tree's pool ids [n - 1]). A reference
    form, per request on the host (batch_of is the round's)."""
    trees, ids = [], []
    for r in range(chosen.shape[0]):
        sel = chosen[r].nonzero().flatten()  # ascending: a parent's pool id is below its children's
        local = torch.full((chosen.shape[1],), -1, dtype=torch.int64)
        local[sel] = torch.arange(1, sel.numel() + 1)
        par = parents[r, sel]
        node_parent = torch.where(par < 0, torch.zeros_like(par), local[par.clamp(min=0)])
        if bool((node_parent < 0).any()):
            raise AssertionError("a picked candidate's parent was not picked: the pick must be ancestor-closed")
        trees.append(DraftTree(torch.cat([anchors[r : r + 1], tokens[r, sel]]),
                               torch.cat([torch.tensor([-1]), node_parent])))
        ids.append(sel)
    return trees, ids


def batch_of(anchors: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, chosen: torch.Tensor,
             cap: int) -> tuple:
    """trees_of at a fixed shape on the device: each request's chosen pool ids first, ascending
    (at most cap of them: the pick's per-request cap) -> (TreeBatch [R, cap + 1] with node counts,
    the pool ids [R, cap], valid for each row's first count - 1)."""
    r, p = chosen.shape
    ar = torch.arange(p, device=chosen.device)
    sel = torch.sort(torch.where(chosen, ar, ar + p), dim=1).values[:, :cap] % p  # [R, cap]
    count = chosen.sum(1)
    valid = torch.arange(cap, device=chosen.device) < count.unsqueeze(1)
    local = torch.full((r, p), -1, dtype=torch.int64, device=chosen.device)
    local.scatter_(1, sel, torch.where(valid, torch.arange(1, cap + 1, device=chosen.device), -1).expand(r, cap))
    par = parents.gather(1, sel)
    node_parent = torch.where(par < 0, torch.zeros_like(par), local.gather(1, par.clamp(min=0)))
    node_parent = torch.where(valid, node_parent, -1)
    node_tokens = torch.where(valid, tokens.gather(1, sel), 0)
    batch = TreeBatch(torch.cat([anchors.unsqueeze(1), node_tokens], 1),
                      torch.cat([torch.full((r, 1), -1, dtype=torch.int64, device=chosen.device), node_parent], 1),
                      count + 1)
    return batch, sel


def budget_trees(policy, learner, model, requests, exp, anchors: torch.Tensor, topk: int) -> tuple:
    """-> (trees, each tree's pool ids): the batch's best nodes by value under one budget, picked
    on the device; the trees and the budget reach the host in the draft's one read."""
    pool = pool_values(exp, learner.model, topk)
    chosen = policy.tree(model, pool.values, pool.depths)
    b = anchors.shape[0]
    tokens = torch.cat([t.reshape(b, -1) for t in exp.token_list], 1)
    batch, sel = batch_of(anchors, tokens, pool.parents, chosen, policy.cap)
    trees = read_trees(policy, learner, requests, batch, policy.unsettled(), tokens, pool)
    return trees, [sel[i, : t.num_nodes - 1] for i, t in enumerate(trees)]


def read_trees(policy, learner, requests, batch: TreeBatch, unsettled: torch.Tensor, tokens: torch.Tensor,
               pool) -> list:
    """A budgeted tree draft's one host read and the host side after it. The budget (unsettled,
    [4]) and the learner's copy of the round's pool (tokens [B, P], PoolValues: its accept events
    after commit) ride in it; the policy settles the budget and starts timing the round."""
    trees, extra, host = batch.trees_with(unsettled, learner.payload(tokens, pool))
    policy.kind = "tree"
    policy.settle(extra)
    learner.drafted(requests, host)
    policy.drafted(requests, sum(t.num_nodes for t in trees))
    policy.value_weights = learner.model.weights
    return trees


def read_chain_budget(policy, sibling_rate, requests, batch: TreeBatch, rows, unsettled: torch.Tensor) -> list:
    """A draft under the chain budget (a greedy budgeted chain, an adaptive drawn tree): its one
    host read (the budget rides in it: unsettled, [4]) and the host side after it; rows
    [B, N - 1, V]: a drawn draft's draw rows, kept by its trees (a view, not read; None: greedy).
    sibling_rate: a drawn tree's (None: no siblings)."""
    trees, extra = batch.trees_and(unsettled, rows)
    policy.settle(extra)
    policy.drafted(requests, sum(t.num_nodes for t in trees))
    if sibling_rate is not None:
        sibling_rate.drafted(requests, trees)
    return trees
