"""Page tables: which slots hold each request's positions (host bookkeeping, int tensors).

Two address spaces, both paged with the same `page_size`, SGLang-aligned (a position's offset
in its page equals its slot's offset in the page):
  token slots  : req_to_page[row, pos // page_size] * page_size + pos % page_size. Every
                 position of a live request has one; compressed entries are addressed from
                 them (serving/pools.py: entry_slot).
  recent slots : the smaller pool of raw K=V rows and compressor rows (SGLang's SWA pool),
                 full_to_recent[token page] * page_size + offset; only pages that a future row
                 can still read (positions >= P - recent_window) keep one.
Nothing here touches a device. Every mapping `ensure` makes is also recorded (`take_updates`)
so the next verify step carries it to the device copy of these tables (serving/step.py);
serving/tables.py builds the per-row index tensors there."""
from __future__ import annotations

import torch

from ..errors import StateError
from .allocator import PageAllocator


class PageTable:
    def __init__(self, max_requests: int, max_slots: int, page_size: int, num_token_pages: int,
                 num_recent_pages: int):
        self.page_size = page_size
        self.max_requests = max_requests
        self.pages_per_request = -(-max_slots // page_size)  # slots a row may address
        self.req_to_page = torch.full((max_requests, self.pages_per_request), -1, dtype=torch.int64)
        self.full_to_recent = torch.full((num_token_pages,), -1, dtype=torch.int64)
        self.tokens = PageAllocator("token", num_token_pages, page_size)
        self.recent = PageAllocator("recent (sliding-window + compressor rows)", num_recent_pages, page_size)
        self._rows = list(range(max_requests - 1, -1, -1))
        self.mapped = [0] * max_requests  # token pages mapped per row
        self.evicted = [0] * max_requests  # leading token pages whose recent page was freed
        self._new_cells: dict = {}  # row * pages_per_request + page index -> token page, since take_updates
        self._new_recent: dict = {}  # token page -> recent page (-1: none), since take_updates

    # ------------------------------------------------------------------ requests
    def admit(self) -> int:
        if not self._rows:
            raise StateError(f"request table full: {self.max_requests} live requests (SpecConfig.max_requests)")
        return self._rows.pop()

    def is_admitted(self, row: int) -> bool:
        """Row was handed out by admit() and not released since."""
        return 0 <= row < self.max_requests and row not in self._rows

    @property
    def free_rows(self) -> int:
        return len(self._rows)

    def release(self, row: int) -> None:
        self.shrink([row], [0])
        self.evicted[row] = 0
        self._rows.append(row)

    # ------------------------------------------------------------------ growth
    def ensure(self, rows, lengths, recent_from=None) -> None:
        """Map token pages so positions < lengths[i] of rows[i] have slots, and give every new
        page that reaches position recent_from[i] or later a recent page; all or nothing."""
        ps = self.page_size
        recent_from = [0] * len(rows) if recent_from is None else list(recent_from)
        plan = []
        for r, n, start in zip(rows, lengths, recent_from):
            pages = -(-n // ps)
            if pages > self.pages_per_request:
                raise StateError(f"slot {n - 1} is past the page table ({self.pages_per_request} pages of {ps})")
            new = range(self.mapped[r], pages)
            plan.append((r, new, [k for k in new if (k + 1) * ps > start]))
        self.tokens.check(sum(len(new) for _, new, _ in plan))
        self.recent.check(sum(len(rec) for _, _, rec in plan))
        for r, new, with_recent in plan:
            if not new:
                continue
            pages_list = self.tokens.alloc(len(new))
            tok = torch.tensor(pages_list, dtype=torch.int64)
            self.req_to_page[r, new.start : new.stop] = tok
            base = r * self.pages_per_request
            self._new_cells.update(zip(range(base + new.start, base + new.stop), pages_list))
            self._new_recent.update(zip(pages_list[: len(new) - len(with_recent)], [-1] * (len(new) - len(with_recent))))
            if with_recent:
                ks = torch.tensor(with_recent) - new.start
                rec = self.recent.alloc(len(with_recent))
                self.full_to_recent[tok[ks]] = torch.tensor(rec, dtype=torch.int64)
                self._new_recent.update(zip(pages_list[len(new) - len(with_recent):], rec))
            if self.evicted[r] == new.start:  # leading pages that never got a recent page
                self.evicted[r] = with_recent[0] if with_recent else new.stop
            self.mapped[r] = new.stop

    def backs(self, row: int, length: int, recent_from: int) -> bool:
        """Row maps a token page for every position < length, and a recent page for every one
        of those at or past recent_from: what a request with `length` committed positions reads."""
        ps = self.page_size
        pages = -(-length // ps)
        if self.mapped[row] < pages:
            return False
        first = max(0, recent_from) // ps
        return first >= pages or bool((self.full_to_recent[self.req_to_page[row, first:pages]] >= 0).all())

    def take_updates(self) -> tuple:
        """The mappings made since the last call, as four int lists: page-table cells
        (row * pages_per_request + page index) and their token pages, token pages and their
        recent pages (-1 = none). Each cell and token page appears once (its latest value)."""
        cells, recent = self._new_cells, self._new_recent
        self._new_cells, self._new_recent = {}, {}
        return list(cells), list(cells.values()), list(recent), list(recent.values())

    def put_back(self, taken: tuple) -> None:
        """Undo a take_updates whose mappings never reached the device (the step that took them
        raised): they are taken again with the next step's, under any newer value of a cell."""
        cells, pages, tok, rec = taken
        merged_cells, merged_recent = dict(zip(cells, pages)), dict(zip(tok, rec))
        merged_cells.update(self._new_cells)
        merged_recent.update(self._new_recent)
        self._new_cells, self._new_recent = merged_cells, merged_recent

    def shrink(self, rows, lengths) -> None:
        """Free token pages (and their recent pages) wholly at or past lengths[i]."""
        ps = self.page_size
        for r, n in zip(rows, lengths):
            keep = -(-n // ps)
            if keep >= self.mapped[r]:
                continue
            tok = self.req_to_page[r, keep : self.mapped[r]]
            rec = self.full_to_recent[tok]
            self.recent.free(rec[rec >= 0].tolist())
            self.full_to_recent[tok] = -1
            self.tokens.free(tok.tolist())
            self.req_to_page[r, keep : self.mapped[r]] = -1
            self.mapped[r] = keep
            self.evicted[r] = min(self.evicted[r], keep)

    def evict(self, rows, keep_from) -> None:
        """Free the recent pages of token pages wholly before position keep_from[i]."""
        ps = self.page_size
        for r, start in zip(rows, keep_from):
            upto = min(max(0, start) // ps, self.mapped[r])
            if upto <= self.evicted[r]:
                continue
            tok = self.req_to_page[r, self.evicted[r] : upto]
            rec = self.full_to_recent[tok]
            self.recent.free(rec[rec >= 0].tolist())
            self.full_to_recent[tok] = -1
            self.evicted[r] = upto

    # ------------------------------------------------------------------ lookups (vectorised)
    def token_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token slots of positions (any shape, broadcast with rows); -1 where position < 0."""
        ps = self.page_size
        ok = positions >= 0
        pos = positions.clamp(min=0)
        page = self.req_to_page[rows, pos // ps]
        return torch.where(ok & (page >= 0), page * ps + pos % ps, torch.full_like(pos, -1))

    def recent_slots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """Recent-pool slot of each token slot (-1 where none)."""
        ps = self.page_size
        ok = token_slots >= 0
        s = token_slots.clamp(min=0)
        page = self.full_to_recent[s // ps]
        return torch.where(ok & (page >= 0), page * ps + s % ps, torch.full_like(s, -1))

    def full_to_swa_mapping(self) -> torch.Tensor:
        """SGLang's per-slot full -> SWA mapping (int64 [num token slots], -1 = none)."""
        ps = self.page_size
        off = torch.arange(ps)
        rec = self.full_to_recent.unsqueeze(1)
        return torch.where(rec >= 0, rec * ps + off, torch.full_like(rec * ps + off, -1)).flatten()

    def req_to_token(self, length: int | None = None) -> torch.Tensor:
        """SGLang's req_to_token table (int64 [max_requests, positions]), -1 where unmapped."""
        n = self.pages_per_request * self.page_size if length is None else length
        rows = torch.arange(self.max_requests).unsqueeze(1)
        return self.token_slots(rows.expand(-1, n), torch.arange(n).expand(self.max_requests, -1))
