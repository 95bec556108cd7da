"""ServingRuntime: one model's pools, page tables and address layout, and the three things the
engine asks of them: tables for a verify step, commit by slot moves, release."""
from __future__ import annotations

import torch

from .commit import apply_moves, plan_moves
from .pages import PageTable
from .pools import Layout, build_pools
from .state_view import committed_view
from .tables import VerifyPlan, build_tables

DEFAULT_TOKEN_CAP = 1 << 18


def make_layout(model, spec, limits) -> Layout:
    """Address layout (page counts, windows, scratch) for `model` under `spec`."""
    ps = spec.page_size
    ratios = model.compressors
    recent_window = max([model.window] + [2 * m if ov else m for m, ov in ratios.items()])
    scratch = max(limits.max_nodes, spec.prefill_chunk)
    total = spec.max_total_tokens
    if total is None:
        total = min(spec.max_requests * limits.max_positions, DEFAULT_TOKEN_CAP)
    token_pages = -(-total // ps) + spec.max_requests  # + one partial page per request
    recent_pages = spec.max_requests * (-(-(recent_window + scratch) // ps) + 1)
    return Layout(ps, model.window, recent_window, ratios, token_pages, scratch, spec.max_requests, recent_pages)


class ServingRuntime:
    def __init__(self, model, spec, limits):
        self.model = model
        self.layout = make_layout(model, spec, limits)
        # slots, not positions: draft node i sits at slot P + i while its position is P + depth,
        # so a request near max_position_embeddings needs up to scratch_per_request slots past it
        self.pages = PageTable(spec.max_requests, limits.max_positions + self.layout.scratch_per_request, spec.page_size,
                               self.layout.num_token_pages, self.layout.num_recent_pages)
        self.pools = build_pools(model.layer_shapes(), model.rope_dim, self.layout, spec.kv_cache_dtype,
                                 model.device, model.dtype)

    def admit(self) -> int:
        return self.pages.admit()

    def release_row(self, row: int) -> None:
        self.pages.release(row)

    @torch.inference_mode()
    def plan(self, rows, seq_lens, trees) -> VerifyPlan:
        """Map the draft slots (positions P .. P+N-1) of every request, then build the tables."""
        r = self.layout.recent_window
        self.pages.ensure(rows, [p + t.num_nodes for p, t in zip(seq_lens, trees)], [p - r for p in seq_lens])
        return build_tables(trees, seq_lens, rows, self.pages, self.layout)

    @torch.inference_mode()
    def commit(self, rows, seq_lens, paths, before_write=None) -> None:
        """Move accepted rows and entries into their committed slots, then free what no row can
        read any more: pages past the new length, recent pages before new length - R.
        before_write: see apply_moves."""
        moves = plan_moves(self.pages, self.layout, rows, seq_lens, paths)
        apply_moves(self.pools, moves.to(self.model.device), before_write)
        new = [p + path.numel() for p, path in zip(seq_lens, paths)]
        self.pages.shrink(rows, new)
        self.pages.evict(rows, [n - self.layout.recent_window for n in new])

    def committed_view(self, row: int, seq_len: int) -> list:
        return committed_view(self.pools, self.pages, self.layout, row, seq_len, self.model.gate_biases())

    def live_slots(self) -> dict:
        """Pages in use per pool (for leak checks)."""
        return {"token": self.pages.tokens.used_pages, "recent": self.pages.recent.used_pages}
