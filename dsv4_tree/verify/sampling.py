"""Lossless stochastic acceptance: multi-candidate recursive rejection sampling on a tree.

A tree fixed before any draw (`sample_path`): at each accepted node u one uniform r is drawn and compared with the running sum of the
target's probabilities of u's children in sibling order; a child whose token was already
counted (an equal-token sibling) adds nothing. If r falls past the sum, every child's token
is removed from the target and the bonus is drawn from the renormalised remainder. Each
emitted token is therefore distributed exactly as the target's next-token distribution.
A drawn tree (or chain) carries the distributions its nodes were drawn from and is accepted
against them (`sample_drawn`); `sample_tree` picks the rule a tree asks for."""
from __future__ import annotations

import math

import torch

from ..errors import InputError
from ..tree.draft_tree import DraftTree


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top-p nucleus, renormalised. [N, V]"""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise InputError(f"{name} must be a real number, got {value!r}")
    if temperature <= 0 or math.isinf(temperature):
        raise InputError(f"temperature must be > 0 and finite for sampling, got {temperature}")
    if not 0 < top_p <= 1:
        raise InputError(f"top_p must lie in (0, 1], got {top_p}")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p >= top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_path(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Walk the tree with recursive rejection sampling. probs [N, V]. -> (path, bonus)."""
    children = [[] for _ in range(tree.num_nodes)]
    for i in range(1, tree.num_nodes):
        children[int(tree.parents[i])].append(i)
    path, u = [0], 0
    while True:
        residual = probs[u].clone()
        r = float(torch.rand(1, generator=generator, dtype=torch.float64))
        cum, chosen = 0.0, None
        for c in children[u]:
            t = int(tree.tokens[c])
            cum += float(residual[t])
            residual[t] = 0.0
            if r < cum:
                chosen = c
                break
        if chosen is None and children[u] and float(residual.sum()) <= 0.0:
            # rounding left r just past a sum that is 1: the last child with mass is the pick
            chosen = max((c for c in children[u] if float(probs[u][int(tree.tokens[c])]) > 0), default=None)
        if chosen is None:
            dist = residual if children[u] else probs[u]
            bonus = int(torch.multinomial(dist / dist.sum(), 1, generator=generator))
            return path, bonus
        path.append(chosen)
        u = chosen


def sample_drawn(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Speculative sampling of a tree whose nodes carry the distributions they were drawn from
    (tree.draft_probs; a node chosen, not drawn, has a one-hot row). At an accepted node u the
    residual starts as the target's p_u; u's children are tried in id order, child c (token x,
    drawn from q_c = draft_probs[c - 1]) accepted with probability min(1, residual(x) / q_c(x)),
    and each rejection replaces the residual by max(residual - q_c, 0) renormalised. Past the
    last child the bonus is drawn from the residual (the target's row at a leaf). Each emitted
    token is distributed exactly as the target's next-token distribution when every child was
    drawn from its row given the nodes before it (multi-draft recursive rejection sampling; a
    chain is the one-child case: min(1, p / q), then max(p - q, 0)). probs [N, V]: the target's
    distributions at the tree's nodes. -> (path, bonus)."""
    q_all = tree.draft_probs.to(torch.float64)
    if q_all.shape[1] != probs.shape[1]:
        raise InputError(f"the tree's draft_probs have {q_all.shape[1]} columns, the target's distributions "
                         f"{probs.shape[1]}: draws must be over the target's vocabulary")
    tokens, parents = tree.host_lists()
    children = [[] for _ in range(tree.num_nodes)]
    for i in range(1, tree.num_nodes):
        children[parents[i]].append(i)
    path, u = [0], 0
    while True:
        residual = probs[u].to(torch.float64)
        chosen = None
        for c in children[u]:
            q, t = q_all[c - 1].to(residual.device), tokens[c]
            r = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if r * float(q[t]) < float(residual[t]):
                chosen = c
                break
            rest = (residual - q).clamp(min=0)
            mass = float(rest.sum())
            if mass > 0.0:  # else residual == q up to rounding: the rejection had probability 0
                residual = rest / mass
        if chosen is None:
            return path, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        path.append(chosen)
        u = chosen


def sample_tree(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """The lossless acceptance a drafted tree asks for: speculative sampling against the draw
    distributions of a drawn tree or chain (tree.draft_probs), else recursive rejection sampling
    of a tree fixed before any draw. -> (path, bonus)."""
    if tree.draft_probs is not None:
        return sample_drawn(tree, probs, generator)
    return sample_path(tree, probs, generator)
