"""Lossless stochastic acceptance: multi-candidate recursive rejection sampling on a tree.

At each accepted node u one uniform r is drawn and compared with the running sum of the
target's probabilities of u's children in sibling order; a child whose token was already
counted (an equal-token sibling) adds nothing. If r falls past the sum, every child's token
is removed from the target and the bonus is drawn from the renormalised remainder. Each
emitted token is therefore distributed exactly as the target's next-token distribution."""
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


def sample_chain(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Speculative sampling along a chain whose tokens were drawn from tree.draft_probs: draft
    i (node i, drawn from q_i = draft_probs[i - 1]) is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)); at the first rejection the bonus is drawn from
    max(p_i - q_i, 0) renormalised; after the last draft, from the target's last row. probs
    [N, V]: the target's distributions at the chain's nodes. -> (path, bonus). Each emitted
    token is distributed exactly as the target's next-token distribution."""
    q_all = tree.draft_probs.to(torch.float64)
    if q_all.shape[1] != probs.shape[1]:
        raise InputError(f"the chain's draft_probs have {q_all.shape[1]} columns, the target's distributions "
                         f"{probs.shape[1]}: draws must be over the target's vocabulary")
    path = [0]
    for i in range(1, tree.num_nodes):
        p, q = probs[i - 1].to(torch.float64), q_all[i - 1]
        t = int(tree.tokens[i])
        r = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if r * float(q[t]) < float(p[t]):
            path.append(i)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the rejection had probability 0
            residual = p
        return path, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    last = probs[tree.num_nodes - 1].to(torch.float64)
    return path, int(torch.multinomial(last / last.sum(), 1, generator=generator))


def sample_tree(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """The lossless acceptance a drafted tree asks for: speculative sampling against the draw
    distributions of a sampled chain (tree.draft_probs), else recursive rejection sampling of a
    tree fixed before any draw. -> (path, bonus)."""
    if tree.draft_probs is not None:
        return sample_chain(tree, probs, generator)
    return sample_path(tree, probs, generator)
