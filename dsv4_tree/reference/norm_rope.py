"""References for the row norm / RoPE kernels (kernels/norm_rope.py, kernels/kv_write.py):
transformers' DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm and apply_rotary_pos_emb written
plainly, with the two choices torch leaves to the platform pinned as the kernels make them:

* the mean square sums the fp32 squares as a pairwise tree over the row padded with zeros to a
  power of two ((x0^2 + x1^2) + (x2^2 + x3^2)) + ..., then divides by the row's length;
* rsqrt(v) is 1 / sqrt(v), sqrt and division each correctly rounded to fp32. They are computed
  in float64 and rounded once to fp32, which is the correctly rounded fp32 result for both ops
  (float64 carries more than 2 x 24 + 2 bits); torch's own fp32 sqrt / rsqrt on a CPU need not be.

ref_rms_norm(x, eps, weight=None): x [..., D] -> x's dtype. Weighted (DeepseekV4RMSNorm):
    (weight * (x.float() * r)).to(x.dtype); unweighted: x * r.to(x.dtype).
ref_rope(x, cos, sin, inverse=False): x [T, H, D] (or [T, D]), cos / sin [T, half] ->
    the trailing 2 * half channels rotated, pair (e, o) -> (e*c + (-o)*s, o*c + e*s) in fp32,
    one cast to x's dtype; inverse rotates with -sin (the attention output).
ref_norm_rope: the norm (if eps), then the RoPE (if cos / sin), as norm_rope.
ref_kv_write(pool, slots, kv, weight, eps, cos, sin): pool.write of rope(rms_norm(kv)) through the
    torch writer (serving/kv_pool.py; FP8 records by serving/records.py)."""
from __future__ import annotations

import torch


def _rn(x64: torch.Tensor) -> torch.Tensor:
    return x64.to(torch.float32)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> fp32 [..., 1]: the pairwise-tree sum of the fp32 squares over D."""
    d = x.shape[-1]
    s = x.float().square()
    width = 1
    while width < d:
        width *= 2
    s = torch.nn.functional.pad(s, (0, width - d))
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return _rn(s.double() / d)


def rsqrt(v: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(v) of fp32 v, each op correctly rounded to fp32."""
    root = _rn(v.double().sqrt())
    return _rn(1.0 / root.double())


def ref_rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    r = rsqrt(mean_square(x) + eps)
    if weight is None:
        return x * r.to(x.dtype)
    return (weight * (x.float() * r)).to(x.dtype)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    half = cos.shape[-1]
    if inverse:
        sin = -sin
    if x.dim() == 3:  # one table row per row, shared by its heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    c = cos.repeat_interleave(2, dim=-1)
    s = sin.repeat_interleave(2, dim=-1)
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    even, odd = rope[..., 0::2], rope[..., 1::2]
    swapped = torch.stack((-odd, even), dim=-1).flatten(-2)  # transformers' rotate_half
    rotated = rope.float() * c + swapped.float() * s
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def ref_norm_rope(x: torch.Tensor, eps: float | None = None, weight: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  inverse: bool = False) -> torch.Tensor:
    if eps is not None:
        x = ref_rms_norm(x, eps, weight)
    if cos is not None:
        x = ref_rope(x, cos, sin, inverse)
    return x


def ref_kv_write(pool, slots: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    pool.write(slots, ref_norm_rope(kv, eps, weight, cos, sin))
