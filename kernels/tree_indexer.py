"""Tree-aware lightning indexer: scores, running top-k and slot map in one pass per request.

    selected, lengths, ties = indexer_topk(q, weights, keys, entry_pages, epp, entry_len, branch,
                                           req_rows, scale, topk)

One program per request (per group of 16 of its rows when it has more: prefill chunks). Its
dot tile holds every row of the request and BH index heads (M = BN x BH, 64 for the tensor-core
form); each tile of BC request's committed indexer keys (read through the entry page table) is
loaded once and scored for all rows and heads: dot, ReLU, head weights and the head sum stay in
registers. Each score is packed into an int64 key (score bits made order-preserving in the high
word, `2^31 - 1 - column` in the low word), so a descending sort is the tie rule itself: higher
score first, then the earlier column (block order: committed entries 0..C-1, then the row's
branch entries C..C+Kb-1). Each row keeps its best KP keys (KP = the power of two above k, so the
(k+1)-th best, which decides the tie flag, is kept too) in a [2 KP] buffer in global memory: keys
above the row's threshold (its KP-th best) are appended to the incoming half; when a row could
overflow, and after the last tile, incoming and kept merge (`_best`: one sort and one bitonic
merge) and the threshold rises. Shared memory and code size do not depend on KP or N. After the
committed tiles, each row's own branch keys (the only keys rows do not share) are scored the same
way, BC / BN per row per tile; then the kept columns are mapped to entry slots and written:
selected [T, k], lengths [T], ties [T], and the selected scores [T, k]. No [T, C] score tensor
exists at any point.

Dots (`_dot.py`): bf16 tensor-core dots with fp32 accumulation for bf16 queries over keys exact in
bf16 (the e4m3 codes of an FP8 index key, its block scale applied to the dot), else fp32 inputs
with `input_precision="ieee"` (never TF32). Rows of no request (padding) are read by no program:
their outputs stay -1 / 0.
Reference: dsv4_tree.reference.indexer_topk.ref_indexer_topk (ref_indexer_paged_scores +
ref_indexer_gather_scores + the tie rule)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.numerics.ties import TIE_MARGIN
from dsv4_tree.errors import InputError

from ._launch import ALL_REGISTERS, INDEX, check, check_device, check_index_query, pow2
from ._meta import on_meta
from ._version import INDEXER_WIDE_TILE
from ._dot import INTERPRETED, dot, operand
from ._pool_rows import INDEX_KEY_RECORD, bf16_rows, dot_keys, pool_format

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
def _head_sum(q_ptr, w_ptr, row_t, rn_ok, keys, kscale, H, D, rd, BN: tl.constexpr, BH: tl.constexpr,
              BC: tl.constexpr, MMA: tl.constexpr):
    """sum_h w[row, h] * relu(q[row, h] . key) for every (row, key column): keys [BC, BD] ->
    [BN, BC] (scale not applied). Heads in chunks of BH: M = BN x BH per dot."""
    rm = tl.arange(0, BN * BH)
    t_m = tl.reshape(tl.broadcast_to(row_t[:, None], (BN, BH)), (BN * BH,))
    ok_m = tl.reshape(tl.broadcast_to(rn_ok[:, None], (BN, BH)), (BN * BH,))
    kt = tl.trans(keys)
    s = tl.zeros((BN, BC), tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + rm % BH
        live = ok_m & (h < H)
        qrow = tl.where(live, t_m, 0).to(tl.int64) * H + h
        q = tl.load(q_ptr + qrow[:, None] * D + rd[None, :], mask=live[:, None] & (rd[None, :] < D), other=0.0)
        w = tl.load(w_ptr + qrow, mask=live, other=0.0).to(tl.float32)
        dots = dot(operand(q, MMA), kt, MMA) * kscale[None, :]  # [BN*BH, BC]
        part = tl.maximum(dots, 0.0) * w[:, None]
        s += tl.sum(tl.reshape(part, (BN, BH, BC)), axis=1)
    return s


@triton.jit
def _best_network(kept, incoming, KP: tl.constexpr):
    """The best KP of kept [KP] (sorted, best first) and incoming [KP] (any order), sorted best
    first: incoming sorted ascending against kept descending, the elementwise max holds the best
    KP of the union as a bitonic sequence, which one bitonic merge sorts (no sort of 2 KP keys)."""
    return tl.bitonic_merge(tl.maximum(kept, tl.sort(incoming)), descending=True)


RANK_CHUNK = tl.constexpr(128)  # keys ranked per step of _best_rank: [128, 2 KP] blocks


@triton.jit
def _best_rank(kept, incoming, KP: tl.constexpr):
    """_best_network's result by counting each key's rank in the union (ties by position, for the
    repeated empty keys), for the interpreter, which runs Triton's sort network one Python
    reduction per element (~0.5 s per sort at KP = 16). O(KP^2) work in chunks of RANK_CHUNK keys,
    so no block exceeds [RANK_CHUNK, 2 KP] or [KP, RANK_CHUNK] elements: under Triton's limit of
    2^20 per block up to KP 4096 (V4-Flash's top-512 keeps KP 1024, V4-Pro's top-1024 KP 2048)."""
    both = tl.reshape(tl.join(kept, incoming), (2 * KP,))
    i = tl.arange(0, 2 * KP)
    rk = tl.arange(0, KP)
    top = tl.zeros((KP,), tl.int64)
    CH: tl.constexpr = RANK_CHUNK if 2 * KP > RANK_CHUNK else 2 * KP  # one chunk at small KP
    for c0 in tl.static_range(0, 2 * KP, CH):
        j = c0 + tl.arange(0, CH)  # the chunk's positions in the union
        v = tl.sum(tl.where(i[None, :] == j[:, None], both[None, :], 0), axis=1)  # their keys
        above = (both[None, :] > v[:, None]) | ((both[None, :] == v[:, None]) & (i[None, :] < j[:, None]))
        rank = tl.where(j < 2 * KP, tl.sum(above.to(tl.int32), axis=1), KP)  # past the union: placed nowhere
        top += tl.sum(tl.where(rank[None, :] == rk[:, None], v[None, :], 0), axis=1)  # ranks are distinct
    return top


@triton.jit
def _best(kept, incoming, KP: tl.constexpr):
    """The network on a GPU, the rank count in the interpreter: the same keys
    (tests/test_indexer_topk.py runs both under the interpreter)."""
    if INTERPRETED:
        return _best_rank(kept, incoming, KP)
    else:
        return _best_network(kept, incoming, KP)


@triton.jit
def _merge_rows(buf_ptr, row_t, thr, BN: tl.constexpr, KP: tl.constexpr):
    """Per row: kept <- the best KP of kept (sorted, best first) and the row's incoming keys;
    incoming emptied. Returns each row's new threshold (its KP-th best key)."""
    rn = tl.arange(0, BN)
    rk = tl.arange(0, KP)
    tl.debug_barrier()  # every thread's appends are in memory
    for n in range(BN):
        t = tl.sum(tl.where(rn == n, row_t, 0), axis=0)  # its packed row (-1: padding)
        if t >= 0:
            base = buf_ptr + t * (2 * KP)
            top = _best(tl.load(base + rk), tl.load(base + KP + rk), KP)
            tl.debug_barrier()  # all reads of this row done before it is rewritten
            tl.store(base + rk, top)
            tl.store(base + KP + rk, tl.full((KP,), -9223372036854775807, tl.int64))
            thr = tl.where(rn == n, tl.min(top, axis=0), thr)
    tl.debug_barrier()  # the emptied incoming regions are in memory before new appends
    return thr


@triton.jit
def _indexer_topk_kernel(q_ptr, w_ptr, pages_ptr, elen_ptr, branch_ptr, rows_ptr, sel_ptr, len_ptr, tie_ptr,
                         score_ptr, buf_ptr, H, D, N, G, CP, EPP, KB, K, scale, tie_margin,
                         k_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                         FMT: tl.constexpr, MMA: tl.constexpr, CODES: tl.constexpr, BN: tl.constexpr,
                         BH: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    r0 = (pid % G) * BN  # the program's rows: req_rows[b, r0 : r0 + BN]
    rn = tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rc = tl.arange(0, BC)
    row_t = tl.load(rows_ptr + b * N + r0 + rn, mask=r0 + rn < N, other=-1).to(tl.int64)
    rn_ok = row_t >= 0
    row_buf = buf_ptr + tl.where(rn_ok, row_t, 0) * (2 * KP)  # each row's kept [0, KP) and incoming [KP, 2 KP) keys
    for c0 in range(0, 2 * KP, BC):
        tl.store(row_buf[:, None] + c0 + rc[None, :], -9223372036854775807, mask=rn_ok[:, None])
    n_e = tl.load(elen_ptr + b).to(tl.int32)
    c_width = CP * EPP
    BKB: tl.constexpr = BC // BN  # branch tiles: BKB own keys of each of the BN rows
    c_row = rc // BKB  # a branch tile column's row
    n_ct = tl.cdiv(n_e, BC)
    n_tiles = n_ct + tl.cdiv(KB, BKB)
    thr = tl.full((BN,), -9223372036854775807, tl.int64)  # a key must beat the row's KP-th best kept
    cnt = tl.zeros((BN,), tl.int32)  # keys in the row's incoming region
    # tiles of BC columns: the request's committed keys (read once for all its rows), then the rows'
    # own branch keys; every key above its row's threshold is appended; a merge when a row could
    # overflow, and one after the last tile
    for i in range(0, n_tiles + 1):
        per_row = tl.where(i < n_ct, BC, BKB)  # the most keys this tile can add to a row
        if (i == n_tiles) | (tl.max(cnt, axis=0) > KP - per_row):
            thr = _merge_rows(buf_ptr, row_t, thr, BN, KP)
            cnt = tl.zeros((BN,), tl.int32)
        if i < n_tiles:
            if i < n_ct:
                col = i * BC + rc
                ok = col < n_e
                e_page = tl.load(pages_ptr + b * CP + col // EPP, mask=ok, other=-1).to(tl.int64)
                ok = ok & (e_page >= 0)
                slot = e_page * EPP + col % EPP
                owner = tl.full((BC,), -1, tl.int32)
            else:
                own_j = (i - n_ct) * BKB + rc % BKB
                t_c = tl.load(rows_ptr + b * N + r0 + c_row, mask=r0 + c_row < N, other=-1).to(tl.int64)
                ok = (t_c >= 0) & (own_j < KB)
                slot = tl.load(branch_ptr + tl.where(ok, t_c, 0) * KB + own_j, mask=ok, other=-1).to(tl.int64)
                ok = ok & (slot >= 0)
                col = c_width + own_j
                owner = c_row
            keys, kscale = dot_keys(k_ptr, slot, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                                 FMT, MMA, CODES)
            s = _head_sum(q_ptr, w_ptr, row_t, rn_ok, keys, kscale, H, D, rd, BN, BH, BC, MMA) * scale
            mine = ok[None, :] & rn_ok[:, None] & ((owner[None, :] < 0) | (owner[None, :] == rn[:, None]))
            key = _pack(s, col[None, :], mine)
            take = key > thr[:, None]
            pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
            tl.store(row_buf[:, None] + KP + pos, key, mask=take)
            cnt += tl.sum(take.to(tl.int32), axis=1)
    # each row's first K kept columns -> entry slots; the (K+1)-th decides the tie flag
    rk = tl.arange(0, KP)
    for n in range(BN):
        t = tl.sum(tl.where(rn == n, row_t, 0), axis=0)  # its packed row (-1: padding)
        if t >= 0:
            kept = tl.load(buf_ptr + t * (2 * KP) + rk)
            score, col = _unpack(kept)
            valid = (kept != -9223372036854775807) & (rk < K)
            committed = col < c_width
            cc = tl.where(valid & committed, col, 0)
            page = tl.load(pages_ptr + b * CP + cc // EPP, mask=valid & committed, other=0).to(tl.int64)
            bc = tl.where(valid & ~committed, col - c_width, 0)
            own_slot = tl.load(branch_ptr + t * KB + bc, mask=valid & ~committed, other=-1).to(tl.int64)
            slot = tl.where(committed, page * EPP + cc % EPP, own_slot)
            out_ok = rk < K
            tl.store(sel_ptr + t * K + rk, tl.where(valid, slot, -1), mask=out_ok)
            tl.store(score_ptr + t * K + rk, tl.where(valid, score, float("-inf")), mask=out_ok)
            edge_key = tl.sum(tl.where(rk == K - 1, kept, 0), axis=0)
            next_key = tl.sum(tl.where(rk == K, kept, 0), axis=0)
            edge, _ = _unpack(edge_key)
            nxt, _ = _unpack(next_key)
            gap = tie_margin * tl.maximum(tl.abs(edge), tl.abs(nxt))
            tie = (next_key != -9223372036854775807) & ((edge - nxt) <= gap)
            tl.store(len_ptr + t, tl.sum(valid.to(tl.int64), axis=0))
            tl.store(tie_ptr + t, tie.to(tl.int64))


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
    bh = max(min(pow2(h, 1), max(1, 64 // bn)), -(-16 // bn))  # M = BN x BH: 64 (one warpgroup's MMA), >= 16
    kp = pow2(k + 1)  # keeps the (k+1)-th best for the tie flag
    mma = q.dtype == torch.bfloat16 and bf16_rows(fmt, one_scale=True)
    buf = torch.empty((t, 2 * kp), dtype=torch.int64, device=dev)  # per row: kept and incoming keys
    _indexer_topk_kernel[(b * groups,)](
        q, weights, entry_pages, entry_len, branch, req_rows, sel, lengths, ties, scores, buf, h, d, n, groups, cp, epp,
        kb, k, float(scale), TIE_MARGIN, *fmt.kernel_args(),
        FMT=fmt.fmt, MMA=mma, CODES=mma and fmt.fmt == INDEX_KEY_RECORD, BN=bn, BH=bh, BC=min(INDEXER_WIDE_TILE if bn <= 8 else 32, kp),
        KP=kp, BD=pow2(d), num_warps=8, **ALL_REGISTERS)  # at 4 warps (or BC 64 at BN 16) the V4 tiles spill: the aot gate
    return sel, lengths, ties, scores


def indexer_topk(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows, scale, topk):
    """Same contract as attention/torch_ops.indexer_topk -> (selected entry slots [T, k] int64, -1 =
    none; lengths [T]; ties [T]), k = min(topk, C + Kb) (C = entry_pages' width x epp)."""
    return indexer_topk_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows,
                               scale, topk)[:3]
