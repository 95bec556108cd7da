"""DeepSeek-V4's interleaved RoPE on the trailing rope channels, in fewer ops than transformers'
`apply_rotary_pos_emb`, which expands cos / sin with `repeat_interleave` and builds
`rotate_half` with a stack on every call.

`rope_pairs` turns transformers' per-pair angles (cos, sin [B, T, half]) into pair tables once
per forward: C = (c, c) and S = (-s, s) per channel pair, [B, T, half, 2]. `apply_rope` then
rotates each pair (e, o) as (e, o) * C + (o, e) * S, that is e' = e*c + o*(-s) and
o' = o*c + e*s: transformers' products and sums (e*c + (-o)*s rounds identically to
e*c + o*(-s)), in fp32, so the result is bitwise the same. The inverse rope (attention outputs)
passes -S, as transformers passes -sin. The leading nope channels pass through."""
from __future__ import annotations

import torch


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos / sin [B, T, half] -> pair tables (C, S) [B, T, half, 2]."""
    return torch.stack([cos, cos], dim=-1), torch.stack([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """x [..., d] with its last 2*half channels roped; (c, s) from rope_pairs, unsqueezed at
    `unsqueeze_dim` to broadcast over heads, as in transformers' function."""
    half = c.shape[-2]
    pairs = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    rotated = pairs * c.unsqueeze(unsqueeze_dim) + pairs.flip(-1) * s.unsqueeze(unsqueeze_dim)
    return torch.cat([x[..., : -2 * half], rotated.flatten(-2).to(x.dtype)], dim=-1)
