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
    # int64 index tensors the caller needs on the device with the moves (the engine's rows of
    # the accepted nodes); they travel in the same copy
    carried: tuple = ()

    def to(self, device) -> "SlotMoves":
        """All moves (and the carried tensors) on `device` through one host-to-device copy of
        one packed buffer."""
        ratios = sorted(self.entry_src)
        parts = [self.recent_src, self.recent_dst] + [x for m in ratios for x in (self.entry_src[m], self.entry_dst[m])]
        parts += list(self.carried)
        flat = torch.cat(parts).to(device, non_blocking=True).split([p.numel() for p in parts])
        k = 2 + 2 * len(ratios)
        return SlotMoves(flat[0], flat[1], {m: flat[2 + 2 * i] for i, m in enumerate(ratios)},
                         {m: flat[3 + 2 * i] for i, m in enumerate(ratios)}, tuple(flat[k:]))


def _nodes(path) -> list:
    """A path's node ids as host ints (a tensor or a sequence of ints)."""
    return path.tolist() if isinstance(path, torch.Tensor) else list(path)


def plan_moves(pages: PageTable, layout: Layout, rows, seq_lens, paths, carry=()) -> SlotMoves:
    """rows / seq_lens / paths per request (path: accepted node ids root first, a tensor or a
    sequence of ints); carry: int64 host tensors to bring to the device with the moves.

    Which rows move and which blocks close is host arithmetic on a few ints per request; the
    slot lookups then run once for the whole batch (none when nothing moves or closes, as in
    most plain decode steps)."""
    mv_rows, mv_src, mv_dst = [], [], []
    closed = {m: ([], [], []) for m in layout.ratios}  # request row, node, first position of the block
    for row, p, path in zip(rows, seq_lens, paths):
        for d, node in enumerate(_nodes(path)):
            if node != d:
                mv_rows.append(row)
                mv_src.append(p + node)
                mv_dst.append(p + d)
            for m, (c_rows, c_nodes, c_first) in closed.items():
                if (p + d + 1) % m == 0:
                    c_rows.append(row)
                    c_nodes.append(node)
                    c_first.append(p + d + 1 - m)
    empty = torch.zeros(0, dtype=torch.int64)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

    def recent(rws, pos):
        return pages.recent_slots(pages.token_slots(ints(rws), ints(pos))) if rws else empty

    ent_src, ent_dst = {}, {}
    for m, (c_rows, c_nodes, c_first) in closed.items():
        ent_src[m] = layout.scratch_slot(m, ints(c_rows), ints(c_nodes)) if c_rows else empty
        ent_dst[m] = layout.entry_slot(m, pages.token_slots(ints(c_rows), ints(c_first))) if c_rows else empty
    return SlotMoves(recent(mv_rows, mv_src), recent(mv_rows, mv_dst), ent_src, ent_dst, tuple(carry))


@torch.inference_mode()
def apply_moves(pools: list, moves: SlotMoves, before_write=None) -> None:
    """Bitwise copies into every layer's pools (gather first, so overlapping moves are safe).
    before_write(): called once before the first copy. From then on the draft rows may be
    moved over (a move's destination can be another's source), so a commit that fails part-way
    cannot be retried from them: the engine marks the verify output spent there."""
    if before_write is not None:
        before_write()
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
