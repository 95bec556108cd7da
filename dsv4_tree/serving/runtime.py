"""ServingRuntime: one model's pools, page tables and address layout, and the three things the
engine asks of them: tables for a verify step, commit by slot moves, release."""
from __future__ import annotations

import torch

from .buckets import step_shapes
from .commit import SlotMoves, apply_moves, plan_moves, pool_segments
from .pages import PageTable
from .pools import Layout, build_pools
from .state_view import committed_view
from .step import DevicePages, HostStep, build_step, schedule, upload
from .tables import VerifyPlan

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
    """kernels: the Triton kernels package (`AttentionOps.kernels` of the Triton backend) when the
    table build, FP8 K=V stores and commit moves run as kernels; None runs their torch paths.
    Passed in, never imported: serving sits below the kernels in the layer order."""

    def __init__(self, model, spec, limits, kernels=None):
        self.model = model
        self.layout = make_layout(model, spec, limits)
        # slots, not positions: draft node i sits at slot P + i while its position is P + depth,
        # so a request near max_position_embeddings needs up to scratch_per_request slots past it
        self.pages = PageTable(spec.max_requests, limits.max_positions + self.layout.scratch_per_request, spec.page_size,
                               self.layout.num_token_pages, self.layout.num_recent_pages)
        self.pools = build_pools(model.layer_shapes(), model.rope_dim, self.layout, spec.kv_cache_dtype,
                                 model.device, model.dtype)
        self.device_pages = DevicePages(spec.max_requests, self.pages.pages_per_request,
                                        self.layout.num_token_pages, spec.page_size, model.device)
        self.max_nodes = limits.max_nodes
        # the Triton backend commits every pool's moves in one launch over this byte-segment table
        self.kernels = kernels
        self.segments = pool_segments(self.pools, self.layout) if kernels is not None else None
        if kernels is not None:  # the table build and FP8 K=V writes as kernels
            self.device_pages.use_kernels(kernels)
            for lp in self.pools:
                for pool in (lp.swa, *(c.entries for c in lp.compressors)):
                    pool.use_kernels(kernels.fp8_store)

    def admit(self) -> int:
        return self.pages.admit()

    def release_row(self, row: int) -> None:
        self.pages.release(row)

    @torch.inference_mode()
    def plan(self, rows, seq_lens, trees, bucketed: bool = False, graphed: bool = False) -> VerifyPlan:
        """Map the draft slots (positions P .. P+N-1) of every request (host), pack the step into
        one int32 buffer, copy it to the device once and build the tables there. bucketed: pad
        to the static shapes of a bucket (serving/buckets.py); graphed: only copy (and apply the
        page updates): the captured graph builds the tables with the forward (executor/graphs.py)."""
        r = self.layout.recent_window
        sizes = [t.num_nodes for t in trees]
        self.pages.ensure(rows, [p + n for p, n in zip(seq_lens, sizes)], [p - r for p in seq_lens])
        shapes = step_shapes(sizes, seq_lens, self.layout, self.max_nodes if bucketed else None)
        updates = self.pages.take_updates()
        try:  # the updates are consumed only with a built (or staged) step: a retry after a raise re-applies them
            step = schedule(rows, seq_lens, trees, sizes, updates, shapes)
            offsets = [0]
            for n in sizes[:-1]:
                offsets.append(offsets[-1] + n)
            host = dict(rows=tuple(rows), seq_lens=tuple(seq_lens), offsets=tuple(offsets), num_nodes=tuple(sizes),
                        trees=tuple(trees), bucket=shapes if bucketed else None)
            if graphed:
                staged = upload(step, self.device_pages, self.model.device)
                return VerifyPlan(shapes.rows, None, None, None, None, None, {}, None, staged=staged, **host)
            return VerifyPlan(**self.build(step), **host)
        except BaseException:  # Ctrl-C, out of memory, a failed launch: the device table may lack them
            self.pages.put_back(updates)
            raise

    def build(self, step: HostStep) -> dict:
        """Device half: the one copy, then every table (no host reads; graph-capturable)."""
        return build_step(step, self.device_pages, self.layout, self.model.device)

    def commit(self, rows, seq_lens, paths, before_write=None) -> None:
        """Move accepted rows and entries into their committed slots, then free what no row can
        read any more: pages past the new length, recent pages before new length - R.
        before_write: see apply_moves."""
        moves = self.prepare_commit(rows, seq_lens, paths)
        self.apply_commit(moves, rows, [p + len(path) for p, path in zip(seq_lens, paths)], before_write)

    @torch.inference_mode()
    def prepare_commit(self, rows, seq_lens, paths, carry=()) -> SlotMoves:
        """A commit's slot moves (host arithmetic), with the carried int64 host tensors, on the
        device through one host-to-device copy. Writes nothing."""
        return plan_moves(self.pages, self.layout, rows, seq_lens, paths, carry).to(self.model.device)

    @torch.inference_mode()
    def apply_commit(self, moves: SlotMoves, rows, new_lengths, before_write=None) -> None:
        """Apply prepared moves, then free pages past new_lengths and recent pages before
        new_lengths - R."""
        apply_moves(self.pools, moves, before_write, self.segments,
                    self.kernels.move_records if self.kernels is not None else None)
        self.pages.shrink(rows, new_lengths)
        self.pages.evict(rows, [n - self.layout.recent_window for n in new_lengths])

    def committed_view(self, row: int, seq_len: int) -> list:
        return committed_view(self.pools, self.pages, self.layout, row, seq_len, self.model.gate_biases())

    def live_slots(self) -> dict:
        """Pages in use per pool (for leak checks)."""
        return {"token": self.pages.tokens.used_pages, "recent": self.pages.recent.used_pages}
