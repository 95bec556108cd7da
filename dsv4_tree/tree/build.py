"""SGLang-compatible EAGLE tree tensors: organize_draft_results and build_tree (batched)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import TreeError
from .draft_tree import ancestor_matrix, depth_by_pointer_jumping
from .masks import TreeMaskMode, bitpack_dtype, make_tree_mask


class OrganizedDraft(NamedTuple):
    parent_list: torch.Tensor  # [bs, K*(S-1)+1] global candidate id of each expanded frontier node
    top_scores_index: torch.Tensor  # [bs, N-1] selected candidate ids, ascending
    draft_tokens: torch.Tensor  # [bs, N-1] their tokens


class BuiltTree(NamedTuple):
    tree_mask: torch.Tensor  # layout per TreeMaskMode
    positions: torch.Tensor  # [bs*N] seq_len + depth
    retrieve_index: torch.Tensor  # [bs, N] global row ids b*N + k
    retrieve_next_token: torch.Tensor  # [bs, N] first child (local id) or -1
    retrieve_next_sibling: torch.Tensor  # [bs, N] next sibling (local id) or -1
    draft_tokens: torch.Tensor  # [bs*N] root (bonus) first per request
    parents: torch.Tensor  # [bs, N] local parent id, -1 at the root (ours; not in SGLang)


def _check_int(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TreeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TreeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise TreeError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def organize_draft_results(score_list, token_list, parents_list, num_draft_tokens: int) -> OrganizedDraft:
    """Select the best num_draft_tokens - 1 candidates of an EAGLE expansion.

    score_list[0]: [bs, 1, K]; score_list[i>0]: [bs, K, K] cumulative scores.
    token_list[0]: [bs, K]; token_list[i>0]: [bs, K*K].
    parents_list[0]: [bs, K+1] = [-1, 0..K-1]; parents_list[i>0]: [bs, K] global ids."""
    if not (len(score_list) == len(token_list) == len(parents_list)) or not score_list:
        raise TreeError(
            f"score_list, token_list, parents_list must be equally long and non-empty; got "
            f"{len(score_list)}, {len(token_list)}, {len(parents_list)}"
        )
    bs = score_list[0].shape[0]
    scores = torch.cat([s.reshape(bs, -1) for s in score_list], dim=1)
    tokens = torch.cat([t.reshape(bs, -1) for t in token_list], dim=1)
    if not scores.is_floating_point():
        raise TreeError(f"scores must be floating point, got {scores.dtype}")
    if scores.shape != tokens.shape:
        raise TreeError(f"candidate pool of scores {tuple(scores.shape)} and tokens {tuple(tokens.shape)} differ")
    pool = scores.shape[1]
    if num_draft_tokens < 1 or num_draft_tokens - 1 > pool:
        raise TreeError(f"num_draft_tokens - 1 = {num_draft_tokens - 1} must lie in [0, candidate pool = {pool}]")
    # stable descending sort: on equal scores the lower candidate id wins. A parent's id is
    # lower than its children's and its score is >= theirs, so the selection stays connected
    # even when a child's probability is exactly 1 (torch.topk gives no such guarantee).
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : num_draft_tokens - 1]
    top_scores_index = torch.sort(top, dim=-1).values
    draft_tokens = torch.gather(tokens, 1, top_scores_index)
    if len(parents_list) > 1:
        parent_list = torch.cat([p.reshape(bs, -1) for p in parents_list[:-1]], dim=1)
    else:
        parent_list = torch.empty(bs, 0, dtype=torch.int64, device=scores.device)
    return OrganizedDraft(parent_list.long(), top_scores_index.long(), draft_tokens.long())


def local_parents(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int,
                  check: bool = True) -> torch.Tensor:
    """Local parent id of every node ([bs, N], root -1). Raises TreeError on a missing parent.
    check=False: the selection is organize_draft_results' own (connected by construction), so
    the checks, which read the device, are skipped: a fixed number of tensor ops, no host read."""
    bs, m = top_scores_index.shape
    if m == 0:
        return torch.full((bs, 1), -1, dtype=torch.int64, device=top_scores_index.device)
    row = top_scores_index // topk  # [bs, N-1]; 0 -> the root
    if check and (top_scores_index < 0).any():
        raise TreeError("top_scores_index holds negative candidate ids")
    if check and m and int(row.max()) >= max(parent_list.shape[1], 1):
        raise TreeError(
            f"candidate id {int(top_scores_index.max())} needs parent_list row {int(row.max())}, "
            f"but parent_list has {parent_list.shape[1]} columns"
        )
    safe_row = row.clamp(max=max(parent_list.shape[1] - 1, 0))
    parent_cand = torch.where(
        row == 0,
        torch.full_like(row, -1),
        torch.gather(parent_list, 1, safe_row) if parent_list.shape[1] else torch.full_like(row, -1),
    )
    match = top_scores_index.unsqueeze(1) == parent_cand.unsqueeze(2)  # [bs, N-1, N-1]
    found = match.any(-1)
    missing = (parent_cand >= 0) & ~found
    if check and missing.any():
        b, k = (int(v) for v in missing.nonzero()[0])
        raise TreeError(
            f"request {b}, node {k + 1} (candidate {int(top_scores_index[b, k])}): its parent candidate "
            f"{int(parent_cand[b, k])} is not among the selected nodes (NaN or inconsistent scores?)"
        )
    parent_local = torch.where(parent_cand >= 0, match.float().argmax(-1) + 1, torch.zeros_like(row))
    idx = torch.arange(1, m + 1, device=row.device)
    if check and (parent_local >= idx).any():
        raise TreeError("a selected node's parent does not precede it (top_scores_index must be ascending)")
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=row.device)
    return torch.cat([root, parent_local.long()], dim=1)


def links_from_parents(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first child, next sibling) local ids from [bs, N] parents; children in increasing id."""
    bs, n = parents.shape
    ids = torch.arange(n, device=parents.device)
    big = torch.full((bs, n, n), n, dtype=torch.int64, device=parents.device)
    is_child = parents.unsqueeze(1) == ids.view(1, n, 1)  # [bs, parent u, child k]
    first = torch.where(is_child, ids.view(1, 1, n).expand(bs, n, n), big).min(-1).values
    same = (parents.unsqueeze(1) == parents.unsqueeze(2)) & (parents.unsqueeze(2) >= 0)  # [bs, k, k']
    later = ids.view(1, 1, n) > ids.view(1, n, 1)
    nxt = torch.where(same & later, ids.view(1, 1, n).expand(bs, n, n), big).min(-1).values
    minus = torch.full_like(first, -1)
    return torch.where(first < n, first, minus), torch.where(nxt < n, nxt, minus)


def build_tree(
    bonus_tokens: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    mask_mode: TreeMaskMode = TreeMaskMode.FULL_MASK,
) -> BuiltTree:
    """Turn organize_draft_results output into SGLang's verify tensors (batched, vectorised)."""
    _check_int("bonus_tokens", bonus_tokens, 1)
    _check_int("parent_list", parent_list, 2)
    _check_int("top_scores_index", top_scores_index, 2)
    _check_int("draft_tokens", draft_tokens, 2)
    _check_int("seq_lens", seq_lens, 1)
    bs = bonus_tokens.shape[0]
    n = num_draft_tokens
    if top_scores_index.shape != (bs, n - 1) or draft_tokens.shape != (bs, n - 1):
        raise TreeError(
            f"top_scores_index {tuple(top_scores_index.shape)} and draft_tokens {tuple(draft_tokens.shape)} "
            f"must be (bs={bs}, num_draft_tokens-1={n - 1})"
        )
    if seq_lens.shape[0] != bs or parent_list.shape[0] != bs:
        raise TreeError(f"seq_lens {tuple(seq_lens.shape)} / parent_list {tuple(parent_list.shape)} need bs={bs}")
    if parent_list.shape[1] > topk * max(num_steps - 1, 0) + 1:
        raise TreeError(f"parent_list has {parent_list.shape[1]} columns, at most topk*(num_steps-1)+1 allowed")
    mode = TreeMaskMode(mask_mode)
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        bitpack_dtype(n)
    parents = local_parents(parent_list.long(), top_scores_index.long(), topk)
    depth = depth_by_pointer_jumping(parents)
    if int(depth.max()) > num_steps:
        raise TreeError(f"tree depth {int(depth.max())} exceeds num_steps={num_steps}")
    positions = (seq_lens.long().unsqueeze(1) + depth).reshape(-1)
    retrieve_index = torch.arange(bs * n, device=parents.device).view(bs, n)
    next_token, next_sibling = links_from_parents(parents)
    tokens = torch.cat([bonus_tokens.long().unsqueeze(1), draft_tokens.long()], dim=1).reshape(-1)
    mask = make_tree_mask(ancestor_matrix(parents), seq_lens, mode)
    return BuiltTree(mask, positions, retrieve_index, next_token, next_sibling, tokens, parents)
