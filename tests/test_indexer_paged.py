"""The paged indexer: committed keys scored once per request through its entry page table
equal the per-row candidate-table scores, in both backends, and the device top-k over
[committed | branch] picks what the tie rule picks over the reference's per-row table."""
import pytest
import torch

from dsv4_tree import kernels
from dsv4_tree.attention.backend import TORCH_OPS, get_backend
from dsv4_tree.attention.indexer import indexer_select
from dsv4_tree.attention.torch_ops import select_topk_table
from dsv4_tree.reference.sparse_decode import ref_indexer_gather_scores, ref_indexer_paged_scores
from dsv4_tree.serving import KVPool
from dsv4_tree.serving.tables import CompressTables, RowGroups

# fp32 on both sides; batched products vs per-row products sum the same terms in another order:
# rounding only (~1e-6 relative); a wrong key or mask changes scores by O(1).
TOL = dict(rtol=1e-4, atol=1e-5)


EPP = 4  # committed entries per page


def case(sizes, lens, c, kb, h, d, seed, device):
    """Requests with `sizes` rows and `lens` committed keys (page form: c / EPP pages each, in a
    shuffled page order); each row has up to kb branch keys of its own. Returns q, w, keys pool,
    CompressTables, RowGroups and the reference's per-row candidate table [T, c + kb]
    (committed then branch, -1 padding)."""
    g = torch.Generator().manual_seed(seed)
    b, n, t = len(sizes), max(sizes), sum(sizes)
    pool_rows = b * c + t * kb + 1
    keys = KVPool(pool_rows, d, 0, "auto", 16, device, torch.float32)
    keys.write(torch.arange(pool_rows, device=device), torch.randn(pool_rows, d, generator=g).to(device))
    pages = torch.randperm(b * c // EPP, generator=g).view(b, c // EPP).to(torch.int32)
    entry_slots = (pages.long().unsqueeze(2) * EPP + torch.arange(EPP)).flatten(1)
    entry_slots = torch.where(torch.arange(c) < torch.tensor(lens).unsqueeze(1), entry_slots, -1)
    row_req = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    node = torch.cat([torch.arange(s) for s in sizes])
    branch_len = torch.randint(0, kb + 1, (t,), generator=g)
    branch = b * c + torch.arange(t).unsqueeze(1) * kb + torch.arange(kb)
    branch = torch.where(torch.arange(kb) < branch_len.unsqueeze(1), branch, -1)
    req_rows = torch.full((b, n), -1, dtype=torch.int64)
    req_rows[row_req, node] = torch.arange(t)
    groups = RowGroups(row_req.to(device), (row_req * n + node).to(device), req_rows.to(device))
    table = torch.full((t, c + kb), -1, dtype=torch.int64)
    for r in range(t):
        lst = torch.cat([entry_slots[row_req[r], : lens[row_req[r]]], branch[r, : branch_len[r]]])
        table[r, : lst.numel()] = lst
    ct = CompressTables(4, None, None, None, None, pages.to(device), EPP, torch.tensor(lens, device=device),
                        branch.to(device), branch_len.to(device))
    q, w = torch.randn(t, h, d, generator=g).to(device), torch.randn(t, h, generator=g).to(device)
    return q, w, keys, ct, groups, table.to(device), entry_slots.to(device)


CASES = [((3, 1, 4), (20, 0, 7), 24, 2, 8, 16), ((1,), (5,), 8, 3, 4, 16), ((2, 2), (0, 0), 4, 1, 4, 8)]


@pytest.mark.parametrize("sizes,lens,c,kb,h,d", CASES)
def test_paged_scores_equal_the_per_row_table_scores(sizes, lens, c, kb, h, d, device):
    q, w, keys, ct, groups, table, entry_slots = case(sizes, lens, c, kb, h, d, sum(sizes) + c, device)
    full = entry_slots[groups.row_req]  # the [T, C] table the paged form avoids (test only)
    want = ref_indexer_gather_scores(q, w, keys, full, 0.5)
    args = (ct.entry_pages, ct.entries_per_page, ct.entry_len, groups.req_rows, groups.row_slot, 0.5)
    got = ref_indexer_paged_scores(q, w, keys, *args)
    assert torch.allclose(got, want, **TOL) and torch.equal(torch.isinf(got), full < 0)
    tri = kernels.indexer_paged_scores(q, w, keys, *args)
    assert torch.allclose(tri, want, **TOL) and torch.equal(torch.isinf(tri), full < 0)


@pytest.mark.parametrize("sizes,lens,c,kb,h,d", CASES)
@pytest.mark.parametrize("topk", [1, 4, 64])
def test_device_topk_picks_what_the_reference_table_picks(sizes, lens, c, kb, h, d, topk, device):
    q, w, keys, ct, groups, table, _ = case(sizes, lens, c, kb, h, d, 3 * sum(sizes) + c, device)
    want_scores = ref_indexer_gather_scores(q, w, keys, table, 0.5)
    want = select_topk_table(want_scores, table, topk)
    assert not want[2].any(), "generated case has a boundary tie"
    for ops in (TORCH_OPS, get_backend("triton")):
        sel, lengths, ties = indexer_select(ops, q, w, keys, ct, groups, 0.5, topk)
        assert torch.equal(lengths, want[1].long()) and not ties.any(), ops.name
        k = want[0].shape[1]
        assert torch.equal(sel[:, :k], want[0].long()) and (sel[:, k:] == -1).all(), ops.name
