"""Per-branch C4 indexer candidates for tree verify rows: pure tensor functions of the tree
tables (`tables.py`), no SGLang import, no host reads.

A tree row's C4 candidates are its path's entries: committed blocks 0 .. P//4 - 1 (through the
page table, as SGLang addresses them) and the blocks closed on its own path in this verify
(`TreeVerifyTables.c4_branch`, block order), whose entries sit at their home slot (the first node
at the closing depth: the slot the page table names) or at a scratch slot (any other closing
node: a slot no page table names). SGLang's indexer scores every block through the page table, so
for a block whose entry is in scratch it scores the home slot's key (a sibling's). Here:

* `scratch_index_pages`: a second page table per row naming the pages of its request's scratch
  region (`start + req * per_request ..`, within two 64-entry pages since per_request <= 64), so
  SGLang's own logits function scores the scratch keys with the row's query;
* `splice_branch_scores`: the row's logits at its scratch blocks' columns replaced by those
  scores (every other column untouched: a row without scratch entries keeps SGLang's logits
  bit for bit);
* `remap_branch_indices`: after SGLang's top-k over the spliced logits, every selected branch
  block's page index replaced by the slot of the row's own entry (home or scratch), so the
  sparse attention reads the entries the indexer scored."""
from __future__ import annotations

import torch

from ..errors import ConfigError

SCRATCH_INDEX_PAGES = 2  # pages of one request's scratch region (per_request <= page)


def scratch_index_pages(req_pool_indices_repeated: torch.Tensor, scratch_start: int, per_request: int,
                        last_slot: int, page: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (page_table [T, max(width, 2)] int32, lens [T] int32): row t's pages are the pages of
    its request's scratch slots `scratch_start + req * per_request ..` (column c of the scores
    is slot `page_table[t, 0] * page + c`), the second clamped to the last page holding a scratch
    slot (`last_slot`), the remaining columns repeat the first page (past `lens`, never scored
    into the result). `width`: SGLang's indexer page-table width (same score shapes)."""
    if per_request > page:
        raise ConfigError(f"dsv4_tree tree indexer: {per_request} scratch slots per request span more than "
                          f"{SCRATCH_INDEX_PAGES} C4 index pages of {page} (per_request must be <= {page})")
    first = (scratch_start + req_pool_indices_repeated.to(torch.int64) * per_request) // page
    second = torch.clamp(first + 1, max=last_slot // page)
    cols = max(width, SCRATCH_INDEX_PAGES)
    table = first.view(-1, 1).expand(-1, cols).clone()
    table[:, 1] = second
    lens = torch.full_like(first, SCRATCH_INDEX_PAGES * page)
    return table.to(torch.int32), lens.to(torch.int32)


def _branch_count(c4_branch: torch.Tensor) -> torch.Tensor:
    return (c4_branch >= 0).sum(dim=1, keepdim=True)  # valid entries come first (block order)


def splice_branch_scores(logits: torch.Tensor, scratch_logits: torch.Tensor, c4_branch: torch.Tensor,
                         c4_committed: torch.Tensor, scratch_page_table: torch.Tensor, scratch_start: int,
                         page: int) -> torch.Tensor:
    """logits [R, C] (SGLang's, column b = block b), scratch_logits [R, 2 * page] (the rows'
    scores of their scratch pages), c4_branch [R, B], c4_committed [R], scratch_page_table [R, *]
    -> logits with column committed + j replaced by the score of slot c4_branch[:, j] wherever
    that slot is in scratch (in place, returned)."""
    r, c = logits.shape
    b = c4_branch.shape[1]
    count = _branch_count(c4_branch)
    # Columns of every row's branch blocks; j past the row's count repeats its last valid j (or
    # j = 0), so a duplicated column always receives the same value.
    j = torch.minimum(torch.arange(b, device=logits.device).view(1, b), (count - 1).clamp_min(0))
    cols = (c4_committed.to(torch.int64).view(r, 1) + j).clamp(max=c - 1)
    slot = c4_branch.gather(1, j)
    in_scratch = slot >= scratch_start
    base = scratch_page_table[:, :1].to(torch.int64) * page
    scol = (slot - base).clamp(0, scratch_logits.shape[1] - 1)
    vals = torch.where(in_scratch, scratch_logits.gather(1, scol).to(logits.dtype), logits.gather(1, cols))
    return logits.scatter_(1, cols, vals)


def remap_branch_indices(page_indices: torch.Tensor, raw_indices: torch.Tensor, c4_branch: torch.Tensor,
                         c4_committed: torch.Tensor) -> torch.Tensor:
    """page_indices / raw_indices [R, K] (SGLang's top-k: slots through the page table, and block
    positions, -1 unselected) -> page_indices with every selected branch block (raw >= committed)
    at its own entry's slot c4_branch[:, raw - committed] (a new tensor, page_indices' dtype)."""
    b = c4_branch.shape[1]
    rel = raw_indices.to(torch.int64) - c4_committed.to(torch.int64).view(-1, 1)
    branch = (raw_indices >= 0) & (rel >= 0) & (rel < _branch_count(c4_branch))
    slot = c4_branch.gather(1, rel.clamp(0, b - 1))
    return torch.where(branch, slot.to(page_indices.dtype), page_indices)
