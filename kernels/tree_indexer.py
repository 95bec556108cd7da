"""Tree-aware lightning indexer: scores, running top-k and slot map in one pass per request.

    selected, lengths, ties = indexer_topk(q, weights, keys, entry_pages, epp, entry_len, branch,
                                           req_rows, scale, topk)

One program per request (per group of 16 of its rows when it has more: prefill chunks). Its
tile holds every row of the request and every index head (M = N x HI); each tile of the request's committed indexer keys (read through the entry page
table, FP8 records dequantised in registers, `_pool_rows.py`) is loaded once and scored for all
rows and heads: dot, ReLU, head weights and the head sum stay in registers. Scores never reach
memory: each row keeps a running top-k as packed int64 keys (score bits made order-preserving in
the high word, `2^31 - 1 - column` in the low word), so a descending sort is the tie rule itself:
higher score first, then the earlier column (block order: committed entries 0..C-1, then the
row's branch entries C..C+Kb-1). A chunk of KP candidates is merged into the KP kept ones with
one bitonic top-KP of their union (KP = the power of two above k, so the (k+1)-th best, which
decides the tie flag, is kept too). After the committed chunks, each row's own branch keys
(the only keys rows do not share) are scored and merged the same way, up to KP per merge; then the kept columns
are mapped to entry slots and written: selected [T, k], lengths [T], ties [T], and the selected
scores [T, k]. No [T, C] score tensor exists at any point.

Dots take fp32 inputs with `input_precision="ieee"` (never TF32). Rows of no request (padding)
are read by no program: their outputs stay -1 / 0.
Reference: dsv4_tree.reference.indexer_topk.ref_indexer_topk (ref_indexer_paged_scores +
ref_indexer_gather_scores + the tie rule)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.numerics.ties import TIE_MARGIN
from dsv4_tree.errors import InputError

from ._launch import INDEX, check, check_device, check_index_query, pow2
from ._meta import on_meta
from ._pool_rows import load_pool_rows, pool_format

NO_KEY = -9223372036854775807  # below every packed key of a finite score


@triton.jit
def _pack(score, col, ok):
    """fp32 scores, int columns -> int64 keys ordered as (score, -column); NO_KEY where not ok."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties +0.0, as in torch's sort
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (2147483647 - col).to(tl.int64)
    return tl.where(ok, key, -9223372036854775807)


@triton.jit
def _unpack(key):
    """-> (score fp32, column int64) of packed keys."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 2147483647 - (key & 0xFFFFFFFF)


@triton.jit
def _merge(kept, cand, KP: tl.constexpr, BN: tl.constexpr):
    """Best KP of two [BN, KP] key sets, sorted best first."""
    return tl.topk(tl.reshape(tl.join(kept, cand), (BN, 2 * KP)), KP)


@triton.jit
def _head_sum(q_ptr, w_ptr, row_t, rn_ok, keys, H, D, rd, BN: tl.constexpr, BH: tl.constexpr,
              BCOL: tl.constexpr):
    """sum_h w[row, h] * relu(q[row, h] . key) for every (row, key column): keys [BCOL, BD] ->
    [BN, BCOL] (scale not applied). Heads in chunks of BH: M = BN x BH per dot."""
    rm = tl.arange(0, BN * BH)
    m_row = rm // BH
    t_m = tl.reshape(tl.broadcast_to(row_t[:, None], (BN, BH)), (BN * BH,))
    ok_m = tl.reshape(tl.broadcast_to(rn_ok[:, None], (BN, BH)), (BN * BH,))
    s = tl.zeros((BN, BCOL), tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + rm % BH
        live = ok_m & (h < H)
        qrow = tl.where(live, t_m, 0).to(tl.int64) * H + h
        q = tl.load(q_ptr + qrow[:, None] * D + rd[None, :], mask=live[:, None] & (rd[None, :] < D), other=0.0)
        w = tl.load(w_ptr + qrow, mask=live, other=0.0).to(tl.float32)
        dots = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")  # [BN*BH, BCOL]
        part = tl.maximum(dots, 0.0) * w[:, None]
        s += tl.sum(tl.reshape(part, (BN, BH, BCOL)), axis=1)
    return s


@triton.jit
def _indexer_topk_kernel(q_ptr, w_ptr, pages_ptr, elen_ptr, branch_ptr, rows_ptr, sel_ptr, len_ptr, tie_ptr,
                         score_ptr, H, D, N, G, CP, EPP, KB, K, scale, tie_margin,
                         k_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                         FMT: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr,
                         KP: tl.constexpr, BKB: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    r0 = (pid % G) * BN  # the program's rows: req_rows[b, r0 : r0 + BN]
    rn = tl.arange(0, BN)
    rd = tl.arange(0, BD)
    row_t = tl.load(rows_ptr + b * N + r0 + rn, mask=r0 + rn < N, other=-1).to(tl.int64)
    rn_ok = row_t >= 0
    n_e = tl.load(elen_ptr + b).to(tl.int32)
    c_width = CP * EPP
    kept = tl.full((BN, KP), -9223372036854775807, tl.int64)
    sub = tl.arange(0, KP // BC)
    # committed entries: KP candidates per chunk, BC keys per tile, each tile read once for all rows
    for c0 in range(0, n_e, KP):
        chunk = tl.full((BN, KP // BC, BC), -9223372036854775807, tl.int64)
        for j in tl.static_range(KP // BC):
            cols = c0 + j * BC + tl.arange(0, BC)
            ok = cols < n_e
            page = tl.load(pages_ptr + b * CP + cols // EPP, mask=ok, other=-1).to(tl.int64)
            ok = ok & (page >= 0)
            keys = load_pool_rows(k_ptr, page * EPP + cols % EPP, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES,
                                  SCALE_BYTES, FP8_DIM, TILE, FMT)
            s = _head_sum(q_ptr, w_ptr, row_t, rn_ok, keys, H, D, rd, BN, BH, BC) * scale
            key = _pack(s, cols[None, :], ok[None, :] & rn_ok[:, None])
            chunk = tl.where(sub[None, :, None] == j, key[:, None, :], chunk)
        kept = _merge(kept, tl.reshape(chunk, (BN, KP)), KP, BN)
    # each row's own branch entries (columns C + j), BKB per row at a time: all rows' keys in one
    # tile, each row keeps its own
    rc = tl.arange(0, BN * BKB)
    c_row = rc // BKB
    t_c = tl.reshape(tl.broadcast_to(row_t[:, None], (BN, BKB)), (BN * BKB,))
    own = rn[:, None] == c_row[None, :]
    bsub = tl.arange(0, KP // BKB)
    for j0 in range(0, KB, BKB):
        c_j = j0 + rc % BKB
        ok_c = (t_c >= 0) & (c_j < KB)
        slot_c = tl.load(branch_ptr + tl.where(ok_c, t_c, 0) * KB + c_j, mask=ok_c, other=-1).to(tl.int64)
        ok_c = ok_c & (slot_c >= 0)
        bkeys = load_pool_rows(k_ptr, slot_c, ok_c, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                               FMT)
        s_all = _head_sum(q_ptr, w_ptr, row_t, rn_ok, bkeys, H, D, rd, BN, BH, BN * BKB) * scale  # [BN, BN*BKB]
        s_own = tl.sum(tl.reshape(tl.where(own, s_all, 0.0), (BN, BN, BKB)), axis=1)  # [BN, BKB]
        ok_own = tl.sum(tl.reshape(tl.where(own & ok_c[None, :], 1, 0), (BN, BN, BKB)), axis=1) > 0
        bkey = _pack(s_own, c_width + j0 + tl.arange(0, BKB)[None, :], ok_own)
        bchunk = tl.where(bsub[None, :, None] == 0, bkey[:, None, :], -9223372036854775807)
        kept = _merge(kept, tl.reshape(bchunk, (BN, KP)), KP, BN)
    # the first K kept columns -> entry slots; the (K+1)-th decides the tie flag
    rk = tl.arange(0, KP)
    score, col = _unpack(kept)
    valid = (kept != -9223372036854775807) & (rk[None, :] < K)
    committed = col < c_width
    cc = tl.where(valid & committed, col, 0)
    page = tl.load(pages_ptr + b * CP + cc // EPP, mask=valid & committed, other=0).to(tl.int64)
    bc = tl.where(valid & ~committed, col - c_width, 0)
    t2 = tl.where(rn_ok, row_t, 0)[:, None]
    own_slot = tl.load(branch_ptr + t2 * KB + bc, mask=valid & ~committed, other=-1).to(tl.int64)
    slot = tl.where(committed, page * EPP + cc % EPP, own_slot)
    out_ok = rn_ok[:, None] & (rk[None, :] < K)
    tl.store(sel_ptr + t2 * K + rk[None, :], tl.where(valid, slot, -1), mask=out_ok)
    tl.store(score_ptr + t2 * K + rk[None, :], tl.where(valid, score, float("-inf")), mask=out_ok)
    edge_key = tl.sum(tl.where(rk[None, :] == K - 1, kept, 0), axis=1)
    next_key = tl.sum(tl.where(rk[None, :] == K, kept, 0), axis=1)
    edge, _ = _unpack(edge_key)
    nxt, _ = _unpack(next_key)
    gap = tie_margin * tl.maximum(tl.abs(edge), tl.abs(nxt))
    tie = (next_key != -9223372036854775807) & ((edge - nxt) <= gap)
    t1 = tl.where(rn_ok, row_t, 0)
    tl.store(len_ptr + t1, tl.sum(valid.to(tl.int64), axis=1), mask=rn_ok)
    tl.store(tie_ptr + t1, tie.to(tl.int64), mask=rn_ok)


def indexer_topk_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows, scale, topk):
    """indexer_topk plus the selected candidates' scores [T, k] (-inf where none)."""
    t, h, d = check_index_query(q, weights, scale)
    check("entry_pages", entry_pages, 2, INDEX)
    check("entry_len", entry_len, 1, INDEX)
    check("branch", branch, 2, INDEX)
    check("req_rows", req_rows, 2, INDEX)
    b, cp = entry_pages.shape
    if entry_len.shape[0] != b or req_rows.shape[0] != b:
        raise InputError(f"entry_len ({entry_len.shape[0]}) and req_rows ({req_rows.shape[0]}) must have "
                         f"entry_pages' {b} requests")
    if branch.shape[0] != t:
        raise InputError(f"branch has {branch.shape[0]} rows, q has {t}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise InputError(f"topk must be a positive int, got {topk!r}")
    epp = int(entries_per_page)
    if epp < 1:
        raise InputError(f"entries_per_page must be >= 1, got {entries_per_page}")
    fmt = pool_format("keys", keys)
    if fmt.head_dim != d:
        raise InputError(f"keys has head_dim {fmt.head_dim}, q has head_dim {d}")
    tensors = (q, weights, entry_pages, entry_len, branch, req_rows, fmt.storage)
    meta = on_meta(*tensors)
    dev = q.device if meta else check_device(*tensors)
    kb, n = branch.shape[1], req_rows.shape[1]
    k = min(topk, cp * epp + kb)
    sel = torch.full((t, k), -1, dtype=torch.int64, device=dev)
    scores = torch.full((t, k), float("-inf"), dtype=torch.float32, device=dev)
    lengths = torch.zeros(t, dtype=torch.int64, device=dev)
    ties = torch.zeros(t, dtype=torch.int64, device=dev)
    if t == 0 or k == 0 or b == 0 or n == 0 or meta:
        return sel, lengths, ties, scores
    bn = min(pow2(n, 1), 16)  # a tree's rows in one tile; longer requests (prefill chunks) in groups of 16
    groups = -(-n // bn)
    bh = max(pow2(h, 1) if h <= 16 else 16, -(-16 // bn))  # tl.dot needs M = BN x BH >= 16
    kp = pow2(k + 1)  # keeps the (k+1)-th best for the tie flag
    bkb = min(max(pow2(kb, 1), -(-16 // bn)), kp)  # branch columns per merge (prefill chunks: several)
    _indexer_topk_kernel[(b * groups,)](
        q, weights, entry_pages, entry_len, branch, req_rows, sel, lengths, ties, scores, h, d, n, groups, cp, epp, kb, k,
        float(scale), TIE_MARGIN, *fmt.kernel_args(),
        FMT=fmt.fmt, BN=bn, BH=bh, BC=min(16, kp), KP=kp, BKB=bkb, BD=pow2(d))
    return sel, lengths, ties, scores


def indexer_topk(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows, scale, topk):
    """Same contract as attention/torch_ops.indexer_topk -> (selected entry slots [T, k] int64, -1 =
    none; lengths [T]; ties [T]), k = min(topk, C + Kb) (C = entry_pages' width x epp)."""
    return indexer_topk_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows,
                               scale, topk)[:3]
