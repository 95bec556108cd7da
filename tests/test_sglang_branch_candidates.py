"""The plug-in's per-branch C4 indexer candidates (pure torch, no SGLang import): splicing each
row's scratch scores into its logits and remapping its selected branch blocks, against a per-row
loop; on PyTorch's `meta` device, none of them reads device values on the host."""
import pytest
import torch

from dsv4_tree.errors import ConfigError
from dsv4_tree.sglang_plugin.branch_candidates import (remap_branch_indices, scratch_index_pages,
                                                       splice_branch_scores)

PAGE, START, PER = 64, 6400, 10


def rows_case(gen, r=12, cols=40, width=3):
    """Random rows: committed counts, 0..width branch entries each (home slots < START, scratch
    slots in the row's request's scratch region), some rows ending at the last column."""
    req = torch.randint(0, 9, (r,), generator=gen)
    committed = torch.randint(0, cols - width, (r,), generator=gen)
    committed[:2] = cols - width  # branch blocks up to the last column
    committed[2] = cols - 2  # a short branch ending at the last column (padding j's past it)
    count = torch.randint(0, width + 1, (r,), generator=gen)
    count[:2], count[2] = width, 2
    branch = torch.full((r, width), -1, dtype=torch.int64)
    for t in range(r):
        for j in range(int(count[t])):
            scratch = t == 2 or bool(torch.rand(1, generator=gen) < 0.6)
            branch[t, j] = (START + int(req[t]) * PER + int(torch.randint(PER, (1,), generator=gen)) if scratch
                            else int(torch.randint(0, START, (1,), generator=gen)))
    return req, committed, branch


def test_splice_and_remap_equal_a_row_loop():
    gen = torch.Generator().manual_seed(0)
    req, committed, branch = rows_case(gen)
    r, cols = branch.shape[0], 40
    table, lens = scratch_index_pages(req, START, PER, START + 9 * PER - 1, PAGE, width=5)
    assert table.shape == (r, 5) and bool((lens == 2 * PAGE).all())
    logits = torch.randn(r, cols, generator=gen)
    scratch_logits = torch.randn(r, 2 * PAGE, generator=gen)
    want = logits.clone()
    for t in range(r):
        base = int(table[t, 0]) * PAGE
        for j, s in enumerate(branch[t].tolist()):
            if s >= START:
                col = s - base  # the score column of slot s: page col // PAGE of the row's table
                assert 0 <= col < 2 * PAGE and int(table[t, col // PAGE]) * PAGE + col % PAGE == s
                want[t, int(committed[t]) + j] = scratch_logits[t, s - base]
    got = splice_branch_scores(logits.clone(), scratch_logits, branch, committed, table, START, PAGE)
    assert torch.equal(got, want)

    k = 6
    raw = torch.randint(-1, cols, (r, k), generator=gen, dtype=torch.int32)
    raw[:2, :3] = torch.arange(cols - 3, cols, dtype=torch.int32)  # every branch block of the full rows
    pages = torch.randint(0, START, (r, k), generator=gen, dtype=torch.int32)
    want = pages.clone()
    for t in range(r):
        for c in range(k):
            rel = int(raw[t, c]) - int(committed[t])
            if int(raw[t, c]) >= 0 and 0 <= rel < branch.shape[1] and int(branch[t, rel]) >= 0:
                want[t, c] = int(branch[t, rel])
    got = remap_branch_indices(pages, raw, branch, committed)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_scratch_pages_clamp_to_the_last_scratch_page_and_refuse_a_wide_region():
    req = torch.tensor([0, 3, 8])
    last = START + 9 * PER - 1
    table, _ = scratch_index_pages(req, START, PER, last, PAGE, width=1)
    assert table.shape == (3, 2)
    assert table[:, 0].tolist() == [(START + q * PER) // PAGE for q in (0, 3, 8)]
    assert int(table[2, 1]) == last // PAGE
    with pytest.raises(ConfigError, match="per_request must be <= 64"):
        scratch_index_pages(req, START, 65, last, PAGE, width=4)


def test_branch_candidates_on_meta_device():
    dev = torch.device("meta")
    r, b, cols, k = 16, 3, 1024, 512
    req = torch.empty(r, dtype=torch.int32, device=dev)
    committed = torch.empty(r, dtype=torch.int32, device=dev)
    branch = torch.empty(r, b, dtype=torch.int64, device=dev)
    table, lens = scratch_index_pages(req, START, PER, START + 9 * PER - 1, PAGE, width=16)
    assert table.device == dev and lens.device == dev
    logits = splice_branch_scores(torch.empty(r, cols, device=dev), torch.empty(r, 2 * PAGE, device=dev), branch,
                                  committed, table, START, PAGE)
    assert logits.shape == (r, cols) and logits.device == dev
    out = remap_branch_indices(torch.empty(r, k, dtype=torch.int32, device=dev),
                               torch.empty(r, k, dtype=torch.int32, device=dev), branch, committed)
    assert out.shape == (r, k) and out.dtype == torch.int32 and out.device == dev
