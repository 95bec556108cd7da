"""The lightning indexer of a C4 layer over the device tables: committed keys through each
request's entry page table (one pass per request, shared by its rows), plus each row's own
branch keys; one top-k on the device with the tie rule; the picks mapped to entry slots.

Candidate order is block order, as the tie rule needs: a row's committed entries (columns
[0, C), -inf past the request's count) then its branch entries root-to-node (columns [C, C+Kb)).
The backend's `indexer_topk` does all of it: the torch backend through a [T, C + Kb] score
tensor (torch_ops.indexer_topk), the Triton one in one kernel per layer with no score tensor
(kernels/tree_indexer.py). The same ops whatever the context: no loop over candidate chunks,
no [T, C] slot table."""
from __future__ import annotations

from ..serving.tables import CompressTables, RowGroups


def indexer_select(ops, q, weights, keys, ct: CompressTables, groups: RowGroups, scale: float, topk: int):
    """q [T, HI, dI], weights [T, HI], keys: the indexer-key pool -> (selected entry slots [T, k]
    (-1 = none), lengths [T], ties [T]), k = min(topk, C + Kb)."""
    return ops.indexer_topk(q, weights, keys, ct.entry_pages, ct.entries_per_page, ct.entry_len, ct.branch,
                            groups.req_rows, scale, topk)
