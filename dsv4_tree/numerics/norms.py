"""transformers' DeepSeek-V4 RMSNorm modules as one `F.rms_norm` call on fp32 inputs.

`DeepseekV4RMSNorm` (weighted) and `DeepseekV4UnweightedRMSNorm` compute, in fp32,
x * rsqrt(mean(x^2) + eps) (times the weight) in six tensor ops behind a module call; on the
tiny models a decode step makes ~35 of these calls. For fp32 inputs and weights the fused
op computes the same expression; any other dtype goes through the module itself (its casts
to and from fp32 are part of its numerics)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """module(x), through F.rms_norm where x (and the weight, if any) are fp32."""
    weight = getattr(module, "weight", None)
    if x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
        return module(x)
    eps = module.variance_epsilon if weight is not None else module.eps
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
