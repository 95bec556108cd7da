"""Draft-decode tables for EAGLE topk > 1 in SGLang's vocabulary: pure tensor functions of
SGLang 0.5.23's own inputs (`req_to_token`, `full_to_swa_index_mapping`, `req_pool_indices`,
`seq_lens` = P committed, the multi-step draft `out_cache_loc`), no SGLang import, no host reads
of device values, no loop over requests or branches.

SGLang's multi-step draft writes `bs x topk` rows per step, row `b * topk + t` (branch t of
request b), and lays the write slots out as `out_cache_loc.view(bs, topk, num_steps)`
(`per_step_draft_out_cache_loc`). For page size > 1 those are per-branch page-aligned regions
(`prepare_for_draft`), but the tables here read the slots from `out_cache_loc` itself, so they
hold for any layout SGLang gives.

At step i, row (b, t) is a chain: the committed prefix (positions 0 .. P-1, slots
`req_to_token[req, p]`) followed by the branch's own draft slots of steps 0 .. i (positions
P .. P+i, slots `out_cache_loc[b, t, 0..i]`), which is what SGLang's paged draft-decode reader
(`generate_draft_decode_kv_indices`) gives each branch. Its length is P + i + 1, its position
P + i. The DeepSeek-V4 MTP layer has compress ratio 0: it reads only the SWA window (the newest
`swa_window` of those positions)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftStepTables:
    """Per-row tables of one draft step (R = bs * topk rows, row b * topk + t)."""
    seq_lens_casual: torch.Tensor  # [R] int32, P + step + 1
    positions_casual: torch.Tensor  # [R] int32, P + step
    req_pool_indices_repeated: torch.Tensor  # [R] int32
    swa_page_indices: torch.Tensor  # [R, swa_window padded to the alignment] int32, newest first, -1 empty
    swa_topk_lengths: torch.Tensor  # [R] int32, min(length, swa_window)
    page_table: torch.Tensor  # [R, ceil(max_seq_len / page_size)] int32, page of each page's first position
    raw_out_loc: torch.Tensor  # [R] the step's write slot per row (out_cache_loc's dtype, as SGLang passes it)

    def __post_init__(self):
        r = self.seq_lens_casual.shape[0]
        for name in ("positions_casual", "req_pool_indices_repeated", "swa_topk_lengths", "raw_out_loc"):
            if getattr(self, name).shape != (r,):
                raise ValueError(f"DraftStepTables.{name}: shape {tuple(getattr(self, name).shape)}, want ({r},)")
        for name in ("swa_page_indices", "page_table"):
            if getattr(self, name).dim() != 2 or getattr(self, name).shape[0] != r:
                raise ValueError(f"DraftStepTables.{name}: shape {tuple(getattr(self, name).shape)}, want ({r}, *)")


def draft_branch_slots(out_cache_loc: torch.Tensor, bs: int, topk: int, num_steps: int, step: int) -> torch.Tensor:
    """SGLang's multi-step draft `out_cache_loc` [bs * topk * num_steps] -> [bs * topk, step + 1]
    (its dtype): row b * topk + t's write slots of steps 0 .. step."""
    return out_cache_loc.view(bs, topk, num_steps)[:, :, :step + 1].reshape(bs * topk, step + 1)


def draft_swa_page_indices(req_to_token: torch.Tensor, full_to_swa_index_mapping: torch.Tensor,
                           rows: torch.Tensor, seq_lens: torch.Tensor, own: torch.Tensor, swa_window: int,
                           page_index_aligned_size: int) -> torch.Tensor:
    """-> [R, W padded] int32: column j is the SWA slot of position P + step - j (newest first):
    the row's own draft slot `own[:, step - j]` for j <= step, the committed `req_to_token[req,
    P + step - j]` after, -1 below position 0 (SGLang's `build_causal_swa_page_indices` format:
    the -1 goes through the mapping's trailing -1 sentinel, then padding with -1)."""
    r, steps = own.shape
    step = steps - 1
    j = torch.arange(swa_window, device=own.device).view(1, swa_window)
    back = step - j  # [1, W]: own column, or (negative) how far into the prefix
    pos = seq_lens.to(torch.int64).view(r, 1) + back  # [R, W] position of column j
    last = (seq_lens.to(torch.int64).view(r, 1) - 1).clamp_min(0)  # prefix reads stay inside 0 .. P-1
    prefix = req_to_token[rows.to(torch.int64).view(r, 1), torch.minimum(pos, last).clamp_min(0)].to(torch.int64)
    mine = own.to(torch.int64).gather(1, back.clamp(0, step).expand(r, swa_window))
    raw = torch.where(back >= 0, mine, prefix)
    raw = torch.where(pos >= 0, raw, torch.full_like(raw, -1))
    swa = full_to_swa_index_mapping[raw].to(torch.int32)
    width = -(-swa_window // page_index_aligned_size) * page_index_aligned_size
    return torch.nn.functional.pad(swa, (0, width - swa_window), value=-1)


def draft_page_table(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, own: torch.Tensor,
                     max_seq_len: int, page_size: int) -> torch.Tensor:
    """-> [R, ceil(max_seq_len / page_size)] int32: SGLang's `req_to_token[req, k * page] // page`
    for pages starting in the prefix (or past the row), the page of the row's own slot at
    position k * page for pages starting in its draft positions P .. P + step."""
    r, steps = own.shape
    base = (req_to_token[rows.to(torch.int64), :max_seq_len:page_size] // page_size).to(torch.int32)
    k = base.shape[1]
    d = torch.arange(k, device=own.device).view(1, k) * page_size - seq_lens.to(torch.int64).view(r, 1)
    mine = (own.to(torch.int64).gather(1, d.clamp(0, steps - 1)) // page_size).to(torch.int32)
    return torch.where((d >= 0) & (d < steps), mine, base)


def build_draft_step_tables(*, req_to_token: torch.Tensor, full_to_swa_index_mapping: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                            topk: int, num_steps: int, step: int, swa_window: int, page_size: int,
                            max_seq_len: int, page_index_aligned_size: int = 64) -> DraftStepTables:
    """All tables of draft step `step` (0-based, < num_steps) from SGLang's inputs."""
    bs = seq_lens.shape[0]
    own = draft_branch_slots(out_cache_loc, bs, topk, num_steps, step)
    rows = req_pool_indices.to(torch.int32).repeat_interleave(topk)
    prefix = seq_lens.to(torch.int64).repeat_interleave(topk)
    lens = (prefix + step + 1).to(torch.int32)
    return DraftStepTables(
        seq_lens_casual=lens, positions_casual=lens - 1, req_pool_indices_repeated=rows,
        swa_page_indices=draft_swa_page_indices(req_to_token, full_to_swa_index_mapping, rows, prefix, own,
                                                swa_window, page_index_aligned_size),
        swa_topk_lengths=lens.clamp(max=swa_window), page_table=draft_page_table(req_to_token, rows, prefix, own,
                                                                                  max_seq_len, page_size),
        raw_out_loc=own[:, step].contiguous())
