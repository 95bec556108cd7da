"""The lightning indexer of a C4 layer over the device tables: committed keys through each
request's entry page table (one pass per request, shared by its rows), plus each row's own
branch keys; one top-k on the device with the tie rule; the picks mapped to entry slots.

Candidate order is block order, as the tie rule needs: a row's committed entries (columns
[0, C), -inf past the request's count) then its branch entries root-to-node (columns [C, C+Kb)).
The same ops whatever the context: no loop over candidate chunks, no [T, C] slot table."""
from __future__ import annotations

import torch

from .torch_ops import topk_order
from ..serving.tables import CompressTables, RowGroups, entry_slot_of


def indexer_select(ops, q, weights, keys, ct: CompressTables, groups: RowGroups, scale: float, topk: int):
    """q [T, HI, dI], weights [T, HI], keys: the indexer-key pool -> (selected entry slots [T, k]
    (-1 = none), lengths [T], ties [T]), k = min(topk, C + Kb)."""
    committed = ops.indexer_paged_scores(q, weights, keys, ct.entry_pages, ct.entries_per_page, ct.entry_len,
                                         groups.req_rows, groups.row_slot, scale)  # [T, C]
    own = ops.indexer_scores(q, weights, keys, ct.branch, scale)  # [T, Kb]
    c, kb = committed.shape[1], ct.branch.shape[1]
    order, valid, ties = topk_order(torch.cat([committed, own], 1), topk)
    req = groups.row_req.clamp(min=0).unsqueeze(1)
    picked = torch.where(order < c, entry_slot_of(ct, req, order.clamp(max=c - 1)),
                         ct.branch.gather(1, (order - c).clamp(min=0, max=kb - 1)))
    real = groups.row_req >= 0
    valid = valid & real.unsqueeze(1)
    return torch.where(valid, picked, -1), valid.sum(1), torch.where(real, ties, 0)
