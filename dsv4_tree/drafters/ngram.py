"""Prompt-lookup n-gram drafter (model-free), arranged as a tree.

The continuations that followed earlier occurrences of the current suffix (longest n-gram
first, most recent occurrence first) are merged into a trie under the root: shared prefixes
share nodes, at most topk children per node, depth <= num_steps, <= num_draft_tokens nodes."""
from __future__ import annotations

import torch

from ..request import check_live
from ..tree.draft_tree import DraftTree
from .base import TreeShape


class NgramDrafter:
    def __init__(self, shape: TreeShape, max_ngram: int = 4, min_ngram: int = 1):
        self.shape = shape
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def continuations(self, context: list) -> list:
        found, seen = [], set()
        steps = self.shape.num_steps
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == suffix:
                    cont = tuple(context[start + n : start + n + steps])
                    if cont and cont not in seen:
                        seen.add(cont)
                        found.append(cont)
        return found

    def draft_one(self, tokens: list, root: int) -> DraftTree:
        s = self.shape
        toks, parents = [root], [-1]
        children: dict = {0: {}}
        for cont in self.continuations(tokens + [root]):
            node = 0
            for tok in cont:
                kids = children[node]
                if tok in kids:
                    node = kids[tok]
                    continue
                if len(kids) >= s.topk or len(toks) >= s.num_draft_tokens:
                    break
                toks.append(tok)
                parents.append(node)
                kids[tok] = len(toks) - 1
                children[len(toks) - 1] = {}
                node = len(toks) - 1
            if len(toks) >= s.num_draft_tokens:
                break
        return DraftTree(torch.tensor(toks, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))

    def draft(self, engine, requests) -> list:
        check_live(requests)
        return [self.draft_one(r.tokens.tolist(), r.root_token) for r in requests]
