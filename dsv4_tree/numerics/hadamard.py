"""The normalised Walsh-Hadamard rotation DeepSeek-V4's C4 indexer applies to its keys before
FP8 quantisation (SGLang 0.5.23's `fused_norm_rope_v2.cuh`, part 3): butterflies (a + b, a - b)
over every bit of the channel index, lowest bit first, then a 1/sqrt(d) scale, which is
y[k] = d^-1/2 sum_j (-1)^popcount(j & k) x[j]. Index scores q.k are unchanged by it; it spreads
outliers before quantisation. Each row is transformed on its own, in the same order of fp32 adds
whatever the batch, so a row's result does not depend on the rows beside it."""
from __future__ import annotations

import torch

from ..errors import ConfigError


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] (d a power of two) -> the rotated rows in fp32."""
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ConfigError(f"hadamard_rotate: channel count {d} is not a power of two")
    y = x.to(torch.float32)
    lead = y.shape[:-1]
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d)
        h *= 2
    return y * d ** -0.5
