"""Acceptance: which path of a verified tree is kept, and the bonus token after it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.draft_tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """path: node ids root..deepest accepted (starts with 0); bonus: the target's next token.
    The committed rows are path (n+1 nodes); the emitted tokens are tokens(path[1:]) + [bonus]."""

    path: tuple
    bonus: int
    request_id: int
    verify_id: int  # which verify call produced it (commit refuses stale ones)

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1

    def emitted(self, tree: DraftTree) -> list:
        tokens = tree.host_lists()[0]
        return [tokens[i] for i in self.path[1:]] + [self.bonus]


def greedy_path(tree: DraftTree, logits: torch.Tensor) -> tuple[list, int]:
    """SGLang greedy traversal on one tree: (path node ids, bonus token).

    Host walk over plain ints (one argmax per row, no tensor ops per node): from the root,
    take the first child in sibling order (= lowest local id) whose token is the target's
    argmax at the current node. Equal to verify_tree_greedy (tests/test_greedy_path.py)."""
    return greedy_walk(tree, logits.argmax(-1).tolist())


def greedy_walk(tree: DraftTree, target: list) -> tuple[list, int]:
    """greedy_path from the target's argmax per node, already on the host (a list of N ints):
    a batch reads all its argmaxes with one device-to-host copy (Engine.accept_greedy)."""
    n = tree.num_nodes
    if n == 1:
        return [0], target[0]
    tokens, parents = tree.host_lists()
    accepted_child: dict = {}  # node -> its first child that matches the target there
    for i in range(1, n):
        p = parents[i]
        if p not in accepted_child and tokens[i] == target[p]:
            accepted_child[p] = i
    path = [0]
    while path[-1] in accepted_child:
        path.append(accepted_child[path[-1]])
    return path, target[path[-1]]
