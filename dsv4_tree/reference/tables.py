"""Reference verify tables: the host builder the device build (serving/tables.py) is checked
against, bit for bit. Written for clarity, not speed: it materialises every row's committed
entry list [T, C] (one page lookup per entry per row), which the device build never does.

Pure functions of host bookkeeping (trees, P per request, the host PageTable) -> int64 tensors;
no Python loop over requests or nodes (trees are packed into T rows with global parent ids).
Conventions (SGLang's EAGLE tree verify): draft node i of a request
with P committed positions has its token slot at position P + i of the request's page table;
its own position is P + depth(i)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..serving.pages import PageTable
from ..serving.pools import Layout
from ..tree.draft_tree import depth_by_pointer_jumping


@dataclass(frozen=True)
class RefCompressTables:
    """One compression ratio m (shared by every layer and compressor of that ratio)."""

    ratio: int
    closing: torch.Tensor  # [E] packed rows whose position closes a block ((p + 1) % m == 0)
    entry_out: torch.Tensor  # [E] scratch entry slots their entries are written to
    block_start: torch.Tensor  # [E] first position of each closed block (the entry's RoPE position)
    src: torch.Tensor  # [E, R] recent slots of the block's source rows (R = 2m with overlap: block
    #                    w-1 then block w; else m), -1 = before position 0 (null row)
    entries: torch.Tensor  # [T, C] entry slots a row may read, block order: committed, then the
    #                        branch entries of path(row); -1 padding. The indexer's candidates.
    entry_len: torch.Tensor  # [T]


@dataclass(frozen=True)
class RefTables:
    num_rows: int  # T
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_loc: torch.Tensor  # [T] recent slots each row's K=V and compressor rows are written to
    swa_index: torch.Tensor  # [T, W] recent slots of the row's window, newest first, -1 = none
    swa_len: torch.Tensor  # [T]
    compress: dict  # ratio -> CompressTables
    # host bookkeeping, per request (commit and outputs read these; layers never do)
    rows: tuple  # page-table row
    seq_lens: tuple  # P
    offsets: tuple  # first packed row
    num_nodes: tuple  # N
    trees: tuple


def ancestor_table(parents: torch.Tensor, width: int) -> torch.Tensor:
    """anc[t, k] = k-th ancestor of packed row t (k = 0: itself), -1 above the root. [T, width]
    Doubling: columns [h, 2h) of row t are columns [0, h) of its h-th ancestor."""
    t = parents.shape[0]
    anc = torch.full((t, width), -1, dtype=torch.int64)
    anc[:, 0] = torch.arange(t)
    have = 1
    while have < width:
        last = anc[:, have - 1]
        hth = torch.where(last >= 0, parents[last.clamp(min=0)], torch.full_like(last, -1))
        take = min(have, width - have)
        block = anc[hth.clamp(min=0), :take]
        anc[:, have : have + take] = torch.where(hth.unsqueeze(1) >= 0, block, torch.full_like(block, -1))
        have += take
    return anc


@dataclass(frozen=True)
class _Rows:
    """Packed per-row host facts the tables are built from."""

    row: torch.Tensor  # [T] page-table row
    node: torch.Tensor  # [T] local node id
    seq_len: torch.Tensor  # [T] P of the row's request
    pos: torch.Tensor  # [T]
    anc: torch.Tensor  # [T, Dmax + 1]
    recent: torch.Tensor  # [T] recent slot of each node's token slot


def _source_slots(rows: _Rows, pages: PageTable, t_idx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Recent slots of absolute positions q [.., k] seen from rows t_idx [..] (ancestors for q >= P)."""
    pos = rows.pos[t_idx].unsqueeze(-1)
    p = rows.seq_len[t_idx].unsqueeze(-1)
    dist = (pos - q).clamp(min=0, max=rows.anc.shape[1] - 1)
    anc = torch.gather(rows.anc[t_idx], -1, dist)
    drafted = rows.recent[anc.clamp(min=0)]
    committed = pages.recent_slots(pages.token_slots(rows.row[t_idx].unsqueeze(-1).expand_as(q), q))
    out = torch.where(q >= p, drafted, committed)
    return torch.where(q >= 0, out, torch.full_like(out, -1))


def _compress_tables(rows: _Rows, pages: PageTable, layout: Layout, ratio: int, overlap: bool) -> RefCompressTables:
    m, t = ratio, rows.pos.shape[0]
    closing = ((rows.pos + 1) % m == 0).nonzero().flatten()
    block = (rows.pos[closing] + 1) // m - 1
    width = 2 * m if overlap else m
    if closing.numel():
        first = (block - 1) * m if overlap else block * m
        src = _source_slots(rows, pages, closing, first.unsqueeze(1) + torch.arange(width))
    else:  # no row closes a block (most decode steps): nothing to gather
        src = torch.empty((0, width), dtype=torch.int64)
    scratch = layout.scratch_slot(m, rows.row, rows.node)  # [T] (used for closing rows only)
    # committed entries of each request's row, then this row's branch entries in block order
    n_e = rows.seq_len // m  # [T]
    first_close = rows.seq_len + (m - 1 - rows.seq_len) % m  # first closing position >= P
    n_vis = torch.where(rows.pos >= first_close, (rows.pos - first_close) // m + 1, torch.zeros_like(n_e))
    c = int((n_e + n_vis).max()) if t else 0
    j = torch.arange(c).unsqueeze(0)
    k = j.clamp(max=max(0, int(n_e.max()) - 1)) if t else j
    committed = layout.entry_slot(m, pages.token_slots(rows.row.unsqueeze(1).expand(-1, c), k * m))
    v = j - n_e.unsqueeze(1)
    dist = (rows.pos - first_close).unsqueeze(1) - v * m
    g = torch.gather(rows.anc, 1, dist.clamp(min=0, max=rows.anc.shape[1] - 1))
    branch = scratch[g.clamp(min=0)]
    entries = torch.where(j < n_e.unsqueeze(1), committed, torch.where(v < n_vis.unsqueeze(1), branch, -1))
    return RefCompressTables(m, closing, scratch[closing], block * m, src, entries, n_e + n_vis)


def ref_build_tables(trees, seq_lens, req_rows, pages: PageTable, layout: Layout) -> RefTables:
    """Tables of one verify step. trees: DraftTree per request; seq_lens: P per request;
    req_rows: page-table row per request (pages for positions < P + N must be mapped)."""
    sizes = [t.num_nodes for t in trees]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    counts = torch.tensor(sizes)
    req = torch.repeat_interleave(torch.arange(len(trees)), counts)
    start = torch.tensor(offsets)[req]
    node = torch.arange(req.shape[0]) - start
    local_parents = torch.cat([t.parents for t in trees])
    parents = torch.where(local_parents >= 0, local_parents + start, torch.full_like(local_parents, -1))
    depth = depth_by_pointer_jumping(parents)
    seq_len = torch.tensor(seq_lens, dtype=torch.int64)[req]
    row = torch.tensor(req_rows, dtype=torch.int64)[req]
    pos = seq_len + depth
    width = int(depth.max()) + 1
    token = pages.token_slots(row, seq_len + node)
    rows = _Rows(row, node, seq_len, pos, ancestor_table(parents, width), pages.recent_slots(token))
    w = layout.window
    q = pos.unsqueeze(1) - torch.arange(w)  # newest first
    swa = _source_slots(rows, pages, torch.arange(pos.shape[0]), q)
    compress = {m: _compress_tables(rows, pages, layout, m, ov) for m, ov in sorted(layout.ratios.items())}
    return RefTables(
        num_rows=pos.shape[0],
        input_ids=torch.cat([t.tokens for t in trees]),
        positions=pos,
        out_loc=rows.recent,
        swa_index=swa,
        swa_len=torch.clamp(pos + 1, max=w),
        compress=compress,
        rows=tuple(int(r) for r in req_rows),
        seq_lens=tuple(int(p) for p in seq_lens),
        offsets=tuple(offsets),
        num_nodes=tuple(sizes),
        trees=tuple(trees),
    )
