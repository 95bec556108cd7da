"""Release-format weight quantisation: FP8 e4m3 with one scale per 128x128 block, and FP4 (e2m1)
experts packed two per byte with one scale per 32 input columns of a row.

The layouts are the ones transformers' fine-grained FP8 integration reads (`quant_method="fp8"`,
`scale_fmt="float"`, `expert_dtype="fp4"`): the stored scale is the multiplier, named
`<module>.weight_scale_inv`, so `dequantised = q * scale` block by block.

Error bounds (round to nearest, used by the tests):
* FP8 e4m3 (3 mantissa bits): |w - deq| <= |w| / 16 + scale * 2**-10 (the second term covers
  e4m3 subnormals); scale = block amax / 448.
* FP4 e2m1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6): |w - deq| <= max(|w|, scale) / 4; scale = group amax / 6.
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128
FP4_GROUP = 32  # input columns sharing one scale
FP4_MAX = 6.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code c (0..7) = magnitude; code c + 8 = -magnitude


def fp8_block_shape_ok(shape, block: int = FP8_BLOCK) -> bool:
    """Whether a 2-D weight tiles exactly into block x block scale cells."""
    return len(shape) == 2 and shape[0] % block == 0 and shape[1] % block == 0


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [N, K] (N, K multiples of block) -> (q float8_e4m3fn [N, K], scale fp32 [N/block, K/block])."""
    if not fp8_block_shape_ok(w.shape, block):
        raise CheckpointError(f"FP8 block quantisation needs a 2-D weight with sides divisible by {block}, got {tuple(w.shape)}")
    n, k = w.shape
    cells = w.detach().float().reshape(n // block, block, k // block, block)
    amax = cells.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (cells / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale.contiguous()


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q [N, K] (float values, already unpacked) times scale [N/bn, K/bk] cell by cell."""
    n, k = q.shape
    sn, sk = scale.shape
    if n % sn or k % sk:
        raise CheckpointError(f"weight {tuple(q.shape)} does not tile into a {tuple(scale.shape)} scale grid")
    cells = q.float().reshape(sn, n // sn, sk, k // sk) * scale.float()[:, None, :, None]
    return cells.reshape(n, k).to(dtype)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP):
    """w [N, K] (K a multiple of group) -> (packed int8 [N, K/2], scale fp32 [N, K/group]).
    Element 2j of a row sits in the low nibble of byte j, element 2j+1 in the high nibble."""
    n, k = w.shape
    if k % group or k % 2:
        raise CheckpointError(f"FP4 packing needs the input side divisible by {group}, got {tuple(w.shape)}")
    g = w.detach().float().reshape(n, k // group, group)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP4_MAX, torch.ones_like(amax))
    x = (g / scale[..., None]).reshape(n, k)
    grid = torch.tensor(FP4_GRID)
    code = (x.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # nearest magnitude (ties: smaller)
    code = code + 8 * ((x < 0) & (code > 0)).long()
    pairs = code.reshape(n, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), scale.contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] -> float32 grid values [N, K] (before scaling)."""
    table = torch.tensor(FP4_GRID + tuple(-v for v in FP4_GRID))
    u = packed.contiguous().view(torch.uint8).long()
    vals = torch.stack([table[u & 0xF], table[u >> 4]], dim=-1)
    return vals.reshape(packed.shape[0], 2 * packed.shape[1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale grid as fp32: float scales as is; UE8M0 bytes (uint8 or float8_e8m0fnu) as 2**(b-127)."""
    if scale.dtype == torch.uint8:
        return (scale.float() - 127.0).exp2()
    return scale.float()


def dequantize_weight(name: str, q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """One stored (weight, scale) pair -> dense weight; FP4 when the weight is int8-packed."""
    if q.dtype == torch.int8:
        values = unpack_fp4(q)
    elif q.dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32):
        values = q.float()
    else:
        raise CheckpointError(f"{name}: cannot dequantise a weight stored as {q.dtype}")
    if scale.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D scale grid, got shape {tuple(scale.shape)}")
    return dequantize_blocks(values, scale_to_float(scale), dtype)
