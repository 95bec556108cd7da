"""RMSNorm and V4's interleaved RoPE of row tensors in one launch (the attention rows' query
norms, the indexer query's RoPE, the inverse RoPE of the attention output).

    out = norm_rope(x, eps, weight)                    # q_a_norm: weighted RMSNorm
    out = norm_rope(x, eps, cos=cos, sin=sin)          # q_b_norm (unweighted), then RoPE
    out = norm_rope(x, cos=cos, sin=sin, inverse=True)  # RoPE with -sin only

x [T, D] or [T, H, D] (any row / head strides, unit channel stride) -> a fresh contiguous
tensor of x's shape and dtype. One program per (row, head) holds the row as D / 2 channel pairs.

The formulas are transformers' (DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm,
apply_rotary_pos_emb) with two choices pinned where torch leaves them to the platform, so that
the reference (dsv4_tree/reference/norm_rope.py) computes the same operations in the same order
and the result is bitwise the same in the interpreter and on a GPU:
* the mean square sums the fp32 squares as a pairwise tree over the row padded with zeros to a
  power of two, ((x0^2 + x1^2) + (x2^2 + x3^2)) + ..., then divides by D (each level adds two
  terms: no reduction order is left to the compiler);
* rsqrt(v) is 1 / sqrt(v), sqrt and division each correctly rounded (tl.sqrt_rn, tl.div_rn).
Weighted: weight * (x * r) in fp32, one rounding to x's dtype; unweighted: x * r with r
rounded to x's dtype first, the product rounded to x's dtype. RoPE rotates the trailing
2 * half channels of the (normed, rounded) row, pair (e, o) -> (e*c + (-o)*s, o*c + e*s) in
fp32 from the model-dtype cos / sin, rounded once to x's dtype; the nope channels pass through.
Launches pass enable_fp_fusion=False (no multiply-add contraction: torch multiplies and adds
separately). Roundings to bf16 use kernels/_rounding.py (the interpreter truncates a plain cast).
On the meta device the launcher allocates its output and launches nothing (kernels/_meta.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, check, check_device, pow2
from ._meta import on_meta
from ._rounding import round_to

ROW_DTYPES = (torch.float32, torch.bfloat16)
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@triton.jit
def _tree_sum(v, BP: tl.constexpr, LOG_BP: tl.constexpr):
    """Sum of v [BP, 2] (flat channel order 2p + j) as a pairwise tree: the tree over each of R
    rows of C = min(2 BP, 64) channels, then the tree over the R row sums (the same tree).
    The compile time depends on the form, not the sums: the flat tree halved LOG_BP times, or row
    sums reshaped from [R, 1], took Triton 3.6 two minutes at BP 1024 (V4-Pro's q_a_norm) and 15 s
    at 512; this form takes about a second under every version (design_notes/triton-versions.md)."""
    LOG_C: tl.constexpr = 6 if LOG_BP >= 6 else LOG_BP + 1
    C: tl.constexpr = 1 << LOG_C
    R: tl.constexpr = (2 * BP) >> LOG_C
    s = tl.reshape(v, (R, C))
    for i in tl.static_range(LOG_C):
        a, b = tl.split(tl.reshape(s, (R, C >> (i + 1), 2)))
        s = a + b
    s = tl.reshape(tl.sum(s, axis=1), (1, R))  # the row sums, in order ([R, 1] summed over its one column)
    for i in tl.static_range(LOG_BP + 1 - LOG_C):
        a, b = tl.split(tl.reshape(s, (1, R >> (i + 1), 2)))
        s = a + b
    return tl.sum(tl.sum(s, axis=1), axis=0)  # one element


@triton.jit
def _rms_norm_pairs(x, w_ptr, col, live, n, eps, NORM: tl.constexpr, BP: tl.constexpr, LOG_BP: tl.constexpr,
                    OUT_DTYPE: tl.constexpr):
    """x [BP, 2] fp32 (zeros past the row) -> the normed row, rounded to OUT_DTYPE (as fp32).
    NORM 1: weighted (weight * (x * r), one rounding); NORM 2: unweighted (x * round(r))."""
    ms = tl.div_rn(_tree_sum(x * x, BP, LOG_BP), n)
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    if NORM == 1:
        w = tl.load(w_ptr + col, mask=live, other=0.0).to(tl.float32)
        y = round_to(w * (x * r), OUT_DTYPE)
    else:
        y = round_to(x * round_to(r, OUT_DTYPE), OUT_DTYPE)
    return y


@triton.jit
def _rope_pairs(x, cos_row, sin_row, p, NOPE_PAIRS: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr,
                OUT_DTYPE: tl.constexpr):
    """x [BP, 2] fp32 -> pairs p >= NOPE_PAIRS rotated by (cos, sin)[p - NOPE_PAIRS], rounded to
    OUT_DTYPE; the other pairs as they are."""
    e, o = tl.split(x)
    k = p - NOPE_PAIRS
    rm = (k >= 0) & (k < HALF)
    c = tl.load(cos_row + k, mask=rm, other=1.0).to(tl.float32)
    s = tl.load(sin_row + k, mask=rm, other=0.0).to(tl.float32)
    # no unary minus: Triton 3.6 lowers -x as 0 - x (+0 for x = +0), torch negates the sign bit;
    # a - b is a + (-b) exactly in IEEE arithmetic, so these are the reference's sums bit for bit
    if INVERSE:  # sin -> -sin: (e*c + o*s, o*c - e*s)
        e2 = round_to(e * c + o * s, OUT_DTYPE)
        o2 = round_to(o * c - e * s, OUT_DTYPE)
    else:
        e2 = round_to(e * c - o * s, OUT_DTYPE)
        o2 = round_to(o * c + e * s, OUT_DTYPE)
    return tl.join(tl.where(rm, e2, e), tl.where(rm, o2, o))


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, D, stride_xt, stride_xh, stride_ct, n, eps,
                      NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, NOPE_PAIRS: tl.constexpr,
                      HALF: tl.constexpr, BP: tl.constexpr, LOG_BP: tl.constexpr, OUT_DTYPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, BP)
    col = 2 * p[:, None] + tl.arange(0, 2)[None, :]  # [BP, 2]
    live = col < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + col, mask=live, other=0.0).to(tl.float32)
    if NORM != 0:
        x = _rms_norm_pairs(x, w_ptr, col, live, n, eps, NORM, BP, LOG_BP, OUT_DTYPE)
    if ROPE:
        x = _rope_pairs(x, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, p, NOPE_PAIRS, HALF, INVERSE, OUT_DTYPE)
    tl.store(out_ptr + (t * H + h) * D + col, x.to(OUT_DTYPE), mask=live)


def check_eps(eps) -> None:
    """A norm's epsilon must be a host number (a device scalar would sync the host)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise InputError(f"eps must be a Python float, got {type(eps).__name__}")


def check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, t: int, width: int) -> int:
    """cos, sin [T, half] (float, contiguous) rotating the trailing 2 * half of `width`
    channels -> half."""
    check("cos", cos, 2, FLOATS)
    check("sin", sin, 2, FLOATS)
    if cos.shape != sin.shape or cos.shape[0] != t:
        raise InputError(f"cos and sin must both be [T={t}, half], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    half = cos.shape[1]
    if width % 2 or 2 * half > width:
        raise InputError(f"cos / sin rotate {2 * half} trailing channels of an even width, got width {width}")
    return half


def pair_block(d: int) -> tuple[int, int]:
    """(BP, log2 BP): the power of two of channel pairs that holds a row of d channels."""
    bp = pow2(-(-d // 2), 1)
    return bp, bp.bit_length() - 1


def norm_rope(x: torch.Tensor, eps=None, weight: torch.Tensor | None = None, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D] fp32 / bf16. eps: RMSNorm over D (weighted when weight [D] is given,
    else unweighted); cos, sin [T, half]: then RoPE on the trailing 2 * half channels (inverse:
    with -sin). -> contiguous, x's shape and dtype. Reference: ref_norm_rope."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise InputError(f"x must be a [T, D] or [T, H, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    check("x", x, x.dim(), ROW_DTYPES, contiguous=False)
    if x.stride(-1) != 1:
        raise InputError(f"x must have unit channel stride, got strides {x.stride()}")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, d = x3.shape
    tensors = [x]
    if eps is None and weight is not None:
        raise InputError("weight without eps: a weighted RMSNorm needs its eps")
    if eps is not None:
        check_eps(eps)
        if weight is not None:
            check("weight", weight, 1, FLOATS)
            if weight.shape[0] != d:
                raise InputError(f"weight must be [D={d}], got {tuple(weight.shape)}")
            tensors.append(weight)
    if (cos is None) != (sin is None):
        raise InputError("cos and sin must be given together (or neither)")
    if eps is None and cos is None:
        raise InputError("norm_rope needs eps (an RMSNorm) or cos / sin (a RoPE), got neither")
    half = 0
    if cos is not None:
        half = check_rope_tables(cos, sin, t, d)
        tensors += [cos, sin]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if on_meta(*tensors):
        return out
    check_device(*tensors)
    if t == 0 or h == 0:
        return out
    bp, log_bp = pair_block(d)
    _norm_rope_kernel[(t, h)](
        x3, weight if weight is not None else x3, cos if cos is not None else x3, sin if sin is not None else x3, out,
        h, d, x3.stride(0), x3.stride(1), cos.stride(0) if cos is not None else 0, float(d),
        float(eps) if eps is not None else 0.0,
        NORM=0 if eps is None else (1 if weight is not None else 2), ROPE=cos is not None, INVERSE=bool(inverse),
        NOPE_PAIRS=d // 2 - half, HALF=half, BP=bp, LOG_BP=log_bp, OUT_DTYPE=_TL[x.dtype],
        enable_fp_fusion=False)
    return out
