"""A simulated EAGLE expansion (random scores with the real structure), for benchmarks, tests
and anyone checking the tree builders without a draft model."""
from __future__ import annotations

import torch


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
