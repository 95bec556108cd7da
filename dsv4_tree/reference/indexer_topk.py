"""Clear torch reference of the tree-aware indexer: every candidate's score written out, then the
tie rule by sorting each row's list (what kernels/tree_indexer.py computes without any score
tensor).

  ref_indexer_topk -- per row: its request's committed indexer keys (ref_indexer_paged_scores)
                      then its own branch keys (ref_indexer_gather_scores), in block order; the
                      top-k by ref_select_topk; the picks as entry slots, with their scores."""
from __future__ import annotations

import torch

from .ops import ref_select_topk
from .sparse_decode import ref_indexer_gather_scores, ref_indexer_paged_scores


def ref_indexer_topk(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows, scale, topk):
    """q [T, HI, dI]; weights [T, HI]; keys: a KVPool of indexer keys; entry_pages [B, Cp], entry_len
    [B]: entry c of request b at slot entry_pages[b, c // epp] * epp + c % epp (epp =
    entries_per_page), c < entry_len[b]; branch [T, Kb] the row's own entry slots (-1 = none);
    req_rows [B, N] packed row of node i of request b (-1 = none; rows in no request are padding).
    Returns (selected [T, k] int64 slots, -1 = none; lengths [T]; ties [T]; scores [T, k] of the
    selected, -inf = none), k = min(topk, Cp * epp + Kb). Padding rows select nothing."""
    t, epp = q.shape[0], entries_per_page
    c = entry_pages.shape[1] * epp
    k = min(topk, c + branch.shape[1])
    sel = torch.full((t, k), -1, dtype=torch.int64)
    lengths, ties = torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64)
    scores = torch.full((t, k), float("-inf"))
    n = req_rows.shape[1]
    for b in range(req_rows.shape[0]):
        for node in range(n):
            row = int(req_rows[b, node])
            if row < 0:
                continue
            one = slice(row, row + 1)
            slot_of = torch.full((1,), b * n + node, dtype=torch.int64)
            committed = ref_indexer_paged_scores(q[one], weights[one], keys, entry_pages, epp, entry_len, req_rows,
                                                 slot_of, scale)  # [1, C]
            own = ref_indexer_gather_scores(q[one], weights[one], keys, branch[one], scale)  # [1, Kb]
            cols = torch.arange(c)
            committed_slots = entry_pages[b].long().repeat_interleave(epp) * epp + cols % epp
            cand = torch.cat([torch.where(cols < entry_len[b], committed_slots, -1), branch[row].long()]).unsqueeze(0)
            row_scores = torch.cat([committed, own], 1).cpu()
            picked, length, tie = ref_select_topk(row_scores, cand.cpu(), topk)
            sel[row], lengths[row], ties[row] = picked[0], length[0], tie[0]
            order = [int((cand[0] == s).nonzero()[0]) for s in picked[0].tolist() if s >= 0]
            scores[row, : len(order)] = row_scores[0, order]
    dev = q.device
    return sel.to(dev), lengths.to(dev), ties.to(dev), scores.to(dev)
