"""Commit by slot moves: fold accepted paths into the pools (data movement only).

Accepted node a at depth d of a request with P committed positions was verified at the slot of
position P + a (SGLang's tree convention) and belongs at the slot of position P + d. Commit
copies its stored rows (raw K=V record, compressor rows) there, and copies the branch entry it
closed (if any) from its scratch slot to the committed entry slot of its block. Nothing is
recomputed; rejected rows are simply never copied (their pages are freed by the caller)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .pages import PageTable
from .pools import LayerPools, Layout


@dataclass(frozen=True)
class SlotMoves:
    """Copies of one commit, for all requests at once (host tensors until applied)."""

    recent_src: torch.Tensor  # [M] recent slots (raw rows and compressor rows move together)
    recent_dst: torch.Tensor  # [M]
    entry_src: dict  # ratio -> [K] scratch entry slots
    entry_dst: dict  # ratio -> [K] committed entry slots

    def to(self, device) -> "SlotMoves":
        return SlotMoves(self.recent_src.to(device), self.recent_dst.to(device),
                         {m: v.to(device) for m, v in self.entry_src.items()},
                         {m: v.to(device) for m, v in self.entry_dst.items()})


def plan_moves(pages: PageTable, layout: Layout, rows, seq_lens, paths) -> SlotMoves:
    """rows / seq_lens / paths per request (path: accepted node ids root first, a tensor)."""
    src, dst = [], []
    ent_src = {m: [] for m in layout.ratios}
    ent_dst = {m: [] for m in layout.ratios}
    for row, p, path in zip(rows, seq_lens, paths):
        depth = torch.arange(path.numel())
        r = torch.full_like(depth, row)
        moved = path != depth
        src.append(pages.recent_slots(pages.token_slots(r[moved], p + path[moved])))
        dst.append(pages.recent_slots(pages.token_slots(r[moved], p + depth[moved])))
        pos = p + depth
        for m in layout.ratios:
            closes = (pos + 1) % m == 0
            block_first = (pos[closes] + 1) - m
            ent_src[m].append(layout.scratch_slot(m, r[closes], path[closes]))
            ent_dst[m].append(layout.entry_slot(m, pages.token_slots(r[closes], block_first)))
    empty = torch.zeros(0, dtype=torch.int64)
    cat = lambda xs: torch.cat(xs) if xs else empty  # noqa: E731
    return SlotMoves(cat(src), cat(dst), {m: cat(v) for m, v in ent_src.items()}, {m: cat(v) for m, v in ent_dst.items()})


@torch.no_grad()
def apply_moves(pools: list, moves: SlotMoves) -> None:
    """Bitwise copies into every layer's pools (gather first, so overlapping moves are safe)."""
    rs, rd = moves.recent_src, moves.recent_dst
    for lp in pools:
        lp: LayerPools
        if rs.numel():
            lp.swa.copy(rs, rd)
            for comp in lp.compressors:
                comp.copy_rows(rs, rd)
        for comp in lp.compressors:
            es, ed = moves.entry_src[comp.ratio], moves.entry_dst[comp.ratio]
            if es.numel():
                comp.entries.copy(es, ed)
