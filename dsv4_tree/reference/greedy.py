"""Reference greedy acceptance through SGLang's tensor form (verify_tree_greedy): the yardstick
of the host walk Engine.accept_greedy runs (verify/accept.py: greedy_walk)."""
from __future__ import annotations

import torch

from ..tree.build import links_from_parents
from ..tree.draft_tree import DraftTree
from ..tree.greedy import verify_tree_greedy


def ref_greedy_path(tree: DraftTree, logits: torch.Tensor) -> tuple[list, int]:
    """(path node ids, bonus token) of greedy acceptance on one tree, from SGLang's tensor form."""
    n = tree.num_nodes
    first, sib = links_from_parents(tree.parents.unsqueeze(0))
    target = logits.argmax(-1).cpu().unsqueeze(0)
    res = verify_tree_greedy(
        tree.tokens.unsqueeze(0), torch.arange(n).unsqueeze(0), first, sib, target, tree.max_depth + 1
    )
    acc = res.accept_index[0]
    path = acc[acc >= 0].tolist()
    return path, int(res.predicts[path[-1]])
