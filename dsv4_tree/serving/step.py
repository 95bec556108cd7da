"""One verify step's host schedule and its single host-to-device copy.

The host part knows only plain ints, O(batch): which page-table rows, P per request, tree sizes,
the page mappings made since the last step, and the static shapes (bucket). It packs all of it
with the trees' tokens and parents into ONE int32 buffer; `upload` copies that buffer to the
device once, applies the page mappings to the device page tables, and the device build
(serving/tables.py) does the rest.

Buffer layout (int32, 1-D): req_pool_indices [B] | seq_lens [B] | tree sizes [B] | input_ids [T]
| parents [T] (local) | page-table cells [U] | their token pages [U] | token pages [V] | their SWA
pages [V]. Padding requests have size 0 and P 0; padding rows (past the real rows) get -1
parents and become rows of no request on the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .pools import Layout
from .tables import TokenPages, build_tables, draft_cache_loc


@dataclass(frozen=True)
class StepShapes:
    """Static shapes of a step's build: one set per bucket."""

    requests: int  # B (padded)
    rows: int  # T (padded)
    nodes: int  # N: nodes per request the ancestor tables hold
    widths: tuple  # ((ratio, C committed-entry width), ...)


@dataclass(frozen=True)
class HostStep:
    buffer: torch.Tensor  # [B*3 + T*2 + U*2 + V*2] int32, host
    shapes: StepShapes
    num_page_updates: int  # U
    num_swa_updates: int  # V


class DevicePages:
    """The device copy of the page tables (TokenPages), kept in step by the updates each step
    carries. Entries freed on the host stay stale here: the build reads only positions the host
    has mapped again (positions < P + N, recent pages of positions >= P - recent window).
    `use_kernels(kernels)` (the Triton backend, given the kernels package): the updates and the
    build run as Triton kernels (kernels/table_build.py: three launches, bitwise the torch build's
    tables)."""

    def __init__(self, max_requests: int, pages_per_request: int, num_token_pages: int, page_size: int, device):
        self.pages = TokenPages(torch.full((max_requests, pages_per_request), -1, dtype=torch.int32, device=device),
                                torch.full((num_token_pages,), -1, dtype=torch.int32, device=device), page_size)
        self.kernels = None  # the kernels package when the build runs as Triton kernels

    def use_kernels(self, kernels) -> None:
        self.kernels = kernels

    def apply(self, cells, token_pages, swa_of, swa_pages) -> None:
        """Scatter the page mappings (unique cells and unique token pages: no write races)."""
        self.pages.page_table.view(-1).index_put_((cells.long(),), token_pages)
        self.pages.swa_pages.index_put_((swa_of.long(),), swa_pages)


def schedule(rows, seq_lens, trees, sizes, updates, shapes: StepShapes) -> HostStep:
    """Pack one step (host ints and the trees' tensors) into the int32 buffer. sizes: the trees'
    node counts; updates: the PageTable.take_updates() lists (cells, token pages, token pages,
    SWA pages). One concatenation and one cast, whatever the batch."""
    b, t = shapes.requests, shapes.rows
    pad_b, pad_t = b - len(rows), t - sum(sizes)
    head = list(rows) + [0] * pad_b + list(seq_lens) + [0] * pad_b + list(sizes) + [0] * pad_b
    cells, tok, swa_of, swa = updates
    parts = [torch.tensor(head, dtype=torch.int64)]
    parts += [tr.tokens for tr in trees] + [torch.zeros(pad_t, dtype=torch.int64)]
    parts += [tr.parents for tr in trees] + [torch.full((pad_t,), -1, dtype=torch.int64)]
    parts.append(torch.tensor(cells + tok + swa_of + swa, dtype=torch.int64))
    return HostStep(torch.cat(parts).to(torch.int32), shapes, len(cells), len(swa_of))


def upload(step: HostStep, device_pages: DevicePages, device) -> torch.Tensor:
    """The step's one host-to-device copy, then the page updates applied on the device.
    Returns the device copy of the fixed part (the build's inputs, [3B + 2T])."""
    buf = step.buffer.to(device, non_blocking=True)
    b, t = step.shapes.requests, step.shapes.rows
    u, v = step.num_page_updates, step.num_swa_updates
    o = 3 * b + 2 * t
    if device_pages.kernels is not None:
        device_pages.kernels.apply_page_updates(buf, o, u, v, device_pages.pages)
    else:
        device_pages.apply(buf[o : o + u], buf[o + u : o + 2 * u], buf[o + 2 * u : o + 2 * u + v],
                           buf[o + 2 * u + v : o + 2 * u + 2 * v])  # also when empty: the same ops every step
    return buf[:o]


def unpack(inputs: torch.Tensor, shapes: StepShapes) -> dict:
    """The fixed part of the buffer -> build_tables' inputs: req_pool_indices, seq_lens,
    input_ids, parents, row_req (-1 for padding rows), row_node."""
    b, t = shapes.requests, shapes.rows
    sizes = inputs[2 * b : 3 * b].long()
    ends = torch.cumsum(sizes, 0)
    idx = torch.arange(t, device=inputs.device)
    req = torch.searchsorted(ends, idx, right=True)  # B past the real rows
    valid = req < b
    req = req.clamp(max=b - 1)
    node = idx - (ends - sizes)[req]
    return dict(req_pool_indices=inputs[:b], seq_lens=inputs[b : 2 * b], input_ids=inputs[3 * b : 3 * b + t],
                parents=inputs[3 * b + t : 3 * b + 2 * t], row_req=torch.where(valid, req, -1),
                row_node=torch.where(valid, node, 0))


def build_from(inputs: torch.Tensor, shapes: StepShapes, device_pages: DevicePages, layout: Layout) -> dict:
    """Every table of the step from its device inputs (the VerifyPlan tensor fields): no host
    reads, static shapes, so it can be captured in a CUDA graph together with the forward."""
    pages = device_pages.pages
    if device_pages.kernels is not None:
        return device_pages.kernels.step_tables(inputs, shapes, pages, layout)
    x = unpack(inputs, shapes)
    loc = draft_cache_loc(pages, x["req_pool_indices"], x["seq_lens"], x["row_req"], x["row_node"])
    return build_tables(pages, out_cache_loc=loc, layout=layout, num_nodes=shapes.nodes,
                        widths=dict(shapes.widths), **x)


def build_step(step: HostStep, device_pages: DevicePages, layout: Layout, device) -> dict:
    """upload, then build_from: the whole device half of a step's tables."""
    return build_from(upload(step, device_pages, device), step.shapes, device_pages, layout)
