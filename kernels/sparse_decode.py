"""Sparse decode over paged KV pools, in FlashMLA's sparse-decode argument form.

    out, lse = sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv, extra_indices, extra_lengths)

One program per (row, head block): it walks the row's index list into the main pool (SWA rows),
then the one into the extra pool (C4 / C128 entries), `BK` slots per step and only up to the row's
length; each tile of K=V rows is read straight from pool storage (FP8 records dequantised in the
kernel, `_pool_rows.py`), folded in with an online softmax, and the sink is merged at the end:
out = acc / (l + e^(sink - m)),  lse = m + log(l) (real keys only; +inf for a row with no key).
Dots take fp32 inputs with `input_precision="ieee"` (never TF32), whatever the storage dtype: keys
are dequantised to fp32 and bf16 queries widened (bf16 dot inputs would be exact for bf16 / FP8
pools, but the interpreter's bf16 tl.dot is wrong in triton 3.9, so that path could not be tested).
Nothing here synchronises the host: every size comes from a tensor shape.
Reference: dsv4_tree.reference.sparse_decode.ref_sparse_decode."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, INDEX, check, check_device, check_scale, pow2
from ._pool_rows import PoolFormat, load_pool_rows, pool_format


@triton.jit
def _attend(q, m_i, l_i, acc, t, idx_ptr, len_ptr, K, kv_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES,
            FP8_DIM, TILE, D, scale, rd, FMT: tl.constexpr, BK: tl.constexpr):
    """Fold row t's keys of one pool into the running (m, l, acc) of a head block."""
    n_keys = tl.minimum(tl.load(len_ptr + t).to(tl.int32), K)
    for k0 in range(0, n_keys, BK):
        rk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + t.to(tl.int64) * K + rk, mask=rk < n_keys, other=-1)
        ok = idx >= 0
        kv = load_pool_rows(kv_ptr, idx, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT)
        logits = tl.dot(q, tl.trans(kv), input_precision="ieee")
        logits = tl.where(ok[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf on rows without keys yet
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(logits - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sparse_decode_kernel(
    q_ptr, sink_ptr, out_ptr, lse_ptr, H, D, scale,
    idx_ptr, len_ptr, K, kv_ptr, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
    xidx_ptr, xlen_ptr, XK, xkv_ptr, XPAGE, XPAGE_BYTES, XDATA_BYTES, XSCALE_BYTES, XFP8_DIM, XTILE,
    FMT: tl.constexpr, XFMT: tl.constexpr, HAS_EXTRA: tl.constexpr,
    BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    rd = tl.arange(0, BD)
    hmask = rh < H
    qrow = t.to(tl.int64) * H + rh
    q = tl.load(q_ptr + qrow[:, None] * D + rd[None, :], mask=hmask[:, None] & (rd[None, :] < D), other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BD), tl.float32)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, t, idx_ptr, len_ptr, K, kv_ptr, PAGE, PAGE_BYTES, DATA_BYTES,
                            SCALE_BYTES, FP8_DIM, TILE, D, scale, rd, FMT, BK)
    if HAS_EXTRA:
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, t, xidx_ptr, xlen_ptr, XK, xkv_ptr, XPAGE, XPAGE_BYTES,
                                XDATA_BYTES, XSCALE_BYTES, XFP8_DIM, XTILE, D, scale, rd, XFMT, BK)
    sink = tl.load(sink_ptr + rh, mask=hmask, other=0.0).to(tl.float32)
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i + tl.exp(sink - m_ref)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # a row with no key: acc = 0 -> out = 0
    lse = tl.where(l_i > 0, m_ref + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(out_ptr + qrow[:, None] * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & (rd[None, :] < D))
    tl.store(lse_ptr + qrow, lse, mask=hmask)


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


def sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None):
    """Same contract as ref_sparse_decode -> (out [T, H, d] in q.dtype, lse [T, H] fp32)."""
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
    tensors = [q, indices, lengths, sinks, main.storage]
    extra = main
    if has_extra:
        extra = _pool_for("extra_kv", extra_kv, d)
        _check_table("extra_indices", extra_indices, "extra_lengths", extra_lengths, t)
        tensors += [extra_indices, extra_lengths, extra.storage]
    else:
        extra_indices, extra_lengths = indices, lengths  # never read (HAS_EXTRA=False)
    check_device(*tensors)
    out = torch.empty_like(q)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0 or h == 0:
        return out, lse
    bh = 16  # tl.dot needs M >= 16; padded heads are masked
    _sparse_decode_kernel[(t, triton.cdiv(h, bh))](
        q, sinks, out, lse, h, d, float(scale),
        indices, lengths, indices.shape[1], *main.kernel_args(),
        extra_indices, extra_lengths, extra_indices.shape[1], *extra.kernel_args(),
        FMT=main.fmt, XFMT=extra.fmt, HAS_EXTRA=has_extra, BH=bh, BK=16, BD=pow2(d))
    return out, lse
