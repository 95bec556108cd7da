"""Conversions between DraftTrees and the batched SGLang-style tensors."""
from __future__ import annotations

import torch

from ..errors import TreeError
from .draft_tree import DraftTree
from .greedy import parents_from_links
from .masks import TreeMaskMode, make_tree_mask


def trees_to_tensors(trees: list[DraftTree], seq_lens, mask_mode=TreeMaskMode.QLEN_ONLY) -> dict:
    """Stack equally sized trees into (positions, retrieve_*, draft_tokens, tree_mask, parents)."""
    if not trees:
        raise TreeError("trees_to_tensors needs at least one tree")
    n = trees[0].num_nodes
    if any(t.num_nodes != n for t in trees):
        raise TreeError(f"SGLang tensors need equal node counts, got {[t.num_nodes for t in trees]}")
    from .build import links_from_parents

    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    if seq_lens.shape != (len(trees),):
        raise TreeError(f"seq_lens must have one entry per tree ({len(trees)}), got {tuple(seq_lens.shape)}")
    parents = torch.stack([t.parents for t in trees])
    depth = torch.stack([t.depth for t in trees])
    first, sib = links_from_parents(parents)
    bs = len(trees)
    return {
        "positions": (seq_lens.unsqueeze(1) + depth).reshape(-1),
        "retrieve_index": torch.arange(bs * n).view(bs, n),
        "retrieve_next_token": first,
        "retrieve_next_sibling": sib,
        "draft_tokens": torch.stack([t.tokens for t in trees]).reshape(-1),
        "tree_mask": make_tree_mask(torch.stack([t.ancestors for t in trees]), seq_lens, mask_mode),
        "parents": parents,
    }


def tensors_to_trees(draft_tokens: torch.Tensor, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor):
    """Rebuild one DraftTree per request from flat tokens and first-child / next-sibling links."""
    bs, n = retrieve_next_token.shape
    if draft_tokens.numel() != bs * n:
        raise TreeError(f"draft_tokens must hold bs*N={bs * n} entries, got {draft_tokens.numel()}")
    parents = parents_from_links(retrieve_next_token.long(), retrieve_next_sibling.long())
    tokens = draft_tokens.reshape(bs, n).long()
    return [DraftTree(tokens[b].clone(), parents[b].clone()) for b in range(bs)]
