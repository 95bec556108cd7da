"""Verify tables built on the device: pure tensor functions from SGLang-form inputs.

Inputs, on one device, named as SGLang names them: the page tables (`TokenPages`: req_to_token
and full_to_swa in page form), `req_pool_indices` [B], `seq_lens` [B] (P), `out_cache_loc` [T]
(token slot of each row: position P + node, SGLang's tree convention) and the packed trees:
`input_ids` [T], `parents` [T] (local node ids, -1 at roots and padding), the request of each
row [T] (-1 = padding row) and each row's node id [T]. Static shapes only (B, T, N = nodes per
request, C per ratio = committed-entry width): no host read, no shape that depends on values,
so the number of ops is the same whatever the context or the batch, and the build can be
captured in one CUDA graph with the forward.

What is never built: a row's list of committed entries. Committed C4 / C128 entries are a
per-request page-table form (`entry_pages` [B, C / epp] + `entry_len` [B]); the indexer scores them
once per request (attention/indexer.py), C128's attention reads them once per group of rows,
and each row adds its own branch entries [T, Kb] (tests/test_step_memory.py: no rows x context
tensor in the build or the forward).
The host builder this must equal bit for bit is reference/tables.py."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from .pools import Layout


@dataclass(frozen=True)
class TokenPages:
    """Page-form address tables (a position's offset in its page is its slot's offset)."""

    page_table: torch.Tensor  # [rows, pages] token page of (request row, page index), -1 unmapped
    swa_pages: torch.Tensor  # [token pages] SWA (recent) page of each token page, -1 none
    page_size: int

    @classmethod
    def from_sglang(cls, req_to_token: torch.Tensor, full_to_swa_mapping: torch.Tensor, page_size: int):
        """From SGLang's per-position req_to_token [rows, positions] and per-slot
        full_to_swa_mapping [slots] (pages aligned: slot % page_size == position % page_size)."""
        first, swa = req_to_token[:, ::page_size], full_to_swa_mapping[::page_size]
        return cls(torch.where(first >= 0, first // page_size, -1), torch.where(swa >= 0, swa // page_size, -1),
                   page_size)

    def token_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token slots of positions (broadcast with rows); -1 where position < 0 or unmapped."""
        ps = self.page_size
        pos = positions.clamp(min=0)
        page = self.page_table[rows, (pos // ps).clamp(max=self.page_table.shape[1] - 1)].long()
        return torch.where((positions >= 0) & (page >= 0), page * ps + pos % ps, -1)

    def swa_slots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """SWA (recent) slot of each token slot; -1 where none."""
        ps = self.page_size
        s = token_slots.clamp(min=0)
        page = self.swa_pages[s // ps].long()
        return torch.where((token_slots >= 0) & (page >= 0), page * ps + s % ps, -1)


@dataclass(frozen=True)
class RowGroups:
    """Which rows belong to which request (the indexer shares one pass over a request's keys)."""

    row_req: torch.Tensor  # [T] request index b of each row, -1 = padding row
    row_slot: torch.Tensor  # [T] b * N + node: the row's place in a [B, N] grid (0 for padding)
    req_rows: torch.Tensor  # [B, N] packed row of node i of request b, -1 = none


@dataclass(frozen=True)
class CompressTables:
    """One compression ratio m (shared by every layer and compressor of that ratio). Every row
    is a potential closing row: rows that close no block pool null rows into the trash entry."""

    ratio: int
    closes: torch.Tensor  # [T] bool: the row's position closes a block ((p + 1) % m == 0)
    entry_out: torch.Tensor  # [T] scratch entry slot a closing row's entry goes to (trash otherwise)
    block_start: torch.Tensor  # [T] first position of the closed block (its RoPE position; 0 otherwise)
    src: torch.Tensor  # [T, R] recent slots of the block's source rows (R = 2m with overlap: block
    #                    w-1 then block w; else m), -1 = before position 0 (null row); trash otherwise
    entry_pages: torch.Tensor  # [B, C / epp] entry page of each request's committed entries: entry j
    #                            sits at entry_pages[b, j // epp] * epp + j % epp (entry_slot_of)
    entries_per_page: int  # epp: page_size // m, or 1 when a block spans pages (one entry per page run)
    entry_len: torch.Tensor  # [B] committed entries P // m
    branch: torch.Tensor  # [T, Kb] branch entry slots along path(row) in block order, -1 padding
    branch_len: torch.Tensor  # [T]


@dataclass(frozen=True)
class VerifyPlan:
    """One step's tables (tensors on the model's device) and host bookkeeping. A graphed step's
    plan holds only `staged` (its device inputs) until Engine.run_plan builds the tables inside
    the captured graph (the tensor fields are None until then)."""

    num_rows: int  # T (padding rows included)
    input_ids: torch.Tensor | None  # [T]
    positions: torch.Tensor | None  # [T]
    out_loc: torch.Tensor | None  # [T] recent slots each row's K=V and compressor rows are written to
    swa_index: torch.Tensor | None  # [T, W] recent slots of the row's window, newest first, -1 = none
    swa_len: torch.Tensor | None  # [T]
    compress: dict  # ratio -> CompressTables
    groups: RowGroups | None
    # host bookkeeping, per request (commit and outputs read these; layers never do)
    rows: tuple  # page-table row
    seq_lens: tuple  # P
    offsets: tuple  # first packed row
    num_nodes: tuple  # N
    trees: tuple
    bucket: object = None  # serving/step.py StepShapes when padded to a bucket's static shapes
    staged: torch.Tensor | None = None  # [3B + 2T] int32 device inputs of a graphed step's build

    def to(self, device) -> "VerifyPlan":
        """The plan with every tensor (also inside nested tables) on `device` (the plan itself
        when all already are)."""
        dev = torch.device(device)
        there = lambda t: t.device == dev or (dev.index is None and t.device.type == dev.type)  # noqa: E731

        def move(v):
            if isinstance(v, torch.Tensor):
                return v if there(v) else v.to(dev)
            if isinstance(v, dict):
                moved = {k: move(x) for k, x in v.items()}
                return v if all(moved[k] is v[k] for k in v) else moved
            if is_dataclass(v) and not isinstance(v, type):
                changes = {f.name: move(getattr(v, f.name)) for f in fields(v)}
                changes = {k: x for k, x in changes.items() if x is not getattr(v, k)}
                return replace(v, **changes) if changes else v
            return v

        return move(self)


def ancestors(parents: torch.Tensor, width: int) -> torch.Tensor:
    """parents [T] (packed row ids, -1 at roots) -> [T, width]: column k = k-th ancestor (k = 0:
    the row itself), -1 above the root. Doubling: columns [h, 2h) are the h-th ancestor's [0, h)."""
    t = parents.shape[0]
    anc = torch.arange(t, device=parents.device).unsqueeze(1)
    while anc.shape[1] < width:
        have = anc.shape[1]
        last = anc[:, -1]
        hop = torch.where(last >= 0, parents[last.clamp(min=0)], -1)  # the have-th ancestor
        block = anc[hop.clamp(min=0), : min(have, width - have)]
        anc = torch.cat([anc, torch.where(hop.unsqueeze(1) >= 0, block, -1)], 1)
    return anc


@dataclass(frozen=True)
class _Rows:
    valid: torch.Tensor  # [T] bool
    req: torch.Tensor  # [T] request index (0 for padding)
    row: torch.Tensor  # [T] page-table row
    node: torch.Tensor  # [T]
    seq_len: torch.Tensor  # [T] P of the row's request (0 for padding)
    pos: torch.Tensor  # [T]
    anc: torch.Tensor  # [T, N]
    recent: torch.Tensor  # [T] recent slot of each row's token slot (trash for padding)


def path_slots(anc: torch.Tensor, pos: torch.Tensor, seq_len: torch.Tensor, node_slot: torch.Tensor,
               committed: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Slots of absolute positions q [T, k] as row t sees them (its own path): q >= P from the
    row's ancestor at that depth (node_slot [T] of the packed rows, anc [T, >= depth + 1]),
    q < P from committed [T, k] (the caller's lookup of the committed slots); -1 where q < 0.
    The one rule of both SWA windows (SGLang's `swa_page_indices` form and the engine's) and of
    the compressor's source rows."""
    dist = (pos.unsqueeze(1) - q).clamp(min=0, max=anc.shape[1] - 1)
    drafted = node_slot[anc.gather(1, dist).clamp(min=0)]
    out = torch.where(q >= seq_len.unsqueeze(1), drafted, committed)
    return torch.where(q >= 0, out, -1)


def branch_entries(anc: torch.Tensor, pos: torch.Tensor, seq_len: torch.Tensor, valid: torch.Tensor,
                   node_entry: torch.Tensor, m: int) -> tuple:
    """-> (branch [T, Kb], count [T]), Kb = (N - 1) // m + 1 (N = anc's width): the entries of
    the blocks closed on row t's own path in this verify (closing positions >= P), block order,
    as node_entry [T] (the entry slot each packed row writes) of their closing ancestors; -1
    past count. The C4 indexer's branch candidates, the tail of C128's per-row entry list."""
    first_close = seq_len + (m - 1 - seq_len) % m
    count = torch.where(valid & (pos >= first_close), (pos - first_close) // m + 1, 0)
    kb = (anc.shape[1] - 1) // m + 1
    v = torch.arange(kb, device=pos.device)
    dist = ((pos - first_close).unsqueeze(1) - v * m).clamp(min=0, max=anc.shape[1] - 1)
    owner = anc.gather(1, dist)
    return torch.where(v < count.unsqueeze(1), node_entry[owner.clamp(min=0)], -1), count


def append_branch(committed: torch.Tensor, n_committed: torch.Tensor, branch: torch.Tensor,
                  n_branch: torch.Tensor) -> torch.Tensor:
    """committed [T, K] (column j: committed entry j), n_committed [T], branch [T, Kb], n_branch
    [T] -> [T, K] (committed's dtype): the row's committed entries, then its branch entries, -1
    after (SGLang's `c128_page_indices` form: a row's whole entry list in block order)."""
    t, k = committed.shape
    j = torch.arange(k, device=committed.device).view(1, k)
    rel = j - n_committed.to(torch.int64).view(t, 1)
    own = branch.gather(1, rel.clamp(0, branch.shape[1] - 1)).to(committed.dtype)
    tail = torch.where((rel >= 0) & (rel < n_branch.to(torch.int64).view(t, 1)), own, -1)
    return torch.where(rel < 0, committed, tail)


def _source_slots(r: _Rows, pages: TokenPages, q: torch.Tensor) -> torch.Tensor:
    """Recent slots of absolute positions q [T, k] seen from each row (its ancestors for q >= P)."""
    committed = pages.swa_slots(pages.token_slots(r.row.unsqueeze(1), q))
    return path_slots(r.anc, r.pos, r.seq_len, r.recent, committed, q)


def committed_entry_pages(pages: TokenPages, layout: Layout, req_pool_indices: torch.Tensor, m: int,
                          width: int) -> tuple:
    """-> (entry_pages [B, ceil(width / epp)], epp): committed entry j of request b has the entry
    slot entry_pages[b, j // epp] * epp + j % epp (Layout.entry_slot of its block's first token
    slot). A page holds epp = page_size / m consecutive entries; when m > page_size each entry
    starts its own run of m / page_size pages (epp = 1). O(B x pages): no per-entry work."""
    ps, table = pages.page_size, pages.page_table
    last, dev = table.shape[1] - 1, req_pool_indices.device
    epp = layout.entries_per_page(m)
    stride = 1 if m <= ps else m // ps
    cols = (torch.arange(-(-width // epp), device=dev) * stride).clamp(max=last)
    return table[req_pool_indices.unsqueeze(1), cols], epp


def entry_slot_of(ct: "CompressTables", req: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Entry slot of committed entry j of request req (broadcast; j < the page form's width)."""
    epp = ct.entries_per_page
    return ct.entry_pages[req, j // epp].long() * epp + j % epp


def _compress(r: _Rows, pages: TokenPages, layout: Layout, req_pool_indices, seq_lens, m: int, overlap: bool,
              width: int) -> CompressTables:
    dev = r.pos.device
    closes = r.valid & ((r.pos + 1) % m == 0)
    block = (r.pos + 1) // m - 1
    first = (block - 1) * m if overlap else block * m
    src = _source_slots(r, pages, first.unsqueeze(1) + torch.arange(2 * m if overlap else m, device=dev))
    src = torch.where(closes.unsqueeze(1), src, layout.trash_recent_slot)
    scratch = layout.scratch_slot(m, r.row, r.node)  # [T]
    entry_out = torch.where(closes, scratch, layout.trash_entry_slot(m))
    # committed entries, per request: entry j pools the block starting at position j * m
    n_e = seq_lens // m  # [B]
    entry_pages, epp = committed_entry_pages(pages, layout, req_pool_indices, m, width)
    # branch entries, per row: closed on its path at positions first_close, first_close + m, ...
    branch, n_vis = branch_entries(r.anc, r.pos, r.seq_len, r.valid, scratch, m)
    return CompressTables(m, closes, entry_out, torch.where(closes, block * m, 0), src, entry_pages, epp, n_e,
                          branch, n_vis)


def build_tables(pages: TokenPages, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 out_cache_loc: torch.Tensor, input_ids: torch.Tensor, parents: torch.Tensor,
                 row_req: torch.Tensor, row_node: torch.Tensor, layout: Layout, num_nodes: int,
                 widths: dict) -> dict:
    """Every table of one verify step. req_pool_indices, seq_lens [B]; out_cache_loc, input_ids,
    parents, row_req, row_node [T] (int, one device); num_nodes: N >= every tree's size;
    widths: ratio -> C >= max P // ratio (>= 1). Rows of one request are contiguous, root
    first. Returns the VerifyPlan tensor fields (a dict: the host bookkeeping is the caller's)."""
    dev, t, n = parents.device, parents.shape[0], num_nodes
    b = req_pool_indices.shape[0]
    req_pool_indices, seq_lens = req_pool_indices.long(), seq_lens.long()
    row_req, row_node, parents = row_req.long(), row_node.long(), parents.long()
    valid = row_req >= 0
    req = row_req.clamp(min=0)
    start = torch.arange(t, device=dev) - row_node  # packed row of the row's root
    anc = ancestors(torch.where(parents >= 0, start + parents, -1), n)
    depth = (anc >= 0).sum(1) - 1
    p = torch.where(valid, seq_lens[req], 0)
    pos = torch.where(valid, p + depth, 0)
    row = req_pool_indices[req]
    recent = torch.where(valid, pages.swa_slots(out_cache_loc.long()), layout.trash_recent_slot)
    r = _Rows(valid, req, row, row_node, p, pos, anc, recent)
    w = layout.window
    swa = _source_slots(r, pages, pos.unsqueeze(1) - torch.arange(w, device=dev))  # newest first
    slot = torch.where(valid, req * n + row_node, 0)
    grid = torch.full((b * n + 1,), -1, dtype=torch.int64, device=dev)
    grid = grid.index_put((torch.where(valid, slot, b * n),), torch.arange(t, device=dev))[:-1]
    compress = {m: _compress(r, pages, layout, req_pool_indices, seq_lens, m, ov, widths[m])
                for m, ov in sorted(layout.ratios.items())}
    return dict(num_rows=t, input_ids=torch.where(valid, input_ids.long(), 0), positions=pos, out_loc=recent,
                swa_index=swa, swa_len=torch.where(valid, (pos + 1).clamp(max=w), 0), compress=compress,
                groups=RowGroups(row_req, slot, grid.view(b, n)))


def draft_cache_loc(pages: TokenPages, req_pool_indices, seq_lens, row_req, row_node) -> torch.Tensor:
    """out_cache_loc [T] of a tree verify: node i of request b at req_to_token[row_b, P_b + i]
    (SGLang's tree convention); -1 for padding rows."""
    req = row_req.long().clamp(min=0)
    loc = pages.token_slots(req_pool_indices.long()[req], seq_lens.long()[req] + row_node.long())
    return torch.where(row_req >= 0, loc, -1)
