"""DeepSeek-V4's interleaved RoPE on the trailing rope channels, in fewer ops than transformers'
`apply_rotary_pos_emb`, which expands cos / sin with `repeat_interleave` and builds
`rotate_half` with a stack on every call.

`rope_pairs` turns transformers' per-pair angles (cos, sin [B, T, half]) into pair tables once
per forward: C = (c, c) and S = (-s, s) per channel pair, [B, T, half, 2]. `apply_rope` then
rotates each pair (e, o) as (e, o) * C + (o, e) * S, that is e' = e*c + o*(-s) and
o' = o*c + e*s: transformers' products and sums (e*c + (-o)*s rounds identically to
e*c + o*(-s)), in fp32, so the result is bitwise the same. The inverse rope (attention outputs)
passes -S, as transformers passes -sin. The leading nope channels pass through.

`rope_tables` widens pair tables to a head's full width once per forward: C = 1 and S = 0 on
the nope channels, shaped [B, 1, T, width] to broadcast over heads. `apply_rope` given such
tables rotates the whole row in one multiply-add with its pair-swapped copy (6 ops, against
11 with pair tables: no slicing and no concatenation): the rope channels get the same products
and sums as above, and a nope channel x becomes x*1 + x'*0 = x (for finite x; a -0.0 may come
back as +0.0, which compares equal)."""
from __future__ import annotations

import torch

from .casts import as_dtype, f32


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos / sin [B, T, half] -> pair tables (C, S) [B, T, half, 2]."""
    return torch.stack([cos, cos], dim=-1), torch.stack([-sin, sin], dim=-1)


def rope_tables(c: torch.Tensor, s: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair tables (C, S) [B, T, half, 2] -> full-width tables [B, 1, T, width] (fp32)."""
    b, t, half = c.shape[:3]
    nope = width - 2 * half
    if nope < 0 or nope % 2:
        raise ValueError(f"rope_tables: width {width} cannot hold {half} rope pairs after an even nope part")
    kw = dict(dtype=torch.float32, device=c.device)
    full_c = torch.cat([torch.ones(b, t, nope, **kw), f32(c).flatten(-2)], -1).unsqueeze(1)
    full_s = torch.cat([torch.zeros(b, t, nope, **kw), f32(s).flatten(-2)], -1).unsqueeze(1)
    return full_c, full_s


def apply_rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """x [..., d] with its last 2*half channels roped. (c, s): pair tables from rope_pairs,
    unsqueezed at `unsqueeze_dim` to broadcast over heads as in transformers' function; or
    full-width tables from rope_tables (last dim d), which broadcast as they are."""
    if c.shape[-1] == x.shape[-1]:  # full-width tables (pair tables end in 2)
        if c.dim() != x.dim():
            raise ValueError(f"apply_rope: full-width tables {tuple(c.shape)} do not broadcast against "
                             f"x {tuple(x.shape)} (rope_tables makes [B, 1, T, width] for x [B, H, T, width])")
        y = f32(x)
        out = y * c + y.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * s
        return as_dtype(out, x.dtype)
    half = c.shape[-2]
    pairs = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    rotated = pairs * c.unsqueeze(unsqueeze_dim) + pairs.flip(-1) * s.unsqueeze(unsqueeze_dim)
    return torch.cat([x[..., : -2 * half], rotated.flatten(-2).to(x.dtype)], dim=-1)
