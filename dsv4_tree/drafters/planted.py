"""SYNTHETIC test drafter: plants the target's own greedy continuation as one branch among
random siblings. It asks the target model (uncached forwards) for the answer, so it is only
for tests and for showing acceptance mechanics -- never a real speedup."""
from __future__ import annotations

import torch

from ..model.full_forward import sequence_logits
from ..request import check_live
from ..tree.draft_tree import DraftTree
from .base import TreeShape


class PlantedDrafter:
    def __init__(self, model, shape: TreeShape, corrupt: float = 0.25, seed: int = 0):
        self.model, self.shape, self.corrupt = model, shape, corrupt
        self.gen = torch.Generator().manual_seed(seed)

    def _rand(self, hi: int) -> int:
        return int(torch.randint(hi, (1,), generator=self.gen))

    def greedy_continuation(self, tokens: torch.Tensor, root: int, steps: int) -> list:
        seq = torch.cat([tokens, torch.tensor([root])])
        out = []
        for _ in range(steps):
            nxt = int(sequence_logits(self.model, seq)[-1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([nxt])])
        return out

    def shape_tree(self) -> list:
        """Random parents (BFS order): 1..topk children per node, depth <= num_steps."""
        s = self.shape
        parents, frontier, depth = [-1], [0], 0
        while frontier and depth < s.num_steps and len(parents) < s.num_draft_tokens:
            nxt = []
            for u in frontier:
                for _ in range(1 + self._rand(s.topk)):
                    if len(parents) >= s.num_draft_tokens:
                        break
                    parents.append(u)
                    nxt.append(len(parents) - 1)
            frontier, depth = nxt, depth + 1
        return parents

    def draft_one(self, req) -> DraftTree:
        parents = self.shape_tree()
        n = len(parents)
        vocab = self.model.vocab_size
        toks = torch.randint(vocab, (n,), generator=self.gen)
        toks[0] = req.root_token
        kids = {u: [i for i in range(n) if parents[i] == u] for u in range(n)}
        walk, cur = [], 0  # the branch that carries the target's continuation
        while kids[cur]:
            cur = kids[cur][self._rand(len(kids[cur]))]
            walk.append(cur)
        planted = self.greedy_continuation(req.tokens, req.root_token, len(walk))
        for node, tok in zip(walk, planted):
            good = float(torch.rand(1, generator=self.gen)) >= self.corrupt
            toks[node] = tok if good else self._rand(vocab)
        return DraftTree(toks.long(), torch.tensor(parents, dtype=torch.int64))

    def draft(self, engine, requests) -> list:
        check_live(requests)
        return [self.draft_one(r) for r in requests]
