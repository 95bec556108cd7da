"""Lightning-indexer scores of per-row candidate lists read from a paged key pool.

    score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[cand[t, c]]),  -inf where cand < 0

One program per (row, tile of BC candidates): the row's query heads [HI, dI] stay in registers,
the candidates' keys are gathered from pool storage (FP8 KV or indexer-key records dequantised in
the kernel), and the head-weighted ReLU sum is reduced in place, BHC heads at a time (at most
16 x dI query values live: V4's 64 x 128 heads in one tile used all 255 registers and spilled).
Dots (`_dot.py`): bf16 tensor-core dots with fp32 accumulation (MMA) for bf16 queries over keys
exact in bf16 (bf16 rows, FP8 KV records, or an FP8 index key's e4m3 codes with its block scale
applied to the dot), else fp32 inputs with `input_precision="ieee"` (never TF32).
`indexer_paged_scores` runs the same kernel with each row reading its request's candidate row
(the committed keys through the request's entry page table, no per-row table).
Reference: dsv4_tree.reference.sparse_decode.ref_indexer_gather_scores / ref_indexer_paged_scores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import INDEX, check, check_device, check_index_query, pow2
from ._dot import dot, operand
from ._pool_rows import INDEX_KEY_RECORD, bf16_rows, dot_keys, pool_format


@triton.jit
def _indexer_gather_kernel(q_ptr, w_ptr, cand_ptr, crow_ptr, len_ptr, out_ptr, H, D, C, CP, EPP, scale,
                           k_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                           FMT: tl.constexpr, PAGED: tl.constexpr, MMA: tl.constexpr, CODES: tl.constexpr,
                           BHC: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    rd = tl.arange(0, BD)
    cmask = rc < C
    if PAGED:  # candidate c of the row's request: entry_pages[request, c // EPP] * EPP + c % EPP
        crow = tl.load(crow_ptr + t).to(tl.int64)
        n = tl.load(len_ptr + crow)
        page = tl.load(cand_ptr + crow * CP + rc // EPP, mask=cmask & (rc < n), other=-1).to(tl.int64)
        ids = tl.where(page >= 0, page * EPP + rc % EPP, -1)
    else:
        ids = tl.load(cand_ptr + t.to(tl.int64) * C + rc, mask=cmask, other=-1)
    ok = ids >= 0
    keys, kscale = dot_keys(k_ptr, ids, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT, MMA,
                            CODES)
    kt = tl.trans(keys)
    score = tl.zeros((BC,), tl.float32)
    for h0 in range(0, H, BHC):
        rh = h0 + tl.arange(0, BHC)
        hmask = rh < H
        qrow = t.to(tl.int64) * H + rh
        q = tl.load(q_ptr + qrow[:, None] * D + rd[None, :], mask=hmask[:, None] & (rd[None, :] < D), other=0.0)
        w = tl.load(w_ptr + qrow, mask=hmask, other=0.0).to(tl.float32)
        dots = dot(operand(q, MMA), kt, MMA) * kscale[None, :]  # [BHC, BC]
        score += tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    score = score * scale
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * C + rc, score, mask=cmask)


def indexer_gather_scores(q, weights, keys, cand, scale):
    """Same contract as ref_indexer_gather_scores -> [T, C] fp32 (-inf where cand < 0)."""
    return _launch(q, weights, keys, cand, None, scale)


def indexer_paged_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, req_rows, row_slot, scale):
    """Same contract as ref_indexer_paged_scores -> [T, Cp * epp] fp32: each row reads the entry
    pages of its request (row_slot // N) and computes its slots in the kernel."""
    check("req_rows", req_rows, 2, INDEX)
    check("row_slot", row_slot, 1, INDEX)
    check("entry_len", entry_len, 1, INDEX)
    if row_slot.shape[0] != q.shape[0]:
        raise InputError(f"row_slot has {row_slot.shape[0]} rows, q has {q.shape[0]}")
    if entry_len.shape[0] != entry_pages.shape[0]:
        raise InputError(f"entry_len has {entry_len.shape[0]} requests, entry_pages {entry_pages.shape[0]}")
    crow = (row_slot // req_rows.shape[1]).contiguous()
    return _launch(q, weights, keys, entry_pages, crow, scale, entry_len.contiguous(), int(entries_per_page))


def _launch(q, weights, keys, cand, crow, scale, lengths=None, epp: int = 1):
    t, h, d = check_index_query(q, weights, scale)
    check("cand", cand, 2, INDEX)
    if crow is None and cand.shape[0] != t:
        raise InputError(f"cand has {cand.shape[0]} rows, q has {t}")
    fmt = pool_format("keys", keys)
    if fmt.head_dim != d:
        raise InputError(f"keys has head_dim {fmt.head_dim}, q has head_dim {d}")
    check_device(q, weights, cand, fmt.storage)
    cp = cand.shape[1]
    c = cp * epp if crow is not None else cp
    out = torch.empty(t, c, dtype=torch.float32, device=q.device)
    if t == 0 or c == 0:
        return out
    bc = 16
    mma = q.dtype == torch.bfloat16 and bf16_rows(fmt, one_scale=True)
    _indexer_gather_kernel[(t, triton.cdiv(c, bc))](
        q, weights, cand, cand if crow is None else crow, cand if lengths is None else lengths, out, h, d, c, cp,
        epp, float(scale), *fmt.kernel_args(),
        FMT=fmt.fmt, PAGED=crow is not None, MMA=mma, CODES=mma and fmt.fmt == INDEX_KEY_RECORD,
        BHC=16, BC=bc, BD=pow2(d))  # BHC 16: a dot needs M >= 16
    return out
