"""A simulated EAGLE expansion (random scores with the real structure), for benchmarks, tests
and anyone checking the tree builders without a draft model."""
from __future__ import annotations

import torch

from .build import build_tree, organize_draft_results
from .convert import tensors_to_trees
from .draft_tree import DraftTree
from .masks import TreeMaskMode


def simulated_eagle_draft(bs: int, topk: int, num_steps: int, seed: int = 0, vocab: int = 1000, sharpness: float = 1.0):
    """(score_list, token_list, parents_list) as an EAGLE draft worker hands them to
    organize_draft_results: cumulative scores are products of probabilities <= 1, and each
    step's parents are the global candidate ids of the topk frontier nodes it expanded."""
    g = torch.Generator().manual_seed(seed)
    k = topk
    scores = [torch.rand(bs, 1, k, generator=g)]
    tokens = [torch.randint(0, vocab, (bs, k), generator=g)]
    parents = [torch.cat([torch.full((bs, 1), -1), torch.arange(k).expand(bs, k)], 1)]
    frontier = scores[0].reshape(bs, k)
    for i in range(1, num_steps):
        s = frontier.unsqueeze(-1) * torch.softmax(torch.randn(bs, k, k, generator=g) * sharpness, -1)
        scores.append(s)
        tokens.append(torch.randint(0, vocab, (bs, k * k), generator=g))
        top = s.reshape(bs, -1).topk(k, dim=-1).indices
        frontier = s.reshape(bs, -1).gather(1, top)
        parents.append(top + k * k * (i - 1) + k)
    return scores, tokens, parents


def eagle_tree(root: int, n: int, topk: int = 4, seed: int = 0, vocab: int = 1000) -> DraftTree:
    """An EAGLE-shaped tree of n nodes: simulated draft scores through the SGLang builders, with
    the fewest draft steps whose candidate pool holds n - 1 nodes. Draft tokens lie in [0, vocab)."""
    if n == 1:
        return DraftTree.chain([root])
    steps = 2
    while topk + (steps - 1) * topk * topk < n - 1:
        steps += 1
    scores, tokens, parents = simulated_eagle_draft(1, topk, steps, seed, vocab=vocab, sharpness=2.0)
    org = organize_draft_results(scores, tokens, parents, n)
    built = build_tree(torch.tensor([root]), org.parent_list, org.top_scores_index, org.draft_tokens,
                       torch.tensor([0]), topk, steps, n, TreeMaskMode.QLEN_ONLY)
    return tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)[0]
