"""Sparse decode over paged KV pools, in FlashMLA's sparse-decode argument form.

    out, lse = sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv, extra_indices, extra_lengths)

One program per (row, head block): it walks the row's index list into the main pool (SWA rows),
then the one into the extra pool (C4 / C128 entries), `BK` slots per step and only up to the row's
length; each tile of K=V rows is read straight from pool storage (FP8 records dequantised in the
kernel, `_pool_rows.py`), folded in with an online softmax, and the sink is merged at the end:
out = acc / (l + e^(sink - m)),  lse = m + log(l) (real keys only; +inf for a row with no key).
Dots (`_dot.py`): with MMA (bf16 queries over bf16 or FP8 pools, whose values are exact in bf16)
QK and PV are bf16 tensor-core dots with fp32 accumulation, the softmax weights P rounded to bf16
as a bf16 model's attention rounds them (the one rounding this form adds: relative 2^-9 per weight);
otherwise fp32 inputs with `input_precision="ieee"` (never TF32). A tile holds at most 16 (row,
head) pairs at head_dim 512 (64 at 128 and below), so the fp32 accumulator [pairs, head_dim] stays
in registers (`_pairs`).
The record layout's e4m3 width and scale tile are compile-time constants (one pair per model): as
runtime ints, the per-column offsets derived from them stayed live across the kernel's three
loops, and Triton 3.6 spilled the grouped decode at head_dim 512 (docs/gpu-check.md).
Nothing here synchronises the host: every size comes from a tensor shape.
Reference: dsv4_tree.reference.sparse_decode.ref_sparse_decode."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._dot import dot, operand
from ._launch import ALL_REGISTERS, FLOATS, INDEX, check, check_device, check_scale, pow2
from ._meta import on_meta
from ._version import wide_decode_stages
from ._pool_rows import PoolFormat, bf16_rows, load_pool_rows, pool_format


@triton.jit
def _attend(q, m_i, l_i, acc, cell0, t0, rows_ptr, N, m_row, idx_ptr, len_ptr, K, kv_ptr, PAGE, PAGE_BYTES, DATA_BYTES,
            SCALE_BYTES, FP8_DIM, TILE, D, scale, rd, FMT: tl.constexpr, GROUPED: tl.constexpr, BR: tl.constexpr,
            BK: tl.constexpr, MMA: tl.constexpr):
    """Fold the per-row index lists of one pool into the running (m, l, acc) of the tile's BM
    (row, head) pairs: BK keys of each of the tile's BR rows per step, a row's keys masked out of
    the other rows' logits (BR = 1 without a shared list). Grouped: the tile's rows are
    req_rows cells cell0 .. cell0 + min(BR, N) - 1; else the one row t0."""
    rc = tl.arange(0, BR * BK)
    c_row = rc // BK
    if GROUPED:
        t_c = tl.load(rows_ptr + cell0 + c_row, mask=c_row < N, other=-1).to(tl.int64)
    else:
        t_c = t0 + 0 * c_row.to(tl.int64)
    len_c = tl.where(t_c >= 0, tl.minimum(tl.load(len_ptr + tl.where(t_c >= 0, t_c, 0)).to(tl.int32), K), 0)
    n_keys = tl.max(len_c, axis=0)
    for k0 in range(0, n_keys, BK):
        kk = k0 + rc % BK
        live = kk < len_c
        idx = tl.load(idx_ptr + tl.where(live, t_c, 0) * K + kk, mask=live, other=-1)
        ok = idx >= 0
        kv = load_pool_rows(kv_ptr, idx, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT)
        mine = ok[None, :] & (m_row[:, None] == c_row[None, :])
        m_i, l_i, acc = _fold(q, kv, mine, m_i, l_i, acc, scale, MMA)
    return m_i, l_i, acc


@triton.jit
def _fold(qt, kv, mine, m_i, l_i, acc, scale, MMA: tl.constexpr):
    """One online-softmax step over a key tile kv [BC, BD] (mine [BM, BC]: which keys each query
    sees); qt is q^T [BD, BM], already a dot operand (`operand(., MMA)`). The logits are computed
    keys first, (K q^T)^T: the key tile, read per step, is the dot's left operand and q^T, held
    across the loops, the right one (as the left operand every warp held q whole; with the
    constexpr record layout this took the grouped decode at head_dim 512 under Triton 3.6 from
    72 bytes spilled to none)."""
    kv = operand(kv, MMA)
    logits = tl.trans(dot(kv, qt, MMA))
    logits = tl.where(mine, logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf on rows without keys yet
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(logits - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(operand(p, MMA), kv, MMA)
    return m_new, l_i, acc


@triton.jit
def _sparse_decode_kernel(
    q_ptr, sink_ptr, out_ptr, lse_ptr, H, D, scale,
    idx_ptr, len_ptr, K, kv_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM: tl.constexpr, TILE: tl.constexpr,
    xidx_ptr, xlen_ptr, XK, xkv_ptr, XPAGE, XPAGE_BYTES, XDATA_BYTES, XSCALE_BYTES, XFP8_DIM: tl.constexpr,
    XTILE: tl.constexpr,
    rows_ptr, N, G, spages_ptr, slen_ptr, SCP, SEPP,
    FMT: tl.constexpr, XFMT: tl.constexpr, HAS_EXTRA: tl.constexpr, GROUPED: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, MMA: tl.constexpr,
):
    # program (row t, head block) without a shared list; (request b x row group, head block) with
    # one: its tile holds BH heads of each of BR rows of the request (all of a tree's rows up to
    # BR = 16), so the shared entries are read once per group
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    r0 = (pid % G) * BR
    rm = tl.arange(0, BR * BH)
    m_row = rm // BH
    rh = tl.program_id(1) * BH + rm % BH
    rd = tl.arange(0, BD)
    if GROUPED:
        t_m = tl.load(rows_ptr + b * N + r0 + m_row, mask=r0 + m_row < N, other=-1).to(tl.int64)
    else:
        t_m = pid + 0 * m_row.to(tl.int64)
    live = (t_m >= 0) & (rh < H)
    qrow = tl.where(live, t_m, 0) * H + rh
    q = tl.load(q_ptr + qrow[:, None] * D + rd[None, :], mask=live[:, None] & (rd[None, :] < D), other=0.0)
    q = tl.trans(operand(q, MMA))  # q^T [BD, BM]: _fold's right operand
    m_i = tl.full((BR * BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BR * BH,), tl.float32)
    acc = tl.zeros((BR * BH, BD), tl.float32)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, b * N + r0, pid, rows_ptr, N - r0, m_row, idx_ptr, len_ptr, K, kv_ptr, PAGE,
                            PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, D, scale, rd, FMT, GROUPED, BR, BK, MMA)
    if HAS_EXTRA:
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, b * N + r0, pid, rows_ptr, N - r0, m_row, xidx_ptr, xlen_ptr, XK, xkv_ptr,
                                XPAGE, XPAGE_BYTES, XDATA_BYTES, XSCALE_BYTES, XFP8_DIM, XTILE, D, scale, rd, XFMT,
                                GROUPED, BR, BK, MMA)
    if GROUPED:  # the request's shared entries (extra pool), through its entry page table
        n_sh = tl.load(slen_ptr + b).to(tl.int32)
        for j0 in range(0, n_sh, BS):
            j = j0 + tl.arange(0, BS)
            ok = j < n_sh
            page = tl.load(spages_ptr + b * SCP + j // SEPP, mask=ok, other=-1).to(tl.int64)
            ok = ok & (page >= 0)
            kv = load_pool_rows(xkv_ptr, page * SEPP + j % SEPP, ok, rd, D, XPAGE, XPAGE_BYTES, XDATA_BYTES,
                                XSCALE_BYTES, XFP8_DIM, XTILE, XFMT)
            m_i, l_i, acc = _fold(q, kv, ok[None, :] & live[:, None], m_i, l_i, acc, scale, MMA)
    sink = tl.load(sink_ptr + rh, mask=rh < H, other=0.0).to(tl.float32)
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i + tl.exp(sink - m_ref)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # a row with no key: acc = 0 -> out = 0
    lse = tl.where(l_i > 0, m_ref + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(out_ptr + qrow[:, None] * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (rd[None, :] < D))
    tl.store(lse_ptr + qrow, lse, mask=live)


def _pairs(bd: int) -> int:
    """(row, head) pairs per tile: the fp32 accumulator [pairs, bd] at most 8192 values (64 per
    thread of 4 warps) and at most 64 pairs: 16 at head_dim 512 (without the cap the grouped
    path's 64 x 512 accumulator spills at every V4 shape), 64 at 128 and below."""
    return max(16, min(64, 8192 // bd))


def _check_table(name: str, idx: torch.Tensor, len_name: str, lengths: torch.Tensor, rows: int) -> None:
    check(name, idx, 2, INDEX)
    check(len_name, lengths, 1, INDEX)
    if idx.shape[0] != rows:
        raise InputError(f"{name} has {idx.shape[0]} rows, q has {rows}")
    if lengths.shape[0] != rows:
        raise InputError(f"{len_name} has {lengths.shape[0]} entries, q has {rows} rows")


def _pool_for(name: str, pool, d: int) -> PoolFormat:
    fmt = pool_format(name, pool)
    if fmt.head_dim != d:
        raise InputError(f"{name} has head_dim {fmt.head_dim}, q has head_dim {d}")
    return fmt


def _check_shared(shared_pages, shared_len, req_rows, extra, t: int) -> None:
    check("shared_pages", shared_pages, 2, INDEX)
    check("shared_len", shared_len, 1, INDEX)
    check("req_rows", req_rows, 2, INDEX)
    b = shared_pages.shape[0]
    if shared_len.shape[0] != b or req_rows.shape[0] != b:
        raise InputError(f"shared_len ({shared_len.shape[0]}) and req_rows ({req_rows.shape[0]}) must have "
                         f"shared_pages' {b} requests")
    if not extra:
        raise InputError("shared_pages index the extra pool: extra_kv, extra_indices and extra_lengths are needed")


def sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None,
                  shared_pages=None, shared_per_page=1, shared_len=None, req_rows=None):
    """Same contract as ref_sparse_decode -> (out [T, H, d] in q.dtype, lse [T, H] fp32). With a
    shared list (shared_pages, shared_per_page, shared_len, req_rows), one program per (request,
    group of up to 16 of its rows, head block) reads the request's shared entries once for all
    those rows; rows in no request (padding) output 0 with lse +inf."""
    check("q", q, 3, (torch.float32, torch.bfloat16))
    t, h, d = q.shape
    check_scale(scale)
    main = _pool_for("kv", kv, d)
    _check_table("indices", indices, "lengths", lengths, t)
    check("sinks", sinks, 1, FLOATS)  # read as fp32 in the kernel (a bf16 model's sinks are bf16)
    if sinks.shape[0] != h:
        raise InputError(f"sinks has {sinks.shape[0]} entries, q has {h} heads")
    extras = (extra_kv, extra_indices, extra_lengths)
    has_extra = extra_kv is not None
    if any(x is None for x in extras) != (not has_extra):
        raise InputError("extra_kv, extra_indices and extra_lengths must be given together (or none of them)")
    shared = (shared_pages, shared_len, req_rows)
    grouped = shared_pages is not None
    if any(x is None for x in shared) != (not grouped):
        raise InputError("shared_pages, shared_len and req_rows must be given together (or none of them)")
    tensors = [q, indices, lengths, sinks, main.storage]
    extra = main
    if has_extra:
        extra = _pool_for("extra_kv", extra_kv, d)
        _check_table("extra_indices", extra_indices, "extra_lengths", extra_lengths, t)
        tensors += [extra_indices, extra_lengths, extra.storage]
    else:
        extra_indices, extra_lengths = indices, lengths  # never read (HAS_EXTRA=False)
    if grouped:
        _check_shared(shared_pages, shared_len, req_rows, has_extra, t)
        if int(shared_per_page) < 1:
            raise InputError(f"shared_per_page must be >= 1, got {shared_per_page}")
        tensors += [shared_pages, shared_len, req_rows]
    else:
        shared_pages, shared_len, req_rows = indices, lengths, indices  # never read (GROUPED=False)
    meta = on_meta(*tensors)
    dev = q.device if meta else check_device(*tensors)
    out = torch.zeros_like(q) if grouped else torch.empty_like(q)  # grouped: padding rows are not visited
    lse = torch.full((t, h), float("inf"), dtype=torch.float32, device=dev)
    if t == 0 or h == 0 or meta:
        return out, lse
    n = req_rows.shape[1] if grouped else 1
    br = min(pow2(n, 1), 16) if grouped else 1
    groups = -(-n // br)
    pairs = _pairs(pow2(d))
    bh = 16 if not grouped else max(min(pow2(h, 1), max(1, pairs // br)), -(-16 // br))  # tl.dot: M >= 16
    mma = q.dtype == torch.bfloat16 and bf16_rows(main) and (not has_extra or bf16_rows(extra))
    bk = max(1, 16 // br)  # keys per row and step: a tile of max(16, BR) columns
    grid = (req_rows.shape[0] * groups if grouped else t, triton.cdiv(h, bh))
    _sparse_decode_kernel[grid](
        q, sinks, out, lse, h, d, float(scale),
        indices, lengths, indices.shape[1], *main.kernel_args(),
        extra_indices, extra_lengths, extra_indices.shape[1], *extra.kernel_args(),
        req_rows, n, groups, shared_pages, shared_len, shared_pages.shape[1], int(shared_per_page),
        FMT=main.fmt, XFMT=extra.fmt, HAS_EXTRA=has_extra, GROUPED=grouped, BR=br, BH=bh, BK=bk, BS=16, BD=pow2(d), MMA=mma,
        # head_dim 512: 4 warps or 3 stages spill; the grouped fp32 form (the tiny test model's tree
        # groups) spills up to 92 bytes at 4 warps (the aot gate); stages under 3.6: _version.py
        num_warps=8 if d > 256 or (grouped and not mma) else 4,
        num_stages=wide_decode_stages(has_extra) if d > 256 else 3, **ALL_REGISTERS)
    return out, lse
