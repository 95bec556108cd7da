"""A verify step's device tables in two launches, plus one for its page-table updates.

    apply_page_updates(buf, offset, U, V, page_table, swa_pages)
    step_tables(inputs, shapes, pages, layout) -> build_tables' dict

The torch build (serving/tables.py: build_tables, from serving/step.py's packed buffer) is the
reference and these are bitwise equal to it, field for field, padding rows included
(tests/test_step_tables_kernel.py); the torch build is in turn checked against the host builder
reference/tables.py. Everything is integer arithmetic, so bitwise is the only outcome.

* `_rows_kernel`, one program per block of 16 packed rows: each row's request from the tree
  sizes (a prefix sum in registers); a first walk up the parent links gives its depth, hence its
  position; the fields that need no ancestor are written as [rows, columns] tiles (the SWA
  window's and the source rows' committed positions, looked up in the page tables as
  `TokenPages.token_slots` / `swa_slots` do; flags, entry slots, block starts, the group slot);
  a second walk visits the d-th ancestor of every row at step d and writes what it names: SWA
  column d, the source row at position pos - d of a closing row's block, and the branch entry of
  a block closed there. Both walks take depth + 1 steps (the `ancestors` table by doubling
  is the torch form); walk and tile stores cover disjoint cells, so no ordering is needed.
* `_requests_kernel`, one program per request: the [B, N] row grid and each ratio's committed
  entry pages and entry count.
* `_apply_pages_kernel`: the page mappings of the step (unique cells, so no write races),
  before the build reads the tables.

Up to two compression ratios (V4 has C4 and C128); a layout with more is refused. Triton's
integer `//` and `%` truncate toward zero: every operand that can be negative is clamped or
made non-negative first, so the results are Python's floor arithmetic, as in torch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import ConfigError, InputError

from ._launch import check, check_device, pow2
from ._version import TABLE_ROWS

MAX_RATIOS = 2
APPLY_BLOCK = 256
PAGE_TILE = 256
ROW_BLOCK = TABLE_ROWS  # rows per program of the rows kernel (_version.py: 8 under Triton 3.6)


@triton.jit
def _token_slot(pt_ptr, pt_stride, n_pages, row, q, ps):
    """TokenPages.token_slots: slot of position q of page-table row `row`; -1 for q < 0 / unmapped."""
    qc = tl.maximum(q, 0)
    page = tl.load(pt_ptr + row * pt_stride + tl.minimum(qc // ps, n_pages - 1)).to(tl.int64)
    return tl.where((q >= 0) & (page >= 0), page * ps + qc % ps, -1)


@triton.jit
def _recent_slot(swa_ptr, s, ps):
    """TokenPages.swa_slots: the recent slot of token slot s; -1 where none."""
    sc = tl.maximum(s, 0)
    page = tl.load(swa_ptr + sc // ps).to(tl.int64)
    return tl.where((s >= 0) & (page >= 0), page * ps + sc % ps, -1)


@triton.jit
def _ratio_fixed(t, live, valid, p, pos, row, node, pt_ptr, pt_stride, n_pages, swa_ptr, ps, S, trash_recent,
                 committed_slots, trash_entry, closes_ptr, entry_ptr, bstart_ptr, src_ptr, branch_ptr, blen_ptr,
                 M: tl.constexpr, OVERLAP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, KB: tl.constexpr,
                 KBP: tl.constexpr):
    """One ratio's fields of rows t [BT] that need no ancestor (serving/tables.py: _compress,
    branch_entries): flags, entry slots, block starts, the committed source rows, the branch
    padding. -> (closes, first source position, first closing position)."""
    closes = valid & ((pos + 1) % M == 0)
    block = (pos + 1) // M - 1
    if OVERLAP:
        first = (block - 1) * M
    else:
        first = block * M
    tl.store(closes_ptr + t, closes.to(tl.uint8), mask=live)
    tl.store(entry_ptr + t, tl.where(closes, committed_slots + row * S + node, trash_entry), mask=live)
    tl.store(bstart_ptr + t, tl.where(closes, block * M, 0), mask=live)
    j = tl.arange(0, RP)
    q = first[:, None] + j[None, :]
    committed = _recent_slot(swa_ptr, _token_slot(pt_ptr, pt_stride, n_pages, row[:, None], q, ps), ps)
    src = tl.where(closes[:, None], tl.where(q >= 0, committed, -1), trash_recent)
    drafted = closes[:, None] & (q >= p[:, None])  # written by the ancestor walk
    tl.store(src_ptr + t[:, None] * R + j[None, :], src, mask=live[:, None] & (j[None, :] < R) & ~drafted)
    first_close = p + ((M - 1 - p) % M + M) % M
    count = tl.where(valid & (pos >= first_close), tl.maximum(pos - first_close, 0) // M + 1, 0)
    tl.store(blen_ptr + t, count, mask=live)
    v = tl.arange(0, KBP)
    pad = live[:, None] & (v[None, :] < KB) & (v[None, :] >= count[:, None])
    tl.store(branch_ptr + t[:, None] * KB + v[None, :], tl.full([1, KBP], -1, tl.int64), mask=pad)
    return closes, first, first_close


@triton.jit
def _ratio_step(t, ok, d, pos, row, a_node, closes, first, first_close, S, committed_slots, src_ptr, branch_ptr,
                rec, M: tl.constexpr, R: tl.constexpr, KB: tl.constexpr):
    """The ancestor walk's step d (ancestor node a_node of each row, its recent slot rec): the
    source row at position pos - d of a closing row's block, and the branch entry of a block
    closed at that position."""
    j = pos - d - first
    tl.store(src_ptr + t * R + j, rec, mask=ok & closes & (j >= 0) & (j < R))
    rel = pos - d - first_close
    v = tl.maximum(rel, 0) // M
    hit = ok & (rel >= 0) & (tl.maximum(rel, 0) % M == 0) & (v < KB)
    tl.store(branch_ptr + t * KB + v, committed_slots + row * S + a_node, mask=hit)


# Integer arguments that Triton would specialise (== 1, divisible by 16) but that come from the
# pools' sizes (the user's memory configuration) or change from step to step: left unspecialised,
# so one compiled kernel serves every configuration and step, and the sm_90a gate's set covers
# them (design_notes/aot-gate.md, "Coverage"). Their divisibility would only help vector loads.
_LAYOUT_INTS = ["pt_stride", "n_pages", "S", "trash_recent", "a_committed", "a_trash", "b_committed", "b_trash"]


@triton.jit(do_not_specialize=_LAYOUT_INTS)
def _rows_kernel(buf_ptr, pt_ptr, swa_ptr, pt_stride, n_pages, ps, B, T, N, S, trash_recent,
                 ids_ptr, pos_ptr, loc_ptr, swa_out_ptr, swa_len_ptr, req_ptr, slot_ptr,
                 a_committed, a_trash, a_closes, a_entry, a_bstart, a_src, a_branch, a_blen,
                 b_committed, b_trash, b_closes, b_entry, b_bstart, b_src, b_branch, b_blen,
                 W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
                 NUM_RATIOS: tl.constexpr,
                 A_M: tl.constexpr, A_OV: tl.constexpr, A_R: tl.constexpr, A_RP: tl.constexpr,
                 A_KB: tl.constexpr, A_KBP: tl.constexpr,
                 B_M: tl.constexpr, B_OV: tl.constexpr, B_R: tl.constexpr, B_RP: tl.constexpr,
                 B_KB: tl.constexpr, B_KBP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    live = t < T
    # each row's request: serving/step.py unpack (searchsorted of t in the sizes' prefix sums)
    rb = tl.arange(0, BP)
    sizes = tl.load(buf_ptr + 2 * B + rb, mask=rb < B, other=0).to(tl.int64)
    ends = tl.cumsum(sizes, axis=0)
    req = tl.sum(((ends[None, :] <= t[:, None]) & (rb[None, :] < B)).to(tl.int64), axis=1)
    valid = live & (req < B)
    rq = tl.minimum(req, B - 1)
    start = tl.where(valid, tl.sum(tl.where(rb[None, :] == rq[:, None], (ends - sizes)[None, :], 0), axis=1), t)
    node = t - start
    p = tl.where(valid, tl.load(buf_ptr + B + rq).to(tl.int64), 0)
    row = tl.load(buf_ptr + rq).to(tl.int64)
    par_ptr = buf_ptr + 3 * B + T
    # depth: walk the parent links to the root (padding rows have none)
    a = tl.where(live, t, -1)
    depth = tl.zeros([BT], dtype=tl.int64)
    while tl.max(a, axis=0) >= 0:
        par = tl.load(par_ptr + tl.maximum(a, 0), mask=a >= 0, other=-1).to(tl.int64)
        a = tl.where((a >= 0) & (par >= 0), start + par, -1)
        depth += (a >= 0).to(tl.int64)
    pos = tl.where(valid, p + depth, 0)
    tl.store(ids_ptr + t, tl.where(valid, tl.load(buf_ptr + 3 * B + t, mask=live, other=0).to(tl.int64), 0), mask=live)
    tl.store(pos_ptr + t, pos, mask=live)
    tl.store(req_ptr + t, tl.where(valid, req, -1), mask=live)
    tl.store(slot_ptr + t, tl.where(valid, req * N + node, 0), mask=live)
    tl.store(swa_len_ptr + t, tl.where(valid, tl.minimum(pos + 1, W), 0), mask=live)
    # SWA window, newest first: committed positions here, the row's own path (>= P) in the walk
    j = tl.arange(0, WP)
    q = pos[:, None] - j[None, :]
    committed = _recent_slot(swa_ptr, _token_slot(pt_ptr, pt_stride, n_pages, row[:, None], q, ps), ps)
    tl.store(swa_out_ptr + t[:, None] * W + j[None, :], tl.where(q >= 0, committed, -1),
             mask=live[:, None] & (j[None, :] < W) & ((q < p[:, None]) | (q < 0)))
    node = tl.where(valid, node, 0)
    if NUM_RATIOS >= 1:
        a_cl, a_first, a_fc = _ratio_fixed(t, live, valid, p, pos, row, node, pt_ptr, pt_stride, n_pages, swa_ptr,
                                           ps, S, trash_recent, a_committed, a_trash, a_closes, a_entry, a_bstart,
                                           a_src, a_branch, a_blen, A_M, A_OV, A_R, A_RP, A_KB, A_KBP)
    if NUM_RATIOS >= 2:
        b_cl, b_first, b_fc = _ratio_fixed(t, live, valid, p, pos, row, node, pt_ptr, pt_stride, n_pages, swa_ptr,
                                           ps, S, trash_recent, b_committed, b_trash, b_closes, b_entry, b_bstart,
                                           b_src, b_branch, b_blen, B_M, B_OV, B_R, B_RP, B_KB, B_KBP)
    # the ancestor walk: step d visits each row's d-th ancestor (d = 0: the row itself)
    own = _token_slot(pt_ptr, pt_stride, n_pages, row, p + node, ps)
    tl.store(loc_ptr + t, tl.where(valid, _recent_slot(swa_ptr, own, ps), trash_recent), mask=live)
    a = tl.where(live, t, -1)
    d = tl.zeros([BT], dtype=tl.int64)
    while tl.max(a, axis=0) >= 0:
        ok = a >= 0
        a_node = a - start
        loc = _token_slot(pt_ptr, pt_stride, n_pages, row, p + a_node, ps)
        rec = tl.where(valid, _recent_slot(swa_ptr, loc, ps), trash_recent)
        tl.store(swa_out_ptr + t * W + d, rec, mask=ok & (d < W))
        if NUM_RATIOS >= 1:
            _ratio_step(t, ok, d, pos, row, a_node, a_cl, a_first, a_fc, S, a_committed, a_src, a_branch, rec,
                        A_M, A_R, A_KB)
        if NUM_RATIOS >= 2:
            _ratio_step(t, ok, d, pos, row, a_node, b_cl, b_first, b_fc, S, b_committed, b_src, b_branch, rec,
                        B_M, B_R, B_KB)
        par = tl.load(par_ptr + tl.maximum(a, 0), mask=ok, other=-1).to(tl.int64)
        a = tl.where(ok & (par >= 0), start + par, -1)
        d += 1


@triton.jit
def _entry_pages(b, row, seq_len, pt_ptr, pt_stride, n_pages, pages_ptr, len_ptr,
                 M: tl.constexpr, CP, STRIDE: tl.constexpr, TILE: tl.constexpr):
    """committed_entry_pages: entry page c of request b = page_table[row, min(c * stride, last)]."""
    tl.store(len_ptr + b, seq_len // M)
    for c0 in range(0, CP, TILE):
        c = c0 + tl.arange(0, TILE)
        pg = tl.load(pt_ptr + row * pt_stride + tl.minimum(c * STRIDE, n_pages - 1), mask=c < CP)
        tl.store(pages_ptr + b * CP + c, pg, mask=c < CP)


@triton.jit(do_not_specialize=["pt_stride", "n_pages", "a_cp", "b_cp"])  # as _LAYOUT_INTS
def _requests_kernel(buf_ptr, pt_ptr, pt_stride, n_pages, B, N, grid_ptr,
                     a_pages, a_len, a_cp, b_pages, b_len, b_cp,
                     NP: tl.constexpr, BP: tl.constexpr, NUM_RATIOS: tl.constexpr,
                     A_M: tl.constexpr, A_STRIDE: tl.constexpr, B_M: tl.constexpr, B_STRIDE: tl.constexpr,
                     TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rb = tl.arange(0, BP)
    sizes = tl.load(buf_ptr + 2 * B + rb, mask=rb < B, other=0).to(tl.int64)
    start = tl.sum(tl.where(rb < b, sizes, 0), axis=0)
    size = tl.sum(tl.where(rb == b, sizes, 0), axis=0)
    i = tl.arange(0, NP)
    tl.store(grid_ptr + b * N + i, tl.where(i < size, start + i, -1), mask=i < N)
    row = tl.load(buf_ptr + b).to(tl.int64)
    seq_len = tl.load(buf_ptr + B + b).to(tl.int64)
    if NUM_RATIOS >= 1:
        _entry_pages(b, row, seq_len, pt_ptr, pt_stride, n_pages, a_pages, a_len, A_M, a_cp, A_STRIDE, TILE)
    if NUM_RATIOS >= 2:
        _entry_pages(b, row, seq_len, pt_ptr, pt_stride, n_pages, b_pages, b_len, B_M, b_cp, B_STRIDE, TILE)


@triton.jit(do_not_specialize=["offset", "U", "V"])  # a step's own counts (as _LAYOUT_INTS)
def _apply_pages_kernel(buf_ptr, offset, U, V, pt_ptr, swa_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    at = buf_ptr + offset
    cells = tl.load(at + i, mask=i < U, other=0).to(tl.int64)
    tl.store(pt_ptr + cells, tl.load(at + U + i, mask=i < U, other=0), mask=i < U)
    swa_of = tl.load(at + 2 * U + i, mask=i < V, other=0).to(tl.int64)
    tl.store(swa_ptr + swa_of, tl.load(at + 2 * U + V + i, mask=i < V, other=0), mask=i < V)


def _check_pages(pages) -> None:
    check("page_table", pages.page_table, 2, (torch.int32,))
    check("swa_pages", pages.swa_pages, 1, (torch.int32,))


def apply_page_updates(buf: torch.Tensor, offset: int, u: int, v: int, pages) -> None:
    """The step's page mappings, buf[offset:] = cells [u] | token pages [u] | token pages [v] |
    SWA pages [v] (int32, serving/step.py's buffer), scattered into pages (TokenPages) in one launch."""
    check("buf", buf, 1, (torch.int32,))
    _check_pages(pages)
    if buf.device.type == "meta":
        return
    check_device(buf, pages.page_table, pages.swa_pages)
    if offset + 2 * u + 2 * v > buf.shape[0]:
        raise InputError(f"page updates [{offset}, {offset + 2 * u + 2 * v}) past the buffer's {buf.shape[0]} values")
    grid = (max(1, triton.cdiv(max(u, v), APPLY_BLOCK)),)
    _apply_pages_kernel[grid](buf, offset, u, v, pages.page_table, pages.swa_pages, BLOCK=APPLY_BLOCK)


def _ratio_plan(layout, shapes) -> list:
    ratios = sorted(layout.ratios.items())
    if len(ratios) > MAX_RATIOS:
        raise ConfigError(f"the Triton table build takes at most {MAX_RATIOS} compression ratios, "
                          f"the layout has {[m for m, _ in ratios]}")
    widths = dict(shapes.widths)
    out = []
    for m, ov in ratios:
        epp = layout.entries_per_page(m)
        out.append(dict(m=m, ov=bool(ov), r=2 * m if ov else m, kb=(shapes.nodes - 1) // m + 1,
                        epp=epp, cp=-(-widths[m] // epp), stride=1 if m <= layout.page_size else m // layout.page_size))
    return out


def step_tables(inputs: torch.Tensor, shapes, pages, layout) -> dict:
    """build_tables' result (serving/tables.py) from the step's device inputs (serving/step.py:
    the fixed part of the packed buffer, [3B + 2T] int32) and the device page tables, in two
    launches. The host ints are the static shapes only: no device value is read."""
    from dsv4_tree.serving.tables import CompressTables, RowGroups

    b, t, n, w = shapes.requests, shapes.rows, shapes.nodes, layout.window
    check("inputs", inputs, 1, (torch.int32,))
    _check_pages(pages)
    if inputs.shape[0] != 3 * b + 2 * t:
        raise InputError(f"inputs must be [3B + 2T = {3 * b + 2 * t}] for B={b}, T={t}, got {inputs.shape[0]}")
    if b < 1 or n < 1:
        raise InputError(f"a step needs requests >= 1 and nodes >= 1, got B={b}, N={n}")
    dev = inputs.device
    plan = _ratio_plan(layout, shapes)
    i64 = dict(dtype=torch.int64, device=dev)
    ids, pos, loc, swa_len, req, slot = (torch.empty(t, **i64) for _ in range(6))
    swa = torch.empty(t, w, **i64)
    grid = torch.empty(b, n, **i64)
    per = []
    for r in plan:
        per.append(dict(closes=torch.empty(t, dtype=torch.bool, device=dev), entry=torch.empty(t, **i64),
                        bstart=torch.empty(t, **i64), src=torch.empty(t, r["r"], **i64),
                        branch=torch.empty(t, r["kb"], **i64), blen=torch.empty(t, **i64),
                        pages=torch.empty(b, r["cp"], dtype=torch.int32, device=dev), len=torch.empty(b, **i64)))
    if dev.type != "meta":
        check_device(inputs, pages.page_table, pages.swa_pages)
        _launch(inputs, pages, layout, b, t, n, w, plan, per, (ids, pos, loc, swa, swa_len, req, slot), grid)
    compress = {r["m"]: CompressTables(r["m"], o["closes"], o["entry"], o["bstart"], o["src"], o["pages"], r["epp"],
                                       o["len"], o["branch"], o["blen"]) for r, o in zip(plan, per)}
    return dict(num_rows=t, input_ids=ids, positions=pos, out_loc=loc, swa_index=swa, swa_len=swa_len,
                compress=compress, groups=RowGroups(req, slot, grid))


def _launch(inputs, pages, layout, b, t, n, w, plan, per, rows_out, grid) -> None:
    pt, swa_pages, ps = pages.page_table, pages.swa_pages, pages.page_size
    np2, bp2 = pow2(n, 2), pow2(b, 2)
    dummy = rows_out[0]
    ratio_args, ratio_meta, req_args, req_meta = [], {}, [], {}
    for i, name in enumerate("AB"):
        if i < len(plan):
            r, o = plan[i], per[i]
            ratio_args += [layout.committed_entry_slots(r["m"]), layout.trash_entry_slot(r["m"]),
                           o["closes"].view(torch.uint8), o["entry"], o["bstart"], o["src"], o["branch"], o["blen"]]
            ratio_meta.update({f"{name}_M": r["m"], f"{name}_OV": r["ov"], f"{name}_R": r["r"],
                               f"{name}_RP": pow2(r["r"], 2), f"{name}_KB": r["kb"], f"{name}_KBP": pow2(r["kb"], 2)})
            req_args += [o["pages"], o["len"], r["cp"]]
            req_meta.update({f"{name}_M": r["m"], f"{name}_STRIDE": r["stride"]})
        else:
            ratio_args += [0, 0] + [dummy] * 6
            ratio_meta.update({f"{name}_M": 1, f"{name}_OV": False, f"{name}_R": 1, f"{name}_RP": 2,
                               f"{name}_KB": 1, f"{name}_KBP": 2})
            req_args += [dummy, dummy, 0]
            req_meta.update({f"{name}_M": 1, f"{name}_STRIDE": 1})
    _rows_kernel[(triton.cdiv(t, ROW_BLOCK),)](
        inputs, pt, swa_pages, pt.stride(0), pt.shape[1], ps, b, t, n, layout.scratch_per_request,
        layout.trash_recent_slot, *rows_out, *ratio_args, W=w, WP=pow2(w, 2), BT=ROW_BLOCK, BP=bp2,
        NUM_RATIOS=len(plan), **ratio_meta)
    _requests_kernel[(b,)](inputs, pt, pt.stride(0), pt.shape[1], b, n, grid, *req_args, NP=np2, BP=bp2,
                           NUM_RATIOS=len(plan), TILE=PAGE_TILE, **req_meta)
