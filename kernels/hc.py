"""mHC boundary kernels: one launch for a block's pre side, one for its post side.

    post, comb, x = hc_pre(module, streams, norm)     # hc_weights + the block's input norm
    new_streams   = hc_post(post, comb, out, streams)  # hc_merge

hc_pre, one program per row: the flat streams' RMS (unweighted input_norm), the mix GEMV
against `fn` [(2+hc)*hc, hc*d] (fp32 accumulation; `fn` read in its own dtype, widened exactly),
the affine maps, sigmoid gates, the comb softmax and all `hc_sinkhorn_iters` Sinkhorn-Knopp
normalisations on the [hc, hc] matrix in registers, then the collapsed block input (pre-weighted
sum of the streams, rounded to the streams' dtype) and the layer's RMSNorm over it (the norm's
formula of transformers' module: fp32, weight times x * rsqrt(mean(x^2) + eps), one cast).
The collapsed row is computed twice (for its mean square, then normed) instead of going through
memory, so no barrier is needed.

hc_post, one program per (row, channel block): post * out + comb^T @ streams, each product and
sum rounded to the streams' dtype where torch's bf16 ops round (numerics/hc.py: hc_merge).
Roundings to bf16 go through kernels/_rounding.py (the interpreter truncates a plain cast).

Same formulas and order as numerics/hc.py except the order of the GEMV's and the comb^T @
streams sums (tests/test_hc_kernels.py states the bound). hc must be a power of two (V4: 4).
Reference: dsv4_tree.reference.hc (ref_hc_pre, ref_hc_post)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, check, check_device, pow2
from ._rounding import round_to


@triton.jit
def _mix_pass(s_row, fn_ptr, K, r, ri, rj, HC: tl.constexpr, BK: tl.constexpr):
    """The normed flat row (x * r) against fn's pre / post / comb rows: [HC], [HC], [HC, HC]."""
    acc_pre = tl.zeros((HC,), dtype=tl.float32)
    acc_post = tl.zeros((HC,), dtype=tl.float32)
    acc_comb = tl.zeros((HC, HC), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        f = tl.load(s_row + rk, mask=km, other=0.0).to(tl.float32) * r
        w_pre = tl.load(fn_ptr + ri[:, None].to(tl.int64) * K + rk[None, :], mask=km[None, :], other=0.0)
        w_post = tl.load(fn_ptr + (HC + ri[:, None]).to(tl.int64) * K + rk[None, :], mask=km[None, :], other=0.0)
        crow = (2 * HC + ri[:, None, None] * HC + rj[None, :, None]).to(tl.int64)
        w_comb = tl.load(fn_ptr + crow * K + rk[None, None, :], mask=km[None, None, :], other=0.0)
        acc_pre += tl.sum(w_pre.to(tl.float32) * f[None, :], axis=1)
        acc_post += tl.sum(w_post.to(tl.float32) * f[None, :], axis=1)
        acc_comb += tl.sum(w_comb.to(tl.float32) * f[None, None, :], axis=2)
    return acc_pre, acc_post, acc_comb


@triton.jit
def _collapse(s_row, pre, ri, rd, D, OUT_DTYPE: tl.constexpr):
    """sum_h pre[h] * streams[h, rd] in fp32, rounded to the streams' dtype (then widened)."""
    dm = rd < D
    s = tl.load(s_row + ri[:, None] * D + rd[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    return round_to(tl.sum(pre[:, None] * s, axis=0), OUT_DTYPE)


@triton.jit
def _hc_pre_kernel(s_ptr, fn_ptr, scale_ptr, base_ptr, w_ptr, post_ptr, comb_ptr, x_ptr,
                   D, K, mix_eps, hc_eps, norm_eps,
                   ITERS: tl.constexpr, HC: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                   OUT_DTYPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + t * K
    ri = tl.arange(0, HC)
    rj = tl.arange(0, HC)
    # the unweighted input_norm of the flat streams: x * rsqrt(mean(x^2) + eps)
    sq = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(s_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        sq += x * x
    r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + mix_eps)
    acc_pre, acc_post, acc_comb = _mix_pass(s_row, fn_ptr, K, r, ri, rj, HC, BK)
    s0 = tl.load(scale_ptr).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    z_pre = acc_pre * s0 + tl.load(base_ptr + ri).to(tl.float32)
    z_post = acc_post * s1 + tl.load(base_ptr + HC + ri).to(tl.float32)
    z_comb = acc_comb * s2 + tl.load(base_ptr + 2 * HC + ri[:, None] * HC + rj[None, :]).to(tl.float32)
    pre = tl.sigmoid(z_pre) + hc_eps
    post = 2 * tl.sigmoid(z_post)
    e = tl.exp(z_comb - tl.max(z_comb, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * HC + ri, post)
    tl.store(comb_ptr + t * HC * HC + ri[:, None] * HC + rj[None, :], comb)
    # the collapsed block input, then the layer's RMSNorm over it (computed twice, not stored)
    sq_d = tl.zeros((BD,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        c = _collapse(s_row, pre, ri, d0 + tl.arange(0, BD), D, OUT_DTYPE)
        sq_d += c * c
    rn = 1.0 / tl.sqrt(tl.sum(sq_d, axis=0) / D + norm_eps)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        c = _collapse(s_row, pre, ri, rd, D, OUT_DTYPE)
        w = tl.load(w_ptr + rd, mask=rd < D, other=0.0).to(tl.float32)
        tl.store(x_ptr + t * D + rd, round_to(w * (c * rn), OUT_DTYPE).to(OUT_DTYPE), mask=rd < D)


@triton.jit
def _hc_post_kernel(post_ptr, comb_ptr, out_ptr, s_ptr, new_ptr, D,
                    HC: tl.constexpr, BD: tl.constexpr, OUT_DTYPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = rd < D
    ri = tl.arange(0, HC)
    post = round_to(tl.load(post_ptr + t * HC + ri), OUT_DTYPE)  # [HC] (h)
    comb = round_to(tl.load(comb_ptr + t * HC * HC + ri[:, None] * HC + ri[None, :]), OUT_DTYPE)  # [i, h]
    out = tl.load(out_ptr + t * D + rd, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + t * HC * D + ri[:, None] * D + rd[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    mixed = round_to(tl.sum(comb[:, :, None] * s[:, None, :], axis=0), OUT_DTYPE)  # [h, BD]
    expanded = round_to(post[:, None] * out[None, :], OUT_DTYPE)
    new = round_to(expanded + mixed, OUT_DTYPE).to(OUT_DTYPE)
    tl.store(new_ptr + t * HC * D + ri[:, None] * D + rd[None, :], new, mask=dm[None, :])


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _check_hc(hc: int) -> None:
    if hc < 1 or hc & (hc - 1):
        raise InputError(f"hc_mult must be a power of two for the mHC kernels, got {hc}")


def hc_pre(module, streams: torch.Tensor, norm):
    """Same contract as numerics/hc.py hc_pre: streams [B, S, hc, d] -> (post [B, S, hc] fp32,
    comb [B, S, hc, hc] fp32, norm(collapsed) [B, S, d] in the streams' dtype)."""
    check("streams", streams, 4, FLOATS)
    b, s, hc, d = streams.shape
    _check_hc(hc)
    if hc != module.hc_mult:
        raise InputError(f"streams hold {hc} streams, the module mixes hc_mult={module.hc_mult}")
    fn, scale, base = module.fn.detach(), module.scale.detach(), module.base.detach()
    w = norm.weight.detach()
    for name, t, dims in (("fn", fn, 2), ("scale", scale, 1), ("base", base, 1), ("norm.weight", w, 1)):
        check(name, t, dims, FLOATS)
    if fn.shape != ((2 + hc) * hc, hc * d) or base.shape != ((2 + hc) * hc,) or scale.shape != (3,) or w.shape != (d,):
        raise InputError(f"mHC weights fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)}, "
                         f"norm {tuple(w.shape)} do not fit hc={hc}, d={d}")
    check_device(streams, fn, scale, base, w)
    rows = b * s
    post = torch.empty(b, s, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(b, s, hc, hc, dtype=torch.float32, device=streams.device)
    x = torch.empty(b, s, d, dtype=streams.dtype, device=streams.device)
    if rows:
        _hc_pre_kernel[(rows,)](streams, fn, scale, base, w, post, comb, x, d, hc * d, module.input_norm.eps,
                                module.hc_eps, norm.variance_epsilon, ITERS=module.hc_sinkhorn_iters, HC=hc,
                                BK=min(pow2(hc * d), 1024), BD=min(pow2(d), 1024), OUT_DTYPE=_TL[streams.dtype])
    return post, comb, x


def hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Same contract as numerics/hc.py hc_merge: post [B, S, hc], comb [B, S, hc, hc], out
    [B, S, d], streams [B, S, hc, d] -> the streams after the block, in the streams' dtype."""
    check("streams", streams, 4, FLOATS)
    b, s, hc, d = streams.shape
    _check_hc(hc)
    check("post", post, 3, (torch.float32,))
    check("comb", comb, 4, (torch.float32,))
    check("out", out, 3, FLOATS)
    if post.shape != (b, s, hc) or comb.shape != (b, s, hc, hc) or out.shape != (b, s, d):
        raise InputError(f"post {tuple(post.shape)}, comb {tuple(comb.shape)}, out {tuple(out.shape)} do not fit "
                         f"streams {tuple(streams.shape)}")
    if out.dtype != streams.dtype:
        raise InputError(f"out dtype {out.dtype} differs from the streams' {streams.dtype}")
    check_device(post, comb, out, streams)
    new = torch.empty_like(streams)
    if b * s:
        bd = min(pow2(d), 256)
        _hc_post_kernel[(b * s, triton.cdiv(d, bd))](post, comb, out, streams, new, d, HC=hc, BD=bd,
                                                     OUT_DTYPE=_TL[streams.dtype])
    return new
