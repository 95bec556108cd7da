"""Sparse shared-KV MQA with a per-head sink: the verify attention of every layer.

Two partial kernels produce (running max m, sum l, unnormalised acc) per (row, head); the
launcher merges them with the sink (cheap, [N, H, d]):
  * dense over keys every row sees (C128 committed entries): (row, head) pairs are flattened
    into one M dimension, so each loaded KV tile serves every row and head of the request;
  * gather over per-row index lists (window + path rows + branch entries, and C4 picks from
    the committed table), one program per (row, head block).
Every tile is fp32 in registers and every tl.dot runs with input_precision="ieee": Triton's
default on NVIDIA GPUs is TF32 (10-bit mantissa inputs), ~1e-3 relative error in logits.
Reference: dsv4_tree.reference.ref_sparse_mqa_sink."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import FLOATS, INDEX, check, check_device, pow2
from ._tiles import load_rows, store_partial


@triton.jit
def _online_softmax_step(m_i, l_i, acc, logits, kv):
    """Fold one tile of logits [BM, BK] (-inf = masked) and its K=V rows [BK, BD] in."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    # subtract a finite max so no lane forms -inf - -inf; rows with no key yet have l = acc = 0
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(logits - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")


@triton.jit
def _dense_partial_kernel(q_ptr, kv_ptr, m_ptr, l_ptr, acc_ptr, M, S, D, scale,
                          BM: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    rm = pid * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    q = load_rows(q_ptr, rm, rm < M, rd, D)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for s0 in range(0, S, BS):
        rs = s0 + tl.arange(0, BS)
        kv = load_rows(kv_ptr, rs, rs < S, rd, D)
        logits = tl.where(rs[None, :] < S, tl.dot(q, tl.trans(kv), input_precision="ieee") * scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, logits, kv)
    store_partial(m_ptr, l_ptr, acc_ptr, rm, rm < M, rd, D, m_i, l_i, acc)


@triton.jit
def _gather_partial_kernel(q_ptr, kv_ptr, idx_ptr, m_ptr, l_ptr, acc_ptr, H, K, D, scale,
                           BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0)
    hb = tl.program_id(1)
    rh = hb * BH + tl.arange(0, BH)
    rd = tl.arange(0, BD)
    hmask = rh < H
    q = load_rows(q_ptr, n * H + rh, hmask, rd, D)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BD), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + n * K + rk, mask=rk < K, other=-1)
        ok = idx >= 0
        kv = load_rows(kv_ptr, tl.where(ok, idx, 0), ok, rd, D)
        logits = tl.where(ok[None, :], tl.dot(q, tl.trans(kv), input_precision="ieee") * scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, logits, kv)
    store_partial(m_ptr, l_ptr, acc_ptr, n * H + rh, hmask, rd, D, m_i, l_i, acc)


def _empty_partial(n, h, d, device):
    return (torch.full((n, h), float("-inf"), device=device), torch.zeros(n, h, device=device),
            torch.zeros(n, h, d, device=device))


def dense_partial(q: torch.Tensor, kv: torch.Tensor, scale: float):
    n, h, d = q.shape
    if kv.shape[0] == 0:
        return _empty_partial(n, h, d, q.device)
    m_ = n * h
    m, l, acc = (torch.empty(m_, device=q.device), torch.empty(m_, device=q.device),
                 torch.empty(m_, d, device=q.device))
    bm, bs, bd = 16, 16, pow2(d)
    _dense_partial_kernel[(triton.cdiv(m_, bm),)](q, kv, m, l, acc, m_, kv.shape[0], d, scale, BM=bm, BS=bs, BD=bd)
    return m.view(n, h), l.view(n, h), acc.view(n, h, d)


def gather_partial(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, scale: float):
    n, h, d = q.shape
    if index.shape[1] == 0 or kv.shape[0] == 0:
        return _empty_partial(n, h, d, q.device)
    m, l, acc = torch.empty(n, h, device=q.device), torch.empty(n, h, device=q.device), torch.empty(n, h, d, device=q.device)
    bh, bk, bd = 16, 16, pow2(d)
    idx = index.contiguous()
    _gather_partial_kernel[(n, triton.cdiv(h, bh))](q, kv, idx, m, l, acc, h, idx.shape[1], d, scale,
                                                    BH=bh, BK=bk, BD=bd)
    return m, l, acc


def sparse_mqa_sink(q, shared_kv, local_kv, local_index, global_kv, global_index, sinks, scale):
    """Same contract as ref_sparse_mqa_sink. -> (out [N,H,d] in q's dtype, lse [N,H] fp32)."""
    check("q", q, 3, FLOATS, contiguous=False)  # small; copied to a packed layout below
    d = q.shape[2]
    for name, t in (("shared_kv", shared_kv), ("local_kv", local_kv), ("global_kv", global_kv)):
        check(name, t, 2, FLOATS)
        if t.shape[1] != d:
            raise ValueError(f"{name} has width {t.shape[1]}, q has head_dim {d}")
    for name, t in (("local_index", local_index), ("global_index", global_index)):
        check(name, t, 2, INDEX, contiguous=False)
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows, q has {q.shape[0]}")
    check("sinks", sinks, 1, FLOATS)
    check_device(q, shared_kv, local_kv, global_kv, local_index, global_index, sinks)
    q = q.contiguous()
    parts = [dense_partial(q, shared_kv, scale), gather_partial(q, local_kv, local_index, scale),
             gather_partial(q, global_kv, global_index, scale)]
    sink = sinks.float().view(1, -1).expand(q.shape[0], -1)
    m = torch.stack([p[0] for p in parts] + [sink]).amax(0)  # [N, H]
    l = torch.exp(sink - m)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for pm, pl, pacc in parts:
        w = torch.where(torch.isinf(pm), torch.zeros_like(pm), torch.exp(pm - m))
        l = l + pl * w
        acc = acc + pacc * w.unsqueeze(-1)
    return (acc / l.unsqueeze(-1)).to(q.dtype), m + torch.log(l)
