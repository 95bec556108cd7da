"""Branch compressor: pool each closing node's gathered source rows into one entry.

entry[e, c] = RMSNorm_c( sum_r softmax_r(gate[e, :, c]) * kv[e, r, c] ), fp32 inside; RoPE at
the block start is then applied with the model's rotary helper.
Reference: dsv4_tree.reference.ref_pool_entries."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import FLOATS, check, check_device, pow2


@triton.jit
def _pool_norm_kernel(kv_ptr, gate_ptr, w_ptr, out_ptr, R, D, eps,
                      BR: tl.constexpr, BD: tl.constexpr):
    """One entry: its R source rows BR at a time with a running softmax per channel (max m,
    sum l of e^(gate - m), sum acc of e^(gate - m) kv), so at most BR x BD values are live (the
    C128 compressor's 128 x 512 rows in one tile spilled)."""
    e = tl.program_id(0)
    rd = tl.arange(0, BD)
    m = tl.full((BD,), float("-inf"), tl.float32)
    l_c = tl.zeros((BD,), tl.float32)
    acc = tl.zeros((BD,), tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        mask = (rr[:, None] < R) & (rd[None, :] < D)
        base = e * R * D + rr[:, None] * D + rd[None, :]
        kv = tl.load(kv_ptr + base, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + base, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(gate, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding channels: keep arithmetic finite
        alpha = tl.exp(m - m_ref)
        p = tl.exp(gate - m_ref[None, :])
        l_c = l_c * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    pooled = tl.where(rd < D, acc / l_c, 0.0)
    var = tl.sum(pooled * pooled, axis=0) / D
    w = tl.load(w_ptr + rd, mask=rd < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + e * D + rd, w * (pooled / tl.sqrt(var + eps)), mask=rd < D)


def pool_entries(kv, gate, kv_norm, cos, sin, apply_rope):
    """Same contract as ref_pool_entries: kv, gate [E, R, d] -> [E, d]."""
    check("kv", kv, 3, FLOATS)
    check("gate", gate, 3, FLOATS)
    if kv.shape != gate.shape:
        raise ValueError(f"kv {tuple(kv.shape)} and gate {tuple(gate.shape)} differ")
    e, r, d = kv.shape
    if e == 0:
        return kv.new_zeros((0, d))
    weight = kv_norm.weight.detach().contiguous()
    check_device(kv, gate, weight)
    out = torch.empty(e, d, dtype=torch.float32, device=kv.device)
    _pool_norm_kernel[(e,)](kv, gate, weight, out, r, d, kv_norm.variance_epsilon, BR=min(pow2(r, 2), 16), BD=pow2(d))
    pooled = out.to(kv.dtype).unsqueeze(0)
    return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1).squeeze(0)
